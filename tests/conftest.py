import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads TRITON_INTERPRET when a kernel is decorated (transformers imports triton when installed), so the
# kernel tests' interpreter switch must be set before any test module loads: here. Only where no GPU is present:
# on a CUDA machine the kernel tests run on the GPU. An explicit TRITON_INTERPRET (gpu_check.sh sets 0 or 1)
# wins. The check imports torch (which does not import triton) before any test module does.
if "TRITON_INTERPRET" not in os.environ:
    from tqbench.kernels import needs_interpreter

    if needs_interpreter():
        os.environ["TRITON_INTERPRET"] = "1"


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


def pytest_addoption(parser):
    parser.addoption("--threads", type=int, default=1,
                     help="torch threads for the tiny-model tests (default 1); the suite must pass with any "
                          "count, on a loaded machine too")


@pytest.fixture(autouse=True)
def _one_thread_for_unit_tests(request):
    """Tiny-model tests are dispatch bound: one thread avoids OpenMP oversubscription on a busy machine."""
    import torch

    if "integration" in str(request.node.fspath):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(request.config.getoption("--threads"))
    yield
    torch.set_num_threads(before)
