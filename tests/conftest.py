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
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the I-th of N shares of the test files (tests/run_shards.py runs all N at once)")


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


def _shard(config) -> tuple[int, int] | None:
    """``--shard I/N`` parsed (1 <= I <= N), or None; a bad value is a one-line usage error."""
    value = config.getoption("--shard")
    if not value:
        return None
    i, _, n = value.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise pytest.UsageError(f"--shard {value!r}: give I/N with 1 <= I <= N, e.g. --shard 1/2")
    return int(i), int(n)


def pytest_collection_modifyitems(config, items):
    """``--shard I/N`` keeps the I-th of N shares of the test files: files sorted by path are dealt round-robin,
    so each share holds about 1/N of every directory (a file never splits: its module fixtures load once).
    ``tests/run_shards.py`` (``make test``) runs the N shares at once, one per core."""
    shard = _shard(config)
    if shard is None:
        return
    i, n = shard
    files = sorted({item.nodeid.split("::")[0] for item in items})
    mine = {f for k, f in enumerate(files) if k % n == i - 1}
    keep = [item for item in items if item.nodeid.split("::")[0] in mine]
    dropped = [item for item in items if item.nodeid.split("::")[0] not in mine]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
