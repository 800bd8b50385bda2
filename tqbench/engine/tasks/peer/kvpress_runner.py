"""kvpress's side of ``tasks --peer kvpress``: run in kvpress's own venv (``make kvpress-env``), never imported by
tqbench (kvpress pins transformers < 5.3; tqbench runs a newer one). Standalone on purpose: the standard library,
torch, transformers and kvpress only, no tqbench import.

Protocol: one JSON request on stdin; JSON lines on stdout, ``{"event": "progress", ...}`` before each answer,
``{"event": "answer", ...}`` after it (``{"event": "started", "versions": ...}`` first), and one
``{"event": "result", ...}`` (or ``{"event": "error", "message": ...}`` with exit status 1) at the end.

Request: ``{"version": 1, "model": FOLDER, "dtype": "float32", "threads": 1, "presses": [NAME, ...],
"ratios": [0.5, ...], "protocols": ["agnostic", "aware"], "samples": [{"id": ID, "ids": [token ids],
"cuts": {"agnostic": I, "aware": J}, "max_new_tokens": N}, ...]}``. For each sample, protocol, press and ratio
the tokens before ``cuts[protocol]`` are the context kvpress's pipeline prefills under the press (compressing
it), the rest is appended to the compressed cache and answered greedily (``KVPressTextGenerationPipeline._forward``,
kvpress's own pipeline; ``agnostic``: the cut is where the question starts, ``aware``: where the user's turn
ends, the question inside the compressed context, as kvpress's query-aware runs). ``none`` is the pipeline with
no press (ratio 0, once per protocol). Each answer: ``{"sample", "press", "ratio", "protocol", "text",
"context_tokens", "cache_rows" (the mean rows per layer left in the cache after compression: presses that mask
instead of dropping, AdaKV and KVzip, leave every row), "seconds"}``.
"""

from __future__ import annotations

import json
import sys
import time

VERSION = 1


def _press_factories(kvpress) -> dict:
    """Press name -> (ratio -> press). Defaults are kvpress's except ChunkKV's chunk length (8, tqbench's
    ``chunk=8``; kvpress's default is 20) over SnapKV."""
    return {
        "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r),
        "tova": lambda r: kvpress.TOVAPress(compression_ratio=r),
        "kvzip": lambda r: kvpress.KVzipPress(compression_ratio=r),
        "expected": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
        "knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
        "chunkkv": lambda r: kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=r), chunk_length=8),
        "adakv": lambda r: kvpress.AdaKVPress(press=kvpress.SnapKVPress(compression_ratio=r)),
        "streaming": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
        "none": lambda r: None,
    }


def check_request(req: dict, names) -> None:
    """Raise ``ValueError`` (one line: what is wrong) on a malformed request."""
    if not isinstance(req, dict) or req.get("version") != VERSION:
        raise ValueError(f"request version {req.get('version') if isinstance(req, dict) else None!r}: "
                         f"this runner speaks version {VERSION}")
    for key in ("model", "presses", "ratios", "protocols", "samples"):
        if key not in req:
            raise ValueError(f"request has no {key!r}")
    unknown = [p for p in req["presses"] if p not in names]
    if unknown or not req["presses"]:
        raise ValueError(f"unknown press {', '.join(unknown) or '(none given)'}: choose from {', '.join(names)}")
    bad = [r for r in req["ratios"] if not (isinstance(r, (int, float)) and 0 <= r < 1)]
    if bad or not req["ratios"]:
        raise ValueError(f"compression ratio {bad or '(none given)'}: give fractions removed, 0 <= r < 1")
    bad = [p for p in req["protocols"] if p not in ("agnostic", "aware")]
    if bad or not req["protocols"]:
        raise ValueError(f"protocol {bad or '(none given)'}: give agnostic or aware")
    for s in req["samples"]:
        n = len(s.get("ids", ()))
        for p in req["protocols"]:
            cut = s.get("cuts", {}).get(p)
            if not isinstance(cut, int) or not 0 < cut < n:
                raise ValueError(f"sample {s.get('id')!r}: cut {cut!r} for {p} is not inside its {n} tokens")


def jobs(req: dict) -> list[tuple[dict, str, str, float]]:
    """(sample, protocol, press, ratio) in run order: per sample, protocol, press, ratio (``none`` once)."""
    out = []
    for s in req["samples"]:
        for p in req["protocols"]:
            for press in req["presses"]:
                for r in ([0.0] if press == "none" else req["ratios"]):
                    out.append((s, p, press, float(r)))
    return out


def answer(pipe, make_press, sample: dict, protocol: str, ratio: float) -> dict:
    """One answer through kvpress's pipeline: the context (before the cut) prefilled under the press, the rest
    appended to the compressed cache, greedy decoding."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([sample["ids"]], dtype=torch.long)
    cut = sample["cuts"][protocol]
    cache = DynamicCache()
    t0 = time.perf_counter()
    with torch.inference_mode():
        text = pipe._forward({"context_ids": ids[:, :cut], "questions_ids": [ids[:, cut:]]},
                             max_new_tokens=int(sample["max_new_tokens"]), press=make_press(ratio), cache=cache)[0]
    seconds = time.perf_counter() - t0
    rows = [cache.get_seq_length(i) for i in range(len(cache.layers))] if len(cache.layers) else [cut]
    return {"text": text, "context_tokens": cut, "cache_rows": sum(rows) / len(rows), "seconds": round(seconds, 3)}


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def run(req: dict, kvpress, load) -> dict:
    """Every answer the request asks for. ``load(model, dtype)`` -> (model, tokenizer); ``kvpress``: the module
    (its presses and ``KVPressTextGenerationPipeline``). Progress lines go to stdout as it runs."""
    factories = _press_factories(kvpress)
    check_request(req, factories)
    model, tokenizer = load(req["model"], req.get("dtype", "float32"))
    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    todo = jobs(req)
    answers = []
    for i, (s, protocol, press, ratio) in enumerate(todo):
        _emit({"event": "progress", "done": i, "total": len(todo), "what": f"kvpress {press} {ratio:g} "
               f"({protocol}): {s['id']}"})
        a = {"sample": s["id"], "press": press, "ratio": ratio, "protocol": protocol,
             **answer(pipe, factories[press], s, protocol, ratio)}
        _emit({"event": "answer", **a})  # each as it comes: a run cut short keeps what it answered
        answers.append(a)
    return {"event": "result", "version": VERSION, "answers": answers}


def _load(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(path)


def versions() -> dict:
    import importlib.metadata as md

    return {name: md.version(name) for name in ("kvpress", "transformers", "torch")}


def main() -> int:
    try:
        req = json.loads(sys.stdin.read())
        import kvpress  # first: a Python without it answers in a moment
        import torch

        torch.set_num_threads(int(req.get("threads", 1)))
        _emit({"event": "started", "version": VERSION, "versions": versions()})  # kept by a run cut short

        result = run(req, kvpress, _load)
        result["versions"] = versions()
        _emit(result)
        return 0
    except Exception as exc:  # noqa: BLE001 - the one line the parent shows
        _emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
