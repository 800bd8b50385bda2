"""Every public name resolves: ``tqbench.__all__`` (lazy, ``_LAZY``) and the ``__all__`` of each room."""

from __future__ import annotations

import ast
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


def _declares_all(package: str) -> bool:
    """Whether the package's ``__init__.py`` assigns ``__all__`` (read, not imported: collection stays light)."""
    init = os.path.join(os.path.dirname(tqbench.__file__), *package.split(".")[1:], "__init__.py")
    with open(init, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    return any(isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.unparse(node).split("=")[0]
               for node in tree.body)


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


@pytest.mark.parametrize("package", sorted(p for p in _packages() if _declares_all(p)))
def test_room_all_resolves(package):
    mod = importlib.import_module(package)
    names = mod.__all__
    assert len(set(names)) == len(names), f"{package}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(mod, n)]
    assert missing == [], f"{package}.__all__ names that do not resolve: {missing}"
