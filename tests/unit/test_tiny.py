"""The tiny random model: deterministic, generates, real tokenizer with a chat template."""

from __future__ import annotations

import pytest
import torch

from tqbench.engine.models.tiny import BOS_ID, CHAT_TEMPLATE, EOS_ID, PAD_ID, tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes gain nothing from threads, and OpenMP threads crawl when the machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def chat_ids(tokenizer, text="What is the capital of France?"):
    messages = [{"role": "user", "content": text}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return enc["input_ids"]


def test_deterministic_for_a_seed_and_leaves_global_rng_alone(tiny):
    state = torch.get_rng_state()
    again = tiny_model(seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    x = torch.tensor([[BOS_ID, 50, 60, 70, 80]])
    with torch.no_grad():
        assert torch.equal(tiny.model(x).logits, again.model(x).logits)
        assert not torch.equal(tiny.model(x).logits, tiny_model(seed=1).model(x).logits)
    assert tiny.fingerprint == again.fingerprint != tiny_model(seed=1).fingerprint


def test_loaded_model_fields(tiny):
    assert tiny.name == "tiny-random" and tiny.device == torch.device("cpu") and tiny.dtype == torch.float32
    assert type(tiny.model).__name__ == "LlamaForCausalLM" and not tiny.model.training
    assert tiny.num_params == sum(p.numel() for p in tiny.model.parameters())
    s = tiny.config_summary
    assert (s["num_layers"], s["num_heads"], s["num_kv_heads"], s["head_dim"]) == (4, 4, 2, 16)
    assert s["layer_types"] is None and 256 < s["vocab_size"] <= 300


def test_tokenizer_round_trip_and_specials(tiny):
    tok = tiny.tokenizer
    text = "Héllo, wörld!\n  tabs\tand 你好 🙂"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok("<|im_end|>")["input_ids"] == [EOS_ID]  # specials are single tokens


def test_chat_template(tiny):
    tok = tiny.tokenizer
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = chat_ids(tok, "hi")
    assert ids.shape == (1, len(tok(text)["input_ids"])) and ids[0, 0].item() == BOS_ID


def test_greedy_generate_is_deterministic_and_varied(tiny):
    ids = chat_ids(tiny.tokenizer)
    out = tiny.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8 and EOS_ID not in out[0, ids.shape[1]:].tolist()  # no early eos here
    assert torch.equal(out, tiny.model.generate(ids, max_new_tokens=8, do_sample=False))
    long = tiny.model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, ids.shape[1] :]
    assert len(set(long.tolist())) > 5  # not one repeated token


def test_left_padded_batch_matches_single_prompts(tiny):
    tok = tiny.tokenizer
    tok.padding_side = "left"
    prompts = ["hello there", "a much longer prompt than the first one"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    out = tiny.model.generate(**batch, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    for row, prompt in enumerate(prompts):
        single = tok(prompt, return_tensors="pt")
        ref = tiny.model.generate(**single, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert out[row, -6:].tolist() == ref[0, -6:].tolist()


def test_float64_and_shape_options():
    shape = {"num_layers": 2, "num_heads": 6, "num_kv_heads": 3, "head_dim": 8, "vocab_size": 300}
    lm = tiny_model(**shape, dtype=torch.float64)
    assert lm.dtype == torch.float64 and next(lm.model.parameters()).dtype == torch.float64
    assert {k: lm.config_summary[k] for k in shape} == shape
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_model(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_model(vocab_size=100)


def test_mixed_sliding_and_full_layers():
    types = ["sliding_attention", "full_attention"] * 2
    mixed = tiny_model(layer_types=types, sliding_window=8)
    assert mixed.config_summary["layer_types"] == types and mixed.config_summary["sliding_window"] == 8
    wide = tiny_model(layer_types=types, sliding_window=1000)  # same weights, window never reached
    x = torch.randint(4, 260, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = mixed.model(x).logits, wide.model(x).logits
    assert torch.equal(a[:, :8], b[:, :8])  # inside the window: identical
    assert not torch.allclose(a[:, 8:], b[:, 8:])  # beyond it the sliding layers see less
    ids = chat_ids(mixed.tokenizer)
    assert mixed.model.generate(ids, max_new_tokens=8, do_sample=False).shape[1] == ids.shape[1] + 8
    with pytest.raises(ValueError, match="entries"):
        tiny_model(layer_types=["full_attention"])
    with pytest.raises(ValueError, match="Unknown layer types"):
        tiny_model(layer_types=["global"] * 4)
