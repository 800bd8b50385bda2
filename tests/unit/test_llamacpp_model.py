"""tqbench's model of llama.cpp's compute path (``deploy.llamacpp_attention`` / ``llamacpp_matmul``): the query
conversion bit for bit against ggml-cpu's x86 quantizers, and the attention's paths, on fixed inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tqbench.engine.deploy.llamacpp_attention import (
    VEC_DOT_TYPE,
    f16_v_accumulation,
    quantize_row_q8,
    query_as_vec_dot,
    stored,
)
from tqbench.engine.deploy.llamacpp_matmul import quantize_row_q8_k

# the bytes llama.cpp 11434's ggml-cpu writes for ``vector()``: a C program calling
# ``ggml_get_type_traits_cpu(GGML_TYPE_Q8_0 / GGML_TYPE_Q8_1)->from_float(x, y, 64)``, linked against the
# libggml-cpu.a / libggml-base.a of ``tqbench --headless llamacpp build`` (x86, AVX2 and AVX-512 CPU)
GGML_Q8_0 = [0, 60, 127, 2, 252, 0, 0, 2, 250, 255, 255, 0, 3, 5, 5, 2, 0, 254, 253, 254, 0, 4, 7, 1, 1, 255, 252, 251,
             252, 0, 1, 2, 3, 1, 169, 44, 229, 182, 163, 248, 2, 29, 55, 57, 129, 216, 244, 229, 232, 5, 48, 82, 79, 3,
             244, 219, 203, 217, 8, 69, 14, 22, 10, 232, 193, 177, 203, 2]
GGML_Q8_1 = [0, 60, 40, 88, 127, 2, 252, 0, 0, 2, 250, 255, 255, 0, 3, 5, 5, 2, 0, 254, 253, 254, 0, 4, 7, 1, 1, 255,
             252, 251, 252, 0, 1, 2, 3, 1, 169, 44, 151, 205, 229, 182, 163, 248, 2, 29, 55, 57, 129, 216, 244, 229,
             232, 5, 48, 82, 79, 3, 244, 219, 203, 217, 8, 69, 14, 22, 10, 232, 193, 177, 203, 2]


def vector() -> torch.Tensor:
    """x[i] = sinf(0.7 i) * (i % 7 + 1), block 0 set to ties at scale 1 (127, 2.5, -3.5, 0.5, -0.5, 1.5), x[40] = -9.25."""
    # sinf in fp32, as the C program computes it
    x = torch.sin(torch.arange(64, dtype=torch.float32) * torch.tensor(0.7, dtype=torch.float32)) * \
        (torch.arange(64) % 7 + 1).to(torch.float32)
    x[:6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5])
    x[40] = -9.25
    return x


def _f16_bytes(v: torch.Tensor) -> list[int]:
    return v.to(torch.float16).reshape(-1).view(torch.uint8).tolist()


def test_q8_0_query_conversion_is_ggml_cpu_bit_for_bit():
    d, q, _ = quantize_row_q8(vector())
    got = []
    for b in range(2):
        got += _f16_bytes(d[b]) + q[b].view(torch.uint8).tolist()
    assert got == GGML_Q8_0
    assert q[0, :6].tolist() == [127, 2, -4, 0, 0, 2]  # ties to even; the _ref quantizer (roundf) gives 3, -4, 1, -1, 2


def test_q8_1_query_conversion_and_block_sum_are_ggml_cpu_bit_for_bit():
    d, q, s = quantize_row_q8(vector())
    got = []
    for b in range(2):
        got += _f16_bytes(d[b]) + _f16_bytes(s[b]) + q[b].view(torch.uint8).tolist()
    assert got == GGML_Q8_1


def test_query_conversion_follows_the_k_type():
    x = vector().reshape(1, 64)
    for k in ("q8_0", "q4_0", "q5_0", "iq4_nl"):
        vals, s = query_as_vec_dot(x, k)
        assert s is None and vals[0, 1].item() == 2.0  # q8_0 blocks
    vals, s = query_as_vec_dot(x, "q4_1")
    assert s is not None and s.shape == (1, 2)
    vals, s = query_as_vec_dot(x, "f16")
    assert s is None and torch.equal(vals, x.half().float())
    assert set(VEC_DOT_TYPE) == {"f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "iq4_nl", "q4_1", "q5_1"}
    assert f16_v_accumulation("q8_0", "f16") and not f16_v_accumulation("f16", "f16")
    assert not f16_v_accumulation("q8_0", "q8_0")


def test_stored_q8_0_is_the_x86_cache_quantizer_and_1_types_return_minima():
    x = vector().reshape(2, 32)
    vals, m = stored(x, "q8_0")
    assert m is None and vals[0, :6].tolist() == [127.0, 2.0, -4.0, 0.0, 0.0, 2.0]
    vals, m = stored(x, "q4_1")
    assert m.shape == (2, 1) and torch.allclose(m[:, 0], x.amin(-1).half().float())
    with pytest.raises(ValueError, match="'q3_k' is not a llama.cpp KV type"):
        stored(x, "q3_k")


def test_q8_k_activation_quantization():
    x = torch.zeros(256)
    x[0], x[1], x[2] = -127.0, 0.5, 1.5  # iscale = -127 / -127 = 1: ties to even
    y = quantize_row_q8_k(x)
    assert y[:3].tolist() == [-127.0, 0.0, 2.0]
    assert torch.equal(quantize_row_q8_k(torch.zeros(256)), torch.zeros(256))


def test_attention_model_on_a_tiny_model():
    """f16/f16 against itself is exactly 0; q8_0 and q4_0 caches move the output, q4_0 more; the tiled-path
    model (f32/f32) equals the model's own attention."""
    from tqbench.engine.deploy.llamacpp_attention import llamacpp_kv
    from tqbench.engine.deploy.llamacpp_kld import predict_llamacpp_kld
    from tqbench.engine.engine import Engine

    engine = Engine.load("tiny-llama")
    model = engine.model
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(input_ids=ids[:1], use_cache=False).logits
        with llamacpp_kv(model, "f32", "f32"):
            modelled = model(input_ids=ids[:1], use_cache=False).logits
    assert torch.allclose(plain, modelled, atol=1e-5)
    assert model.config._attn_implementation != "tqbench-llamacpp-cpu"  # restored
    res = predict_llamacpp_kld(engine, ids, [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0")], gguf=None)
    assert res[0].kld_mean == 0.0 and res[0].same_top_pct == 100.0
    assert 0 < res[1].kld_mean < res[2].kld_mean
    assert res[1].tokens == 2 * 31 and "no GGUF" in res[1].note


def test_quantized_caches_are_hadamard_rotated_as_llamacpp_stores_them():
    from tqbench.engine.deploy.llamacpp_attention import hadamard, llamacpp_kv, rotated

    h = hadamard()
    assert h.shape == (64, 64) and torch.allclose(h @ h, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)
    assert rotated("q4_0", 64) and rotated("q8_0", 128) and not rotated("f16", 64) and not rotated("q4_0", 96)
    with pytest.raises(ValueError, match="'q3_k' is not a llama.cpp KV type"):
        with llamacpp_kv(None, "q3_k", "f16"):
            pass


def test_gemma3_as_llamacpp_computes_it():
    """Gemma-3's sliding windows, its query scale (applied before attention, as llama.cpp's graph does) and one
    KV head: the all-fp32 path equals transformers' own attention on a model whose prompt passes its window; a
    q8_0 cache moves it; K is rotated in blocks of n_rot_k (256 for head_dim 256), V in blocks of 64."""
    from tqbench.engine.deploy.llamacpp_attention import llamacpp_kv, n_rot_k
    from tqbench.engine.models.families import family_model

    assert [n_rot_k(d) for d in (64, 128, 192, 256, 320)] == [64, 128, 64, 256, 64]
    model = family_model("gemma3_text", num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=48).model
    assert model.config.sliding_window == 8 and "sliding_attention" in model.config.layer_types
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        plain = model(input_ids=ids, use_cache=False).logits
        with llamacpp_kv(model, "f32", "f32"):
            modelled = model(input_ids=ids, use_cache=False).logits
        with llamacpp_kv(model, "q8_0", "q8_0"):
            q8 = model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(plain, modelled, atol=1e-5)  # a window ignored or a scale misplaced would break this
    assert not torch.allclose(plain, q8, atol=1e-5) and torch.allclose(plain, q8, atol=0.5)
    # a float64 model keeps its dtype through the modelled attention (the scaled query is widened to fp32 only
    # inside it; its output used to come back fp32 and o_proj refused it)
    model64 = model.to(torch.float64)
    with torch.inference_mode(), llamacpp_kv(model64, "q8_0", "q8_0"):
        q8_64 = model64(input_ids=ids, use_cache=False).logits
    assert q8_64.dtype == torch.float64 and torch.allclose(q8_64.float(), q8, atol=0.05)


def test_gguf_architecture_names_and_refusal():
    from tqbench.engine.deploy.llamacpp_matmul import gguf_arch

    assert (gguf_arch("gemma3_text"), gguf_arch("llama"), gguf_arch("mistral"), gguf_arch("qwen3")) == (
        "gemma3", "llama", "llama", "qwen3")
    with pytest.raises(ValueError, match="no GGUF architecture named 'gpt_neox' \\(transformers model_type "
                                         "'gpt_neox'\\): llama.cpp's matrix products cannot be mapped"):
        gguf_arch("gpt_neox")


def test_activation_types_follow_the_file_and_refuse_unmodelled_matrices(monkeypatch):
    """The GGUF's own architecture names its tensors; a matrix no linear layer multiplies (fused experts) is
    refused, not skipped."""
    import gguf

    from tqbench.engine.deploy import llamacpp_matmul
    from tqbench.engine.engine import Engine

    model = Engine.load("tiny-llama").model
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    types = {f"{names.get_name(n)}.weight": "Q4_K" for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    types["output.weight"] = "Q6_K"
    types["token_embd.weight"] = "Q8_0"
    monkeypatch.setattr(llamacpp_matmul, "_gguf_tensors", lambda path: ("llama", types, set(types)))
    kinds = llamacpp_matmul.activation_types(model, Path("tiny.gguf"))
    assert set(kinds.values()) == {"q8_K"} and len(kinds) == len(types) - 1
    extra = {**types, "blk.0.ffn_gate_exps.weight": "Q4_K"}
    monkeypatch.setattr(llamacpp_matmul, "_gguf_tensors", lambda path: ("llama", extra, set(extra)))
    with pytest.raises(ValueError, match="llama: GGUF matrices blk.0.ffn_gate_exps.weight are not multiplied by "
                                         "linear layers here"):
        llamacpp_matmul.activation_types(model, Path("tiny.gguf"))
