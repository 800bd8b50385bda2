"""The snapshot model is what the snapshots claim: SmolLM2's tokenizer and KV geometry, English words on screen."""

import torch

from tests.tui.test_snapshots import PROMPT
from tests.tui.words_model import WORDS, words_model


def test_the_snapshot_model_has_smollm2s_tokenizer_and_geometry(words_engine):
    from tqbench.engine.cache import default_geometry

    tok = words_engine.tokenizer
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    assert words_engine.geometry == default_geometry()  # 30 layers x 3 KV heads x head_dim 64, as the shipped policies


def test_the_snapshot_model_writes_words_and_is_rebuilt_identically(words_engine):
    r = words_engine.generate(PROMPT, "fp16", max_new_tokens=16, stop_at_eos=False)
    words = r.text.split(" ")[1:]
    assert r.text == "".join(" " + w for w in words) and len(words) == 16, r.text
    assert set(words) <= set(WORDS) and len(set(words)) > 6, words  # words only, and not one repeated
    again = words_model(words_engine.tokenizer).model.state_dict()
    mine = words_engine.model.state_dict()
    assert again.keys() == mine.keys() and all(torch.equal(again[k], mine[k]) for k in mine)
