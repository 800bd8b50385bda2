"""``export``: a policy as an engine's closest KV setting, what it cannot map, and both measured here."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tqbench.cli import main
from tqbench.engine.cache import KVGeometry, default_geometry
from tqbench.engine.deploy import export_policy, map_policy
from tqbench.engine.engine import Engine
from tqbench.engine.policy import parse_policy

ALLOC = "tqbench/data/policies/smollm2-alloc-2.5bit.toml"


def run(*args):
    return CliRunner().invoke(main, ["--headless", *args])


def test_allocation_to_llamacpp_names_the_flags_and_what_it_could_not_map():
    s = map_policy(ALLOC, "llamacpp", default_geometry())
    assert (s.k_type, s.v_type, s.mapped_policy) == ("q4_0", "q4_0", "llamacpp:q4_0")
    assert s.lines[0] == "llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on"
    assert s.unmapped[0].startswith("per-layer K widths (turbo2 on 10 layers, turbo3 on 12 layers, turbo1 on 8 "
                                    "layers): llama.cpp has one K type for every layer")
    assert s.unmapped[1].startswith("per-layer V widths (turbo3 on 4 layers, turbo2 on 14 layers, turbo1 on 12")
    assert "sink=4 / recent=16 full-precision tokens: llama.cpp stores every token in its cache type" in s.unmapped
    assert s.unmapped[-1] == ("the llama.cpp setting stores 4.50 bits/element against the policy's 2.48: the cache "
                              "is 1.81x larger")
    assert s.mapped_bits == 4.5 and round(s.original_bits, 4) == 2.4833
    assert any("flash attention (-fa on)" in n for n in s.notes)


def test_an_engine_setting_maps_onto_itself_with_nothing_lost():
    s = map_policy("llamacpp:q8_0/q4_0", "llamacpp", default_geometry())
    assert (s.k_type, s.v_type, s.unmapped, s.original_bits, s.mapped_bits) == ("q8_0", "q4_0", (), 6.5, 6.5)
    assert "GGML_CUDA_FA_ALL_QUANTS" in " ".join(s.notes)
    v = map_policy("vllm:fp8", "vllm", default_geometry())
    assert v.lines == ("vllm serve MODEL --kv-cache-dtype fp8",) and v.unmapped == ()


def test_nearest_types_per_role_and_vllm_skip_layers():
    geo = default_geometry()  # 30 layers
    s = map_policy("k=int8,v=int4,protect=first2+last2", "llamacpp", geo)
    assert (s.k_type, s.v_type) == ("q8_0", "q4_1")
    assert "fp16 layers 0,1,28,29: llama.cpp cannot leave single layers unquantized" in " ".join(s.unmapped)
    v = map_policy("k=int8,v=int4,protect=first2+last2", "vllm", geo)
    assert v.skip_layers == (0, 1, 28, 29)
    assert v.lines == ("vllm serve MODEL --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 1 28 29",)
    assert v.mapped_policy == "k=fp8_e4m3,v=fp8_e4m3,kv@0+1+28+29=fp16"
    assert "different K and V codecs: vLLM's --kv-cache-dtype sets both" in " ".join(v.unmapped)
    t = map_policy("turbo4", "vllm", geo)
    assert (t.k_type, t.v_type, t.mapped_policy) == ("turboquant_4bit_nc",) * 2 + ("vllm:turboquant_4bit_nc",)
    assert t.lines == ("vllm serve MODEL --kv-cache-dtype turboquant_4bit_nc",)
    assert ("V codec turbo4: vLLM has no such KV type; the nearest to its 4.25 bits/element is turboquant_4bit_nc "
            "(V stored as vllm_u4, 4.50 bits/element)") in t.unmapped
    assert ("vLLM's turboquant_4bit_nc keeps layers 0,1,28,29 at the model's dtype (its boundary protection, always "
            "on for non-hybrid models): the policy compresses 0,1,28,29") in t.unmapped
    assert t.notes[0].startswith("storage-only: the mapped policy stores vLLM's TurboQuant bytes bit for bit")
    # head_dim 64: K 32 + 2 B, V 32 + 4 B per row on 26 layers, 4 layers fp16; the 64 x 64 fp32 Hadamard matrix and
    # the 16-entry codebook once, over 30 layers x 3 heads x 1,024 tokens x 64 x 2 elements
    shared = (64 * 64 * 4 + 16 * 4) * 8 / (30 * 3 * 1024 * 64 * 2)
    assert round(t.mapped_bits, 6) == round((26 * (34 + 36) * 8 / 128 + 4 * 16) / 30 + shared, 6)
    assert map_policy("k=turbo3,v=turbo4", "vllm", geo).k_type == "turboquant_k3v4_nc"
    assert map_policy("turbo2", "vllm", geo).k_type == "turboquant_3bit_nc"
    assert map_policy("k=int8,v=turbo4", "vllm", geo).k_type == "turboquant_k8v4"
    own = map_policy("vllm:turboquant_k3v4_nc", "vllm", geo)
    assert own.unmapped == () and own.original_bits == own.mapped_bits and own.skip_layers == ()
    extra = map_policy("k=turbo4,v=turbo4,kv@5=fp16", "vllm", geo)  # a dense layer vLLM does not skip by itself
    assert extra.skip_layers == (5,) and extra.lines[0].endswith("turboquant_4bit_nc --kv-cache-dtype-skip-layers 5")
    odd = map_policy("turbo4", "vllm", KVGeometry(30, 2, 96))  # no Hadamard of order 96: fp8 keys only
    assert odd.k_type == "turboquant_k8v4"
    g = map_policy("turbo4", "sglang", geo)
    assert g.lines == ("python -m sglang.launch_server --model-path MODEL --kv-cache-dtype fp4_mx_block16",)
    assert g.mapped_bits == 4.5
    r = map_policy("turbo4", "trtllm", geo)
    assert r.lines[1:] == ("kv_cache_config:", "  dtype: fp8") and r.mapped_policy == "trtllm:fp8"


def test_head_dim_without_ggml_blocks_maps_to_f16_and_says_why():
    s = map_policy("turbo4", "llamacpp", KVGeometry(4, 2, 16))
    assert (s.k_type, s.v_type) == ("f16", "f16")
    assert ("llama.cpp's q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl need head_dim a multiple of 32 (this model: 16): not "
            "available for this model") in s.unmapped


def test_bad_engine_and_measure_without_model():
    with pytest.raises(ValueError, match="unknown engine 'ollama': valid engines are llamacpp, vllm, sglang, trtllm"):
        map_policy("turbo4", "ollama", default_geometry())
    with pytest.raises(ValueError, match="measuring the mapped setting needs a loaded model"):
        export_policy("turbo4", "vllm", geometry=default_geometry())


def test_measured_export_on_the_tiny_model():
    engine = Engine.tiny(head_dim=32)
    rep = export_policy("k=turbo4,v=turbo4,recent=4", "llamacpp", engine=engine, corpus="bread", context_tokens=24,
                        eval_tokens=6)
    assert rep.original.kv_policy == "k=turbo4,v=turbo4,recent=4" and rep.mapped.kv_policy == "llamacpp:q4_0"
    assert rep.mapped.bits_per_element == 4.5 and rep.measured.steps == 6
    assert rep.original.kl_mean >= 0 and rep.mapped.kl_mean > 0 and 0 <= rep.mapped.top1_agreement <= 1
    d = rep.to_dict()
    assert d["measured"]["mapped"]["kv_policy"] == "llamacpp:q4_0" and d["lines"][0].endswith("-ctv q4_0 -fa on")


def test_cli_export_of_the_saved_allocation_to_llamacpp():
    r = run("export", ALLOC, "--to", "llamacpp", "--no-measure")
    assert r.exit_code == 0, r.output
    assert "llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on" in r.stdout
    assert "could not map:" in r.stdout and "per-layer K widths" in r.stdout
    j = run("export", ALLOC, "--to", "vllm", "--no-measure", "--json")
    d = json.loads(j.stdout)
    assert d["lines"] == ["vllm serve MODEL --kv-cache-dtype turboquant_3bit_nc"]
    assert round(d["mapped_bits_per_element"], 4) == 5.0695


def test_cli_export_measured_on_tiny_and_bad_input():
    r = run("export", "turbo4", "--to", "vllm", "--model", "tiny", "--corpus", "bread", "--tf-context", "16",
            "--tf-tokens", "4", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    mapped = d["measured"]["mapped"]
    assert d["measured"]["original"]["kv_policy"] == "turbo4" and mapped["kv_policy"] == "vllm:turboquant_4bit_nc"
    assert mapped["kl_mean"] >= 0 and any(n.startswith("storage-only") for n in d["notes"])
    assert d["cost"]["kl_mean_delta"] == mapped["kl_mean"] - d["measured"]["original"]["kl_mean"]
    assert abs(d["cost"]["bits_per_element_delta"] - (d["mapped_bits_per_element"] - d["original_bits_per_element"])) < 2e-4
    bad = run("export", "turbo9", "--to", "llamacpp", "--no-measure")
    assert bad.exit_code == 2 and "unknown policy preset 'turbo9'" in bad.stderr


def test_cli_export_prints_the_mapping_first_and_the_cost_before_measuring():
    """The flags come before any measurement; what the measurement will run is said on stderr before it starts,
    and a piped stderr gets plain progress lines with the units done of the total."""
    r = run("export", "turbo4", "--to", "llamacpp", "--model", "tiny", "--corpus", "bread", "--tf-context", "16",
            "--tf-tokens", "4")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.index("llama-server -m MODEL.gguf -ctk f16 -ctv f16") < out.index("measured here")
    err = r.stderr
    assert "measuring: teacher-forced on bread, 16 prefill + 4 scored tokens" in err
    assert "export: baseline 4/4" in err and "export: candidate 4/4" in err
    bad = run("export", "turbo4", "--to", "llamacpp", "--model", "tiny", "--verify", "--kld-chunks", "0")
    assert bad.exit_code == 2 and "with --kld-chunks 1 or more" in bad.stderr


def test_llamacpp_kld_prediction_runs_only_the_chunks_asked_for():
    """``chunks`` caps the prediction like llama-perplexity's --chunks: scored tokens and forward passes (one
    Progress event each, the total known from the first) follow it."""
    from tqbench.engine.deploy.llamacpp_verify import kld_plan, llamacpp_kld_report
    from tqbench.engine.events import Progress

    engine = Engine.load("tiny-llama")
    events = []
    rep = llamacpp_kld_report(engine, "q8_0", "q8_0", texts=("corpus:bread",), n_ctx=64, chunks=1,
                              on_event=events.append)
    assert rep.predicted[0].tokens == 31 and rep.chunks == 1 and "--chunks 1" in rep.protocol
    assert [(e.done, e.total) for e in events if isinstance(e, Progress)] == [(1, 2), (2, 2)]
    assert kld_plan(("a", "b"), 1) == (4, "2 text(s) x 1 chunk(s) x (f16 baseline + the flags) = 4 forward passes")
    with pytest.raises(ValueError, match="chunks=0: give 1 or more"):
        llamacpp_kld_report(engine, "q8_0", "q8_0", chunks=0)


def test_the_sliding_layers_recent_rows_are_named_among_what_is_not_mapped():
    s = map_policy(parse_policy("k=turbo2,v=turbo2,sink=4,srecent=32"), "llamacpp", default_geometry())
    assert "sink=4 / recent=0 / srecent=32 full-precision tokens: llama.cpp stores every token in its cache type" \
        in s.unmapped


def test_llamacpp_chunks_start_with_the_bos_where_the_vocabulary_adds_one(monkeypatch):
    """llama-perplexity replaces every chunk's first token by the BOS where its vocabulary adds one (Gemma-3; the
    base file holds the text's own tokens): the prediction runs the chunks so. Where no BOS is added (SmolLM2),
    the chunks are the text's tokens as they are."""
    import torch

    from tqbench.engine.deploy import llamacpp_verify
    from tqbench.engine.deploy.llamacpp_kld import KldResult, with_bos

    toks = torch.arange(12).reshape(3, 4) + 5
    assert torch.equal(with_bos(toks, 9), toks) and torch.equal(with_bos(toks, None), toks)
    toks[0, 0] = 2
    assert with_bos(toks, 2)[:, 0].tolist() == [2, 2, 2] and toks[1, 0] == 9  # a copy: the input is kept
    assert torch.equal(with_bos(toks, 2)[:, 1:], toks[:, 1:])

    engine = Engine.load("tiny-llama")
    plain = engine.tokenizer

    class AddsBos:  # the tiny tokenizer, adding a BOS first as Gemma's does
        bos_token_id = 1

        def __call__(self, text, **kw):
            out = plain(text, **kw)
            out["input_ids"] = torch.cat([torch.tensor([[1]]), out["input_ids"]], 1)
            return out

    seen = []

    def fake_predict(engine, tokens, settings, **kw):
        seen.append(tokens)
        return [KldResult("q8_0", "q8_0", 0.0, 0.0, 100.0, 1.0, 1.0, 31, "tqbench")]

    monkeypatch.setattr(llamacpp_verify, "predict_llamacpp_kld", fake_predict)
    monkeypatch.setattr(engine, "tokenizer", AddsBos())
    llamacpp_verify.llamacpp_kld_report(engine, "q8_0", "q8_0", texts=("corpus:bread",), n_ctx=64, chunks=3)
    monkeypatch.setattr(engine, "tokenizer", plain)
    llamacpp_verify.llamacpp_kld_report(engine, "q8_0", "q8_0", texts=("corpus:bread",), n_ctx=64, chunks=3)
    with_b, without = seen
    assert with_b.shape == (3, 64) and with_b[:, 0].tolist() == [1, 1, 1]
    assert without[:, 0].tolist() != [1, 1, 1] and 1 not in without[:, 0].tolist()
