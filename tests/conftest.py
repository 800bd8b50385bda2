import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_engine():
    from tqbench.engine.engine import Engine

    return Engine.tiny()


@pytest.fixture(scope="session")
def tiny_engine64():
    """The tiny model in float64: equivalent attention paths give identical tokens."""
    import torch

    from tqbench.engine.engine import Engine

    return Engine.tiny(dtype=torch.float64)
