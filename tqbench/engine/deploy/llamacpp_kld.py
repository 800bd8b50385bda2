"""llama-perplexity's KL protocol, run in llama.cpp (measured) and in tqbench's model of it (predicted).

llama.cpp (``measure_llamacpp_kld``): ``llama-perplexity -m GGUF -f TEXT -c N_CTX -fa on
--kl-divergence-base BASE`` with the f16 cache writes the baseline's log-probabilities and the tokens; then
``--kl-divergence --kl-divergence-base BASE -ctk K -ctv V -fa on`` scores each setting: the text in chunks of
``N_CTX`` tokens, each chunk one batch from an empty cache, KL(base || setting) over the second half of every
chunk (positions ``N_CTX/2 .. N_CTX-2``, each predicting the next token).

tqbench (``predict_llamacpp_kld``): the same tokens (read from BASE, or tokenized here when llama.cpp is not
built), the same chunks and scored positions, the model's attention replaced by llama.cpp's CPU flash
attention over the stored K/V (``llamacpp_attention``) and its weight products over quantized activations
(``llamacpp_matmul``), the baseline the f16 cache in that same model, and KL summed over base log-probabilities
above -16 as llama.cpp sums it. What still differs is said in every report (``PROTOCOL_DIFFERENCES``).
"""

from __future__ import annotations

import math
import re
import struct
import subprocess
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from tqbench.engine.deploy.llamacpp import RUNTIME_FLAGS
from tqbench.engine.deploy.llamacpp_attention import attention_calls, f16_v_accumulation, llamacpp_kv
from tqbench.engine.deploy.llamacpp_matmul import llamacpp_matmuls
from tqbench.engine.events import CancelFlag, OnEvent, Progress, emit, raise_if_cancelled

__all__ = ["BASELINE", "KldResult", "PROTOCOL_DIFFERENCES", "VERIFY_TEXTS", "measure_llamacpp_kld",
           "predict_llamacpp_kld", "predict_units", "read_kld_base", "verify_text", "with_bos"]

BASELINE = ("f16", "f16")
#: two shipped texts of different kinds, long enough for two 1,024-token chunks each (llama-perplexity needs
#: at least 2 x context tokens)
VERIFY_TEXTS = ("corpus:rivers+bread+lighthouses", "heldout:technical+code")
PROTOCOL_DIFFERENCES = (
    "weights: both multiply the GGUF's weights by activations quantized as ggml-cpu does (q8 blocks); tqbench "
    "with the weights dequantized to fp32 and fp32 sums, llama.cpp in integer blocks (same values up to fp32 "
    "summation order and the fp16 q8_1 block sums)",
    "threads: llama.cpp splits rows and sums across threads in its own order; tqbench sums in torch's order",
)
JOB = "llama.cpp KL prediction"
NO_REPACK = RUNTIME_FLAGS["llama-perplexity"]  # ggml's AMX kernel crashes on this VM: see RUNTIME_FLAGS


@dataclass(frozen=True)
class KldResult:
    k: str
    v: str
    kld_mean: float
    kld_unc: float  # standard error of the mean over scored tokens
    same_top_pct: float
    ppl: float
    ppl_base: float
    tokens: int  # scored tokens
    source: str  # "llama.cpp" (measured) or "tqbench" (predicted)
    note: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def verify_text(name: str, folder: Path) -> Path:
    """The shipped text(s) ``name`` (``texts.resolve_texts`` names, ``+`` joins) as one file in ``folder``."""
    from tqbench.engine.allocate.texts import resolve_texts

    paths, label = resolve_texts(name)
    out = folder / (re.sub(r"[^\w.+-]", "_", label) + ".txt")
    out.write_text("\n".join(p.read_text(encoding="utf-8") for p in paths), encoding="utf-8")
    return out


def read_kld_base(path: Path) -> tuple[int, int, torch.Tensor]:
    """``(n_ctx, n_vocab, tokens [n_chunk, n_ctx])`` from a llama-perplexity ``--kl-divergence-base`` file."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity log-probability file")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", f.read(12))
        toks = torch.frombuffer(bytearray(f.read(4 * n_ctx * n_chunk)), dtype=torch.int32)
    return n_ctx, n_vocab, toks.reshape(n_chunk, n_ctx).to(torch.long)


def with_bos(tokens: torch.Tensor, bos: int | None) -> torch.Tensor:
    """The chunks ``tokens [n_chunk, n_ctx]`` (a base file's, which holds the text's own tokens) as llama-perplexity
    runs them: where its vocabulary adds a BOS (the text's first token is the BOS: the tokenizer put it there) every
    chunk's first token is replaced by the BOS (``perplexity.cpp``: "add BOS token for the first batch of each
    chunk"). Only chunk 1 starts with one in the file; Gemma-3 without it is another model (its KLD 1.5-2x)."""
    if bos is None or tokens.numel() == 0 or int(tokens[0, 0]) != bos:
        return tokens
    out = tokens.clone()
    out[:, 0] = bos
    return out


def _log_probs(model, ids: torch.Tensor, k: str, v: str, first: int, gguf: Path | None) -> torch.Tensor:
    keep = ids.numel() - first
    with llamacpp_kv(model, k, v), (llamacpp_matmuls(model, gguf) if gguf else nullcontext()), \
            torch.inference_mode():
        logits = model(input_ids=ids[None], use_cache=False, logits_to_keep=keep).logits[0, -keep:-1]
        if attention_calls() == 0:
            raise ValueError(f"{model.config.model_type}: this architecture's attention does not go through "
                             "transformers' AttentionInterface, so llama.cpp's attention cannot be modelled on it")
    return torch.log_softmax(logits.float(), -1)


def predict_units(n_chunk: int, n_settings: int) -> int:
    """Forward passes ``predict_llamacpp_kld`` runs over ``n_chunk`` chunks: the f16 baseline plus each setting."""
    return n_chunk * (1 + n_settings)


def predict_llamacpp_kld(engine, tokens: torch.Tensor, settings: list[tuple[str, str]], *, gguf: Path | None,
                         cancel: CancelFlag | None = None, on_event: OnEvent | None = None,
                         units_done: int = 0, units_total: int | None = None) -> list[KldResult]:
    """tqbench's prediction of llama-perplexity's KLD for each ``(k, v)`` setting on ``tokens [n_chunk, n_ctx]``
    (llama.cpp's chunks as it runs them: ``with_bos`` applied). ``gguf``: the file
    the model was loaded from, whose weight types set llama.cpp's activation quantization (``llamacpp_matmul``);
    None runs fp32 activations (and says so in each result's note). ``on_event`` gets a ``Progress(JOB, done,
total)`` after each forward pass (one unit; ``units_done``/``units_total`` place this call inside a larger job:
several texts)."""
    model = engine.model
    n_chunk, n_ctx = tokens.shape
    first = n_ctx // 2
    sums = {s: [0.0, 0.0, 0, 0.0] for s in settings}  # sum kld, sum kld^2, same top, sum nll
    nll_base, count = 0.0, 0
    done = units_done
    total = units_total if units_total is not None else units_done + predict_units(n_chunk, len(settings))

    def unit(message: str) -> None:
        nonlocal done
        done += 1
        emit(on_event, Progress(JOB, done, total, message))

    for c in range(n_chunk):
        raise_if_cancelled(cancel, JOB)
        ids = tokens[c]
        target = ids[first + 1 :]
        base = _log_probs(model, ids, *BASELINE, first, gguf)
        unit(f"chunk {c + 1}/{n_chunk}: f16 baseline")
        nll_base += float(-base.gather(-1, target[:, None]).sum())
        count += target.numel()
        keep = base > -16  # llama.cpp sums only base log-probs above -16
        pb = torch.where(keep, base.exp(), 0)
        for s in settings:
            raise_if_cancelled(cancel, JOB)
            cand = _log_probs(model, ids, *s, first, gguf)
            unit(f"chunk {c + 1}/{n_chunk}: -ctk {s[0]} -ctv {s[1]}")
            kld = (pb * torch.where(keep, base - cand, 0)).sum(-1).double()
            acc = sums[s]
            acc[0] += float(kld.sum())
            acc[1] += float((kld * kld).sum())
            acc[2] += int((cand.argmax(-1) == base.argmax(-1)).sum())
            acc[3] += float(-cand.gather(-1, target[:, None]).sum())
    out = []
    for (k, v), (s1, s2, top, nll) in sums.items():
        mean = s1 / count
        unc = math.sqrt(max(s2 / count - mean * mean, 0) / (count - 1)) if count > 10 else 0.0
        notes = ["llama.cpp sums V in fp16 for this pair (a quantized K with an f16 V); modelled in fp32"
                 if f16_v_accumulation(k, v) else "",
                 "" if gguf else "activations not quantized as llama.cpp's weight products do (no GGUF)"]
        note = "; ".join(n for n in notes if n)
        out.append(KldResult(k, v, mean, unc, 100.0 * top / count, math.exp(nll / count),
                             math.exp(nll_base / count), count, "tqbench", note))
    return out


_PATTERNS = {
    "kld": r"Mean\s+KLD:\s*([-\d.eE+]+)\s*±\s*([-\d.eE+]+)",
    "ppl": r"Mean PPL\(Q\)\s*:\s*([-\d.eE+]+)",
    "ppl_base": r"Mean PPL\(base\)\s*:\s*([-\d.eE+]+)",
    "top": r"Same top p:\s*([-\d.eE+]+)",
}


def parse_kld_output(text: str, k: str, v: str, tokens: int) -> KldResult:
    """A ``KldResult`` from llama-perplexity ``--kl-divergence``'s statistics (ValueError when they are absent)."""
    found = {}
    for key, pat in _PATTERNS.items():
        m = re.search(pat, text)
        if m is None:
            tail = "\n".join(text.splitlines()[-8:])
            raise ValueError(f"llama-perplexity printed no {key} statistics for -ctk {k} -ctv {v}; its end:\n{tail}")
        found[key] = m.groups()
    return KldResult(k, v, float(found["kld"][0]), float(found["kld"][1]), float(found["top"][0]),
                     float(found["ppl"][0]), float(found["ppl_base"][0]), tokens, "llama.cpp")


def _perplexity(tool: Path, args: list[str], log: Path) -> str:
    proc = subprocess.run([str(tool), *args], capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    log.write_text(text)
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-8:])
        raise RuntimeError(f"llama-perplexity failed (exit {proc.returncode}, log {log}); its end:\n{tail}")
    return text


def measure_llamacpp_kld(perplexity: Path, gguf: Path, text: Path, settings: list[tuple[str, str]], *,
                         n_ctx: int = 1024, threads: int = 2, workdir: Path | None = None,
                         progress=None, chunks: int | None = None) -> tuple[Path, list[KldResult]]:
    """Run llama-perplexity: the f16-cache baseline into ``workdir/base.kld``, then each ``(k, v)`` setting
    against it (``chunks``: only the first N chunks, llama-perplexity's ``--chunks``). Returns the base file (its tokens feed ``predict_llamacpp_kld``) and the measured results."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="tqbench-llamacpp-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base = workdir / f"{text.stem}-c{n_ctx}.kld"
    common = ["-m", str(gguf), "-f", str(text), "-c", str(n_ctx), "-t", str(threads), "-fa", "on", *NO_REPACK,
              *(["--chunks", str(chunks)] if chunks else [])]
    if progress is not None:
        progress(f"llama.cpp: f16-cache baseline on {text.name} ({n_ctx}-token chunks)")
    _perplexity(perplexity, [*common, "-ctk", BASELINE[0], "-ctv", BASELINE[1], "--kl-divergence-base",
                             str(base)], workdir / f"{base.stem}-base.log")
    n_ctx_file, _, tokens = read_kld_base(base)
    n_chunk = min(chunks, tokens.shape[0]) if chunks else tokens.shape[0]
    scored = n_chunk * (n_ctx_file - 1 - n_ctx_file // 2)
    out = []
    for k, v in settings:
        if progress is not None:
            progress(f"llama.cpp: -ctk {k} -ctv {v} on {text.name}")
        text_out = _perplexity(perplexity, [*common, "-ctk", k, "-ctv", v, "--kl-divergence",
                                            "--kl-divergence-base", str(base)], workdir / f"{base.stem}-{k}-{v}.log")
        out.append(parse_kld_output(text_out, k, v, scored))
    return base, out
