"""A tiny random-weight model with a real tokenizer, built in code (no download) for fast tests.

Llama-style GQA (``LlamaForCausalLM``) by default. When ``layer_types`` is given (a list of
``"full_attention"`` / ``"sliding_attention"``, one per layer) the model is a ``Qwen2ForCausalLM``, the
Llama-like class whose config carries per-layer attention types and a sliding window. The tokenizer is
byte-level (256 byte tokens, no merges) plus ChatML specials and a ChatML chat template, so any text
round-trips. Everything is deterministic for a seed and leaves the global RNG untouched.
"""

from __future__ import annotations

import time

import torch

from tqbench.engine.models.fingerprint import model_config_summary, model_fingerprint
from tqbench.engine.models.loaded import LoadedModel
from tqbench.engine.models.resolve import ResolvedModel

TINY_NAME = "tiny-random"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_tokenizer():
    """Byte-level BPE without merges: ids 0-3 are specials, 4-259 the 256 bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS[UNK_ID]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=SPECIAL_TOKENS[UNK_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _config(num_layers, num_heads, num_kv_heads, head_dim, vocab_size, layer_types, sliding_window):
    common = {
        "vocab_size": vocab_size,
        "hidden_size": num_heads * head_dim,
        "intermediate_size": 2 * num_heads * head_dim,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
    }
    if layer_types is None:
        from transformers import LlamaConfig

        return LlamaConfig(head_dim=head_dim, **common)
    from transformers import Qwen2Config

    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"Unknown layer types {sorted(unknown)}; use full_attention / sliding_attention")
    return Qwen2Config(
        layer_types=layer_types,
        use_sliding_window="sliding_attention" in layer_types,
        sliding_window=sliding_window or 16,
        max_window_layers=num_layers,
        **common,
    )


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Unit-variance embeddings, linears with std 1.6/sqrt(fan_in), a softer lm_head, unit norms, biases
    and other vectors std 0.02, gpt-oss's sink logits std 1.

    Measured on the default shape: greedy output stays varied and depends on the prompt (std 0.02
    everywhere settles into one repeated token within a few steps).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # registration order: deterministic
            if "norm" in name or (param.dim() < 2 and name.endswith("weight")):  # norm scales (ln_f too)
                param.fill_(1.0)
                continue
            if "embed_tokens" in name:
                std = 1.0
            elif name.endswith("sinks"):
                std = 1.0
            elif name.endswith("bias") or param.dim() < 2:
                std = 0.02
            else:
                std = (0.8 if "lm_head" in name else 1.6) / param.shape[1] ** 0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def tiny_model(
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """A random-weight model + byte-level tokenizer on cpu, identical for identical arguments."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    tokenizer = tiny_tokenizer()
    vocab_size = vocab_size or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size must be >= {len(tokenizer)} (the tokenizer's size)")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    config = _config(num_layers, num_heads, num_kv_heads, head_dim, vocab_size, layer_types, sliding_window)
    with torch.random.fork_rng(devices=[]):  # construction draws from the global RNG; keep it untouched
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    init_weights(model, seed)
    model.to(dtype).eval()
    model.generation_config.pad_token_id = PAD_ID
    source = ResolvedModel("tiny", TINY_NAME, None, TINY_NAME)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=TINY_NAME,
        source=source,
        device=torch.device("cpu"),
        dtype=dtype,
        num_params=sum(p.numel() for p in model.parameters()),
        config_summary=model_config_summary(model.config),
        load_seconds=time.perf_counter() - start,
        fingerprint=model_fingerprint(model),
        threads=torch.get_num_threads(),
    )
