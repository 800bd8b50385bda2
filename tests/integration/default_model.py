"""The one rule integration tests use to reach the real default model: skip (with the resolver's message, which
says how to install it) when it is not on this machine."""

from __future__ import annotations

import pytest

from tqbench.engine.models import ModelNotFoundError, resolve_model


def require_default_model() -> None:
    try:
        resolve_model("default")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
