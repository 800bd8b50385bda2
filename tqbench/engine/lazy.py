"""Lazy package names: a package's ``__getattr__`` / ``__dir__`` that import a public name's module on first use
(so a cheap check, such as a byte estimate or a budget's bounds, does not import transformers)."""

from __future__ import annotations

import importlib


def lazy_names(package: str, table: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package`` whose public names live in the modules ``table`` names; any other
    attribute is tried as a submodule (``package.name``) not imported yet."""

    def __getattr__(name: str):
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted({*importlib.import_module(package).__dict__, *table})

    return __getattr__, __dir__
