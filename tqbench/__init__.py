"""tqbench: a workbench for KV-cache compression policies on Hugging Face decoder models.

``from tqbench import Engine, Policy, CompressedDynamicCache`` loads torch lazily, so ``tqbench --help``
stays fast.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: public name -> (module, attribute): every name comes through the engine's door (``tqbench.engine``)
_LAZY = {name: ("tqbench.engine", name) for name in
         ("Engine", "Policy", "parse_policy", "TQCache", "CompressedDynamicCache", "Sampling")}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tqbench' has no attribute {name!r}")
