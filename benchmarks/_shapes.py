"""Attention-shape presets of real models for the benchmarks, defined once from the configs tqbench ships
(``tqbench/data/models/<name>.json``: the attention fields of each model's public ``config.json``).

``--shape llama3-8b`` in ``attention.py`` / ``decode.py`` / ``prefill.py`` reads :data:`SHAPES`; a random-weight
model of the family with those attention shapes and a few layers comes from :func:`random_model`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tqbench.constants import MODELS_DATA_DIR

#: preset name -> shipped config (tqbench/data/models/<config>.json)
SHAPES = {"llama3-8b": "Llama-3.1-8B", "qwen3-8b": "Qwen3-8B", "mistral-7b": "Mistral-7B-v0.3",
          "smollm2": "SmolLM2-135M"}


@dataclass(frozen=True)
class Shape:
    name: str
    config_name: str
    fields: dict  # the shipped config's fields (model_type included)

    @property
    def model_type(self) -> str:
        return self.fields["model_type"]

    @property
    def q_heads(self) -> int:
        return self.fields["num_attention_heads"]

    @property
    def kv_heads(self) -> int:
        return self.fields["num_key_value_heads"]

    @property
    def gqa(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.fields.get("head_dim") or self.fields["hidden_size"] // self.q_heads

    @property
    def max_context(self) -> int:
        return self.fields["max_position_embeddings"]

    def describe(self) -> str:
        return (f"{self.name} ({self.config_name}: {self.kv_heads} KV heads x GQA {self.gqa}, d{self.head_dim}, "
                f"hidden {self.fields['hidden_size']})")


def load_shape(name: str) -> Shape:
    key = name.lower()
    if key not in SHAPES:
        raise SystemExit(f"unknown --shape {name!r}: use one of {', '.join(SHAPES)}")
    fields = json.loads((MODELS_DATA_DIR / f"{SHAPES[key]}.json").read_text(encoding="utf-8"))
    return Shape(key, SHAPES[key], {k: v for k, v in fields.items() if not k.startswith("_")})


def random_model(shape: Shape, layers: int = 4, vocab: int = 512, intermediate: int | None = None,
                 context: int = 0, seed: int = 0):
    """A random-weight ``shape`` model (``LoadedModel``): the family's config class with the real attention
    fields (hidden size, heads, KV heads, head size), ``layers`` layers, a ``vocab``-token vocabulary (kept small
    so it fits in memory) and the real MLP width unless ``intermediate`` is given; the tiny byte tokenizer."""
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tqbench.engine.models.fingerprint import model_config_summary, model_fingerprint
    from tqbench.engine.models.loaded import LoadedModel
    from tqbench.engine.models.resolve import ResolvedModel
    from tqbench.engine.models.tiny import BOS_ID, EOS_ID, PAD_ID, init_weights, tiny_tokenizer

    start = time.perf_counter()
    f = dict(shape.fields)
    f.pop("model_type")
    f |= {"num_hidden_layers": layers, "vocab_size": vocab, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
          "pad_token_id": PAD_ID, "tie_word_embeddings": False,
          "max_position_embeddings": max(f["max_position_embeddings"], context)}
    if intermediate:
        f["intermediate_size"] = intermediate
    if "max_window_layers" in f:
        f["max_window_layers"] = layers
    config = AutoConfig.for_model(shape.model_type, **f)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    init_weights(model, seed)
    model.eval()
    name = f"random-{shape.name}-{layers}l"
    return LoadedModel(
        model=model, tokenizer=tiny_tokenizer(), name=name, source=ResolvedModel("tiny", name, None, name),
        device=torch.device("cpu"), dtype=torch.float32, num_params=sum(p.numel() for p in model.parameters()),
        config_summary=model_config_summary(model.config), load_seconds=time.perf_counter() - start,
        fingerprint=model_fingerprint(model), threads=torch.get_num_threads(),
    )
