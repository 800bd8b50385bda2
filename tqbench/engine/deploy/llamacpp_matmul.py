"""llama.cpp's CPU matrix products with quantized weights, in torch: the activations are quantized too.

ggml-cpu multiplies a quantized weight row by the activation row converted to the weight type's
``vec_dot_type``: ``q8_0`` blocks of 32 for Q4_0/Q5_0/Q8_0/IQ4_NL weights, ``q8_1`` for Q4_1/Q5_1, ``q8_K``
blocks of 256 for the K-quants, fp16 for F16 weights; F32 weights read fp32. tqbench's model holds the GGUF
weights dequantized to fp32, so the same product is the dequantized weights times the quantized-then-dequantized
activations (the q8_1 block sums' fp16 rounding in the ``m * s`` term is not modelled: one fp16 rounding of a
block sum). Two runs of a model whose activations are re-quantized differ by whole quantization steps wherever a
cache type's small error moves an activation across a rounding boundary: this, not the attention, is most of
what llama.cpp measures for ``q8_0``.

``llamacpp_matmuls(model, gguf_path)`` installs that for a block: every ``nn.Linear`` whose weight the GGUF
stores quantized gets its input converted (module names mapped to GGUF tensor names by
``gguf.get_tensor_name_map``); ``activation_types`` says which conversion each gets.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tqbench.engine.deploy.llamacpp_attention import quantize_row_q8

__all__ = ["GGUF_ARCH", "activation_types", "gguf_arch", "llamacpp_matmuls", "quantize_row_q8_k"]

#: GGUF weight type -> the activation conversion of ggml-cpu's vec_dot_type for it
_VEC_DOT = {"Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "IQ4_NL": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1",
            "Q2_K": "q8_K", "Q3_K": "q8_K", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K", "IQ4_XS": "q8_K",
            "F16": "f16", "BF16": "bf16", "F32": "f32"}


def quantize_row_q8_k(x: torch.Tensor) -> torch.Tensor:
    """``quantize_row_q8_K_ref`` on rows ``[..., n*256]``, read back as fp32: ``iscale = -127/max`` (``max`` the
    value of largest magnitude), ``q = min(127, nearest_int(iscale*x))``, ``d = 1/iscale`` (fp32)."""
    xb = x.to(torch.float32).reshape(*x.shape[:-1], -1, 256)
    mx = torch.gather(xb, -1, xb.abs().argmax(-1, keepdim=True))
    iscale = torch.where(mx != 0, -127 / torch.where(mx != 0, mx, 1), 0)
    q = torch.round(iscale * xb).clamp(max=127)  # nearest_int: round half to even (the 1.5*2^23 trick)
    d = torch.where(iscale != 0, 1 / torch.where(iscale != 0, iscale, 1), 0)
    return (q * d).reshape(x.shape)


def _convert(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "f32":
        return x
    if kind in ("f16", "bf16"):
        return x.to(torch.float16 if kind == "f16" else torch.bfloat16).to(x.dtype)
    if kind == "q8_K":
        return quantize_row_q8_k(x).to(x.dtype)
    d, q, _ = quantize_row_q8(x)
    return (q.to(torch.float32) * d.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


#: transformers ``model_type`` -> llama.cpp's GGUF architecture name, where they differ (transformers' GGUF loader
#: maps ``gemma3`` to the text model ``gemma3_text``; llama.cpp runs Mistral GGUFs as ``llama``)
GGUF_ARCH = {"gemma3_text": "gemma3", "mistral": "llama"}


def gguf_arch(model_type: str) -> str:
    """The GGUF architecture name llama.cpp runs a transformers ``model_type`` as; ValueError when it has none."""
    import gguf

    arch = GGUF_ARCH.get(model_type, model_type)
    if arch not in gguf.MODEL_ARCH_NAMES.values():
        raise ValueError(f"no GGUF architecture named {arch!r} (transformers model_type {model_type!r}): llama.cpp's "
                         f"matrix products cannot be mapped; mapped model types: those whose name is a GGUF "
                         f"architecture, and {', '.join(f'{k} -> {v}' for k, v in GGUF_ARCH.items())}")
    return arch


def _gguf_tensors(gguf_path: Path) -> tuple[str | None, dict[str, str], set[str]]:
    """``(general.architecture, {tensor name: GGML type name}, names of the matrices)`` of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    return (arch, {t.name: t.tensor_type.name for t in reader.tensors},
            {t.name for t in reader.tensors if len(t.shape) >= 2 and int(t.shape[1]) > 1})


def activation_types(model, gguf_path: Path) -> dict[str, str]:
    """``{linear module name: activation conversion}`` for the model loaded from ``gguf_path``. The architecture
    is the file's ``general.architecture`` (else the model type's, ``gguf_arch``). ValueError for a weight type
    whose conversion is not modelled, a linear the GGUF has no tensor for, or a GGUF matrix no linear layer
    multiplies here (fused MoE experts, say: their products would go unmodelled)."""
    import gguf

    file_arch, types, matrices = _gguf_tensors(gguf_path)
    arch = file_arch if file_arch in gguf.MODEL_ARCH_NAMES.values() else gguf_arch(model.config.model_type)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out, used = {}, set()
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        key = names.get_name(name)
        if key is None or f"{key}.weight" not in types:
            if name == "lm_head" and "token_embd.weight" in types:  # tied output: llama.cpp reads token_embd
                key = "token_embd"
            else:
                raise ValueError(f"{name}: no tensor in {gguf_path.name} maps to it")
        wtype = types[f"{key}.weight"]
        if wtype not in _VEC_DOT:
            raise ValueError(f"{name}: GGUF weight type {wtype} is not modelled (modelled: {', '.join(_VEC_DOT)})")
        out[name] = _VEC_DOT[wtype]
        used.add(f"{key}.weight")
    unmodelled = sorted(matrices - used - {"token_embd.weight"})  # token_embd: a row lookup unless tied
    if unmodelled:
        more = f" and {len(unmodelled) - 3} more" if len(unmodelled) > 3 else ""
        raise ValueError(f"{arch}: GGUF matrices {', '.join(unmodelled[:3])}{more} are not multiplied by linear "
                         "layers here (fused experts or another layout): llama.cpp's matrix products cannot be "
                         "modelled for this architecture")
    return out


@contextmanager
def llamacpp_matmuls(model, gguf_path: Path) -> Iterator[dict[str, str]]:
    """For the block, every linear layer of ``model`` multiplies activations converted as llama.cpp converts
    them for that layer's GGUF weight type. Yields ``activation_types``."""
    kinds = activation_types(model, Path(gguf_path))
    mods = dict(model.named_modules())
    handles = []
    try:
        for name, kind in kinds.items():
            if kind != "f32":
                handles.append(mods[name].register_forward_pre_hook(
                    lambda _m, args, kind=kind: (_convert(args[0], kind), *args[1:])))
        yield kinds
    finally:
        for h in handles:
            h.remove()
