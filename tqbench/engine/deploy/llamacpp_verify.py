"""tqbench's predicted KL for a llama.cpp KV setting, and (``verify=True``) llama.cpp's measured KLD beside it.

``llamacpp_kld_report(engine, "q8_0", "q8_0")`` predicts llama-perplexity's mean KLD (``llamacpp_kld``
protocol: 1,024-token chunks, second half scored, against the f16 cache) on each text of ``texts``; with
``verify`` it also finds or builds llama.cpp (``llamacpp.build_llamacpp``), runs the same text in it on the
model's own GGUF file, and predicts on llama.cpp's tokens (read from its base file). A model not loaded from a
GGUF file cannot be run in llama.cpp here: verify raises saying so (the prediction alone still runs).
"""

from __future__ import annotations

import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tqbench.constants import DEFAULT_KLD_CHUNKS
from tqbench.engine.deploy.llamacpp_kld import (
    PROTOCOL_DIFFERENCES,
    VERIFY_TEXTS,
    KldResult,
    measure_llamacpp_kld,
    predict_llamacpp_kld,
    predict_units,
    read_kld_base,
    verify_text,
    with_bos,
)

__all__ = ["DEFAULT_KLD_CHUNKS", "LlamaCppKldReport", "kld_plan", "llamacpp_kld_report", "model_gguf"]


@dataclass
class LlamaCppKldReport:
    k: str
    v: str
    n_ctx: int
    threads: int
    texts: list[str]
    predicted: list[KldResult] = field(default_factory=list)  # one per text
    measured: list[KldResult | None] = field(default_factory=list)  # one per text (None: not verified)
    llamacpp: dict | None = None  # the build that measured (version, origin, tools)
    tokens_from: str = ""  # "llama.cpp's base file" or "tqbench's tokenizer"
    protocol: str = ""
    differences: tuple[str, ...] = PROTOCOL_DIFFERENCES
    machine: str = ""
    chunks: int | None = None  # chunks per text (None: all the text holds)

    def rows(self) -> list[dict]:
        out = []
        for text, p, m in zip(self.texts, self.predicted, self.measured):
            row = {"text": text, "predicted_kld": p.kld_mean, "predicted_same_top_pct": p.same_top_pct,
                   "predicted_ppl_ratio": p.ppl / p.ppl_base, "scored_tokens": p.tokens, "note": p.note}
            if m is not None:
                row.update(measured_kld=m.kld_mean, measured_kld_unc=m.kld_unc, measured_same_top_pct=m.same_top_pct,
                           measured_ppl_ratio=m.ppl / m.ppl_base, predicted_over_measured=p.kld_mean / m.kld_mean
                           if m.kld_mean > 0 else None)
            out.append(row)
        return out

    def to_dict(self) -> dict:
        return {"k": self.k, "v": self.v, "n_ctx": self.n_ctx, "chunks": self.chunks, "threads": self.threads, "protocol": self.protocol,
                "tokens_from": self.tokens_from, "differences": list(self.differences), "machine": self.machine,
                "llamacpp": self.llamacpp, "rows": self.rows(),
                "predicted": [p.to_dict() for p in self.predicted],
                "measured": [m.to_dict() if m else None for m in self.measured]}


def model_gguf(engine) -> Path | None:
    """The GGUF file ``engine``'s model was loaded from, or None."""
    source = getattr(getattr(engine, "loaded", None), "source", None)
    path = getattr(source, "gguf_path", None)
    return Path(path) if path is not None and Path(path).is_file() else None


def _machine(threads: int) -> str:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {threads} threads"


def _chunks(engine, text: Path, n_ctx: int) -> torch.Tensor:
    """``text`` by this model's tokenizer (a BOS first where it adds one, as llama-perplexity tokenizes it) in
    ``n_ctx``-token chunks, as the base file would hold them (``with_bos`` makes them what llama.cpp runs)."""
    ids = engine.tokenizer(text.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][0]
    n = ids.numel() // n_ctx
    if n < 2:
        raise ValueError(f"{text.name} has {ids.numel()} tokens: llama-perplexity needs at least 2 x {n_ctx}")
    return ids[: n * n_ctx].reshape(n, n_ctx)


def kld_plan(texts: tuple[str, ...], chunks: int | None) -> tuple[int, str]:
    """``(forward passes, what they are)`` the prediction will run on ``texts`` with ``chunks`` per text (None:
    every chunk; counted as 2, the fewest a text llama-perplexity accepts holds). Said before it starts."""
    per_text = chunks if chunks is not None else 2
    units = len(texts) * predict_units(per_text, 1)
    what = (f"{len(texts)} text(s) x {chunks if chunks is not None else 'all'} chunk(s) x (f16 baseline + the "
            f"flags) = {units}{'' if chunks is not None else '+'} forward passes")
    return units, what


def llamacpp_kld_report(engine, k: str, v: str, *, texts: tuple[str, ...] = VERIFY_TEXTS, n_ctx: int = 1024,
                        verify: bool = False, threads: int = 2, progress=None, cancel=None,
                        chunks: int | None = DEFAULT_KLD_CHUNKS, on_event=None) -> LlamaCppKldReport:
    """Predicted (and with ``verify`` measured) llama-perplexity KLD of ``-ctk k -ctv v`` on each text, over its
    first ``chunks`` chunks (None: all; llama-perplexity's ``--chunks``). ``on_event`` gets one ``Progress`` per
    forward pass of the prediction; ``progress`` (text) says what llama.cpp is doing under ``verify``."""
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks={chunks}: give 1 or more chunks per text (or None for all)")
    gguf = model_gguf(engine)
    rep = LlamaCppKldReport(k, v, n_ctx, threads, list(texts), machine=_machine(threads), chunks=chunks,
                            protocol=f"llama-perplexity --kl-divergence: {n_ctx}-token chunks"
                                     f"{f' (first {chunks} per text, --chunks {chunks})' if chunks else ''}, KL over "
                                     "the second half of each chunk against the f16 cache (-fa on)")
    units_total = kld_plan(texts, chunks)[0] if chunks is not None else None
    units_done = 0
    build = None
    if verify:
        from tqbench.engine.deploy.llamacpp import build_llamacpp

        if gguf is None:
            raise ValueError(f"{engine.name} was not loaded from a GGUF file, so llama.cpp cannot run it here: "
                             "load the model from its .gguf file (or convert it with llama.cpp's "
                             "convert_hf_to_gguf.py) to verify in llama.cpp")
        build = build_llamacpp(progress, tools=("llama-perplexity",))
        rep.llamacpp = build.to_dict()
    with tempfile.TemporaryDirectory(prefix="tqbench-llamacpp-") as tmp:
        for name in texts:
            text = verify_text(name, Path(tmp))
            if build is not None:
                base, measured = measure_llamacpp_kld(build.tool("llama-perplexity"), gguf, text, [(k, v)],
                                                      n_ctx=n_ctx, threads=threads, workdir=Path(tmp),
                                                      progress=progress, chunks=chunks)
                tokens = read_kld_base(base)[2]
                rep.tokens_from = "llama.cpp's base file"
                rep.measured.append(measured[0])
            else:
                tokens = _chunks(engine, text, n_ctx)
                rep.tokens_from = "tqbench's tokenizer"
                rep.measured.append(None)
            tokens = with_bos(tokens, getattr(engine.tokenizer, "bos_token_id", None))
            if chunks is not None:
                tokens = tokens[:chunks]
            (pred,) = predict_llamacpp_kld(engine, tokens, [(k, v)], gguf=gguf, cancel=cancel, on_event=on_event,
                                           units_done=units_done, units_total=units_total)
            units_done += predict_units(tokens.shape[0], 1)
            rep.predicted.append(pred)
    return rep
