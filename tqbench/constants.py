"""Torch-free names every layer shares: cache modes and what each keeps resident, the default prompts.

Front ends import this module to build their flags and forms without loading torch (``tqbench --help``
stays fast); the engine imports it for the same names, so each is written once.
"""

from __future__ import annotations

from pathlib import Path

#: files shipped inside the package: model geometries, policy files, the held-out corpus
PACKAGE_DATA_DIR = Path(__file__).resolve().parent / "data"
MODELS_DATA_DIR = PACKAGE_DATA_DIR / "models"
POLICIES_DATA_DIR = PACKAGE_DATA_DIR / "policies"
CORPUS_DIR = PACKAGE_DATA_DIR / "corpus"

#: every cache mode, in the order the CLI lists them (see ``shared/ARCHITECTURE.md``, "Cache modes")
CACHE_MODES = ("dense-shadow", "simulate", "compressed", "fused")

#: the dense baselines speed is measured against (``engine.cache.dense_baseline``): name -> the dtype its K/V rows
#: are stored in (None: the model's own dtype, a plain ``DynamicCache``; float32 for a CPU model). The 16-bit ones
#: hold the bytes of llama.cpp's f16 or vLLM's fp16/bf16 cache; ``DENSE_BASELINE_ATTENTION`` says how each is read
DENSE_BASELINES = {"dense": None, "dense-fp16": "float16", "dense-bf16": "bfloat16",
                   "dense-fp16-kernel": "float16", "dense-bf16-kernel": "bfloat16"}
#: how each dense baseline's attention reads its rows
DENSE_BASELINE_ATTENTION = {
    "dense": "the model's attention",
    "dense-fp16": "the model's attention on the rows upcast to its dtype",
    "dense-bf16": "the model's attention on the rows upcast to its dtype",
    "dense-fp16-kernel": "tqbench's native CPU kernel reading the 16-bit rows as stored (as engines read an f16 cache)",
    "dense-bf16-kernel": "tqbench's native CPU kernel reading the 16-bit rows as stored",
}
#: the baselines whose attention is the native CPU kernel (``engine.cache.dense_kernel``)
KERNEL_BASELINES = ("dense-fp16-kernel", "dense-bf16-kernel")


def dense_baseline_kv(name: str, model_dtype: str) -> str:
    """The dtype dense baseline ``name`` stores K/V rows in (``float16``), given the model's (``float32``)."""
    if name not in DENSE_BASELINES:
        raise ValueError(f"unknown dense baseline {name!r}: valid dense baselines are {', '.join(DENSE_BASELINES)}")
    return DENSE_BASELINES[name] or model_dtype


def dense_baseline_label(name: str, model_dtype: str) -> str:
    """``dense-fp16-kernel (float16 K/V; attention: tqbench's native CPU kernel reading ...)``: a baseline named
    with its K/V dtype and how its attention reads the rows (every benchmark's header and JSON say it this way)."""
    return f"{name} ({dense_baseline_kv(name, model_dtype)} K/V; attention: {DENSE_BASELINE_ATTENTION[name]})"

#: the modes whose validation verdicts say something about quality (dense-shadow reads exact K/V)
QUALITY_MODES = ("simulate", "compressed", "fused")

#: what each mode keeps resident during decode, in a few words (the cache report has the bytes)
CACHE_MODE_RESIDENT = {
    "dense-shadow": "exact dense K/V + store: storage-only, output = fp16",
    "simulate": "dense dequantized copy + store: more than fp16",
    "compressed": "packed store + one layer decoded per step",
    "fused": "packed store only: attention reads the codes",
}

#: the fastest quality-faithful mode per device type, as measured by ``benchmarks/decode.py`` (README,
#: "Decode speed per cache mode": on CPU the native kernel's fused mode decodes at 0.94x dense at 1K and
#: 1.22x at 4K, against simulate's 0.77x / 0.74x); a device type not measured gets ``simulate``, which runs
#: everywhere (CUDA: the Triton kernels have not run on a GPU yet)
FASTEST_QUALITY_MODE = {"cpu": "fused"}

#: ``tqbench serve --kv-budget auto``: this share of the memory available once the model is loaded
DEFAULT_KV_SHARE = 0.5

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
#: the second built-in prompt: compare-policies runs both when given none
SECOND_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
COMPARE_PROMPTS = (DEFAULT_PROMPT, SECOND_PROMPT)


def fastest_quality_mode(device_type: str) -> str:
    """The cache mode a candidate should default to on ``device_type`` ("cpu", "cuda", ...)."""
    return FASTEST_QUALITY_MODE.get(device_type, "simulate")


#: ``--prefill-chunk auto`` (every front end's default): a prompt longer than ``PREFILL_CHUNK_ABOVE`` tokens, in a
#: mode whose resident memory is the packed store (compressed, fused), is prefilled in forward calls of
#: ``PREFILL_CHUNK_TOKENS`` tokens that append into the store as they go: each call attends exactly over its own
#: rows and reads the earlier calls' rows as stored, so the prefill never holds the whole prompt's dense K/V
#: (peak: the store + one chunk's dense K/V + one chunk's activations). Shorter prompts, and the other modes
#: (which keep a dense copy anyway), prefill in one call over exact K/V. 8192 is the default model's whole
#: context, so its prompts keep the exact one-call prefill its quality numbers were measured with.
PREFILL_CHUNK_AUTO = "auto"
PREFILL_CHUNK_ABOVE = 8192
PREFILL_CHUNK_TOKENS = 1024
PREFILL_CHUNK_MODES = ("compressed", "fused")


def parse_prefill_chunk(text: str | int | None) -> int | None:
    """``--prefill-chunk``: ``auto`` (None: chosen by length, ``auto_prefill_chunk``), 0 (one call) or tokens."""
    if text is None or text == PREFILL_CHUNK_AUTO:
        return None
    try:
        n = int(text)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ValueError(f"--prefill-chunk {text!r} is invalid: use auto, 0 (the whole prompt in one forward call) "
                         "or a positive number of tokens per call")
    return n


def auto_prefill_chunk(prompt_tokens: int, cache_mode: str | None, chunk: int | None = None) -> int:
    """Tokens per prefill forward call (0 = one call): ``chunk`` when given, else the ``auto`` rule above."""
    if chunk is not None:
        return chunk
    if cache_mode in PREFILL_CHUNK_MODES and prompt_tokens > PREFILL_CHUNK_ABOVE:
        return PREFILL_CHUNK_TOKENS
    return 0


# ---- fused attention ------------------------------------------------------------------------------------
#: the fused mode's kernel implementations, as a cache report counts its calls (``CacheReport.fused_impl``);
#: a call that ran anything else ran the torch reference
FUSED_NATIVE = "native-cpu"
FUSED_TRITON = "triton"
FUSED_KERNELS = (FUSED_NATIVE, FUSED_TRITON)

#: chunks per text ``export --to llamacpp`` predicts llama-perplexity's KLD on by default (llama-perplexity's
#: ``--chunks``): each chunk is two forward passes of 1,024 tokens through the modelled llama.cpp compute path.
#: Every chunk of the two shipped texts (4 per text) took 19 min on 2 busy cores, so the default is one.
DEFAULT_KLD_CHUNKS = 1

#: the defaults every front end shares (CLI, workbench Run / Compare / tasks screen / palette, server requests):
#: defined once here. The cache mode: compressed reads the packed store (one layer decoded per step) and runs on
#: every device without a kernel build; ``tqbench serve`` alone defaults to ``auto`` (fused where its kernel runs,
#: because fused batches requests), and says so in its --help and /health.
DEFAULT_CACHE_MODE = "compressed"
#: the long-context task suite: target context (tokens) and samples per task
DEFAULT_TASK_CONTEXT = 4096
DEFAULT_TASK_SAMPLES = 3
#: what ``--cache-mode`` means, said the same way by every command
CACHE_MODE_HELP = ("How the candidate's cache is read: compressed (the packed store, one layer decoded per step), "
                   "fused (attention reads the codes; native kernel on CPU), simulate (a dense dequantized copy) or "
                   "dense-shadow (exact K/V: a storage-only report). The same default in every front end.")
#: ``allocate``'s choices per unit by default: turbo widths, an 8-bit engine format and dense rows (where they are
#: the cheapest quality: a sensitive layer, a sliding-window layer's fixed window at long context)
ALLOCATE_CODECS = ("turbo1", "turbo2", "turbo3", "turbo4", "q8_0", "fp16")
