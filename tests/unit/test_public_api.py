"""Every public name resolves: ``tqbench.__all__`` (lazy, ``_LAZY``) and the ``__all__`` of each room."""

from __future__ import annotations

import importlib
import os
import pkgutil

import pytest

import tqbench


def _packages(package: str = "tqbench"):
    """Every package under ``tqbench`` (found on disk; a room is a package)."""
    yield package
    base = os.path.join(os.path.dirname(tqbench.__file__), *package.split(".")[1:])
    for info in pkgutil.iter_modules([base]):
        if info.ispkg:
            yield from _packages(f"{package}.{info.name}")


def test_top_level_lazy_names_resolve():
    assert tqbench.__all__ == ["__version__", *tqbench._LAZY]
    for name, (module, attr) in tqbench._LAZY.items():
        value = getattr(tqbench, name)
        assert value is getattr(importlib.import_module(module), attr), name
    with pytest.raises(AttributeError):
        tqbench.NoSuchName  # noqa: B018


def test_public_api_names():
    for name in ("Engine", "Policy", "parse_policy", "TQCache", "Sampling", "CompressedDynamicCache"):
        assert name in tqbench.__all__


@pytest.mark.parametrize("package", sorted(_packages()))
def test_room_all_resolves(package):
    mod = importlib.import_module(package)
    names = getattr(mod, "__all__", None)
    if names is None:
        pytest.skip(f"{package} has no __all__")
    assert len(set(names)) == len(names), f"{package}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(mod, n)]
    assert missing == [], f"{package}.__all__ names that do not resolve: {missing}"
