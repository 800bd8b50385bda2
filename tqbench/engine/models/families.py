"""Random-weight models of the Hugging Face decoder families, a few MB each, built from each family's own
config class (``AutoConfig.for_model`` + ``from_config``: no download), with the tiny byte-level tokenizer.

``family_model("gemma2")`` is what the family matrix tests run and what ``--model tiny-gemma2`` loads: the
family's attention features stay as its config sets them (Gemma-2's soft-capping and alternating
sliding/global layers, gpt-oss's sinks, Mistral's sliding window, ...), at a small size (4 layers, 4 query
heads / 2 KV heads, head size 32, window 8 where the family has one so short prompts cross it). Mistral slides over
192 tokens on every layer: a 7-row window would hold less than a 16-row recent tail (and less than its 8 KB of
rotations), so no low budget could fit; 192 is still shorter than ``allocate``'s 256-token calibration and
verification, so those lengths run past it. The family tests set 8 (``tests/unit/families/short_windows.py``).
"""

from __future__ import annotations

import time

import torch

from tqbench.engine.models.fingerprint import model_config_summary, model_fingerprint
from tqbench.engine.models.loaded import LoadedModel
from tqbench.engine.models.resolve import TINY_FAMILY_PREFIX, ResolvedModel
from tqbench.engine.models.tiny import BOS_ID, EOS_ID, PAD_ID, init_weights, tiny_tokenizer

SLIDING = ("sliding_attention", "full_attention") * 2
#: model_type -> config fields beyond the common small shape (what makes the family itself)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 192},  # every layer slides (see the module doc)
    "gemma2": {"sliding_window": 8, "query_pre_attn_scalar": 16},  # soft-capping 50, sliding + global layers
    "gemma3_text": {"sliding_window": 8, "layer_types": list(SLIDING), "query_pre_attn_scalar": 16},
    "phi3": {"sliding_window": 8},
    "gpt_oss": {"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2},  # sinks
    "granite": {"attention_multiplier": 1 / 32},  # as the real ones: 1 / head_dim (the default 1.0 is untrained)
    "cohere": {},
    "starcoder2": {},
    "gpt_neox": {},
    "olmo2": {},
    "falcon": {},  # no AttentionInterface: fused mode is refused
    # multi-head latent attention: the cache holds a 32-wide latent (K) and the 8-wide shared RoPE key (V)
    "deepseek_v3": {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 24, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 64},
}
_MOE = ("gpt_oss", "deepseek_v3")
_NO_HEAD_DIM = ("falcon", "deepseek_v3")  # head_dim is derived (Falcon: read-only; DeepSeek: the RoPE part)
_MHA = ("gpt_neox", "falcon")  # KV heads derived by the family (GPT-NeoX: all heads; Falcon-7B style: one)


def family_config(model_type: str, **overrides):
    from transformers import AutoConfig

    if model_type not in FAMILIES:
        raise ValueError(f"unknown family {model_type!r}: known families are {', '.join(FAMILIES)}")
    fields = {
        "vocab_size": 320, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "tie_word_embeddings": False,
    }
    fields |= FAMILIES[model_type] | overrides
    if model_type in _NO_HEAD_DIM:
        fields.pop("head_dim")
    if model_type in _MHA:
        fields.pop("num_key_value_heads")
    return AutoConfig.for_model(model_type, **fields)


def family_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                 attn_implementation: str | None = None, **overrides) -> LoadedModel:
    """A random-weight ``model_type`` model (the family's default attention unless given) + tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    config = family_config(model_type, **overrides)
    extra = {"experts_implementation": "eager"} if model_type in _MOE else {}  # grouped_mm has no float64
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, **extra)
    init_weights(model, seed)
    model.to(dtype).eval()
    model.generation_config.pad_token_id = PAD_ID
    name = TINY_FAMILY_PREFIX + model_type
    return LoadedModel(
        model=model, tokenizer=tiny_tokenizer(), name=name, source=ResolvedModel("tiny", name, None, name),
        device=torch.device("cpu"), dtype=dtype, num_params=sum(p.numel() for p in model.parameters()),
        config_summary=model_config_summary(model.config), load_seconds=time.perf_counter() - start,
        fingerprint=model_fingerprint(model), threads=torch.get_num_threads(),
    )
