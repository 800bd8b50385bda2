"""Teacher-forced KL of turbo and pcaq keys scored in integers (``Side.score_int8`` / ``score_int16``) against the same policy
scored in float, both in fused mode on the native kernel, in one process: within 1% relative KL?

    python benchmarks/int_scores_kl.py --policy turbo4 --texts lighthouses,rivers --prefill 1024 --steps 128

The engine scores eligible keys in 16 bits (``attention.KEY_INT_SCORING``); this script replaces that choice
(``attention.key_scoring``) with float or ``--option`` for every key side the kernel can score in integers
(turbo 4/3/2-bit keys, pcaq keys in 16 bits; float32, head_dim % 64 == 0) and says how many sides were scored
each way. KL(fp baseline || candidate) per text, and the relative change.
"""

from __future__ import annotations

import argparse
import os
import sys

from _common import cpu_model, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--policy", default="turbo4")
    ap.add_argument("--texts", default="lighthouses,rivers")
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--option", default="score_int8", choices=("score_int8", "score_int16"))
    ap.add_argument("--json", default="benchmarks/results/int-scores-kl.json")
    a = ap.parse_args(argv)

    import importlib

    from tqbench.engine.cache.fused import native_glue
    from tqbench.engine.engine import Engine
    from tqbench.engine.validate import baseline_logprobs, corpus_ids, teacher_forced
    from tqbench.kernels.cpu.attention import kernel_rules

    if not kernel_rules()["score_int8_bits"]:
        raise SystemExit("error: this CPU's kernel build has no AVX-512 VNNI, so it cannot score keys in 8 bits")
    state = {"on": False, "int": 0, "float": 0}
    engine_scoring = native_glue.native.key_scoring
    native_glue.native.PCAQ_KEY_INT_SCORING = True  # measured here although the engine leaves pcaq keys in float

    def scoring(side, dt):  # the engine's key_scoring, with the option forced on or off for this run
        ok = state["on"] and engine_scoring(side, dt) and (a.option == "score_int16" or side.kind == "turbo")
        for option in ("score_int8", "score_int16"):
            setattr(side, option, ok and option == a.option)
        state["int" if ok else "float"] += 1
        return ok

    native_glue.native.key_scoring = scoring
    # (the layout module holds its own reference; ``fused.layout`` is also the name of its function, hence by path)
    importlib.import_module("tqbench.engine.cache.fused.layout").key_scoring = scoring
    engine = Engine.load(a.model, threads=a.threads)
    load0 = os.getloadavg()
    rows = []
    for text in a.texts.split(","):
        ids = corpus_ids(engine.tokenizer, text, a.prefill + a.steps + 1)
        base = baseline_logprobs(engine, ids, a.prefill)
        kl = {}
        for on in (False, True):
            state["on"] = on
            kl[on] = teacher_forced(engine, ids, a.prefill, a.policy, "fused", baseline=base).kl_mean
        rows.append({"text": text, "kl_float_scores": kl[False], "kl_int8_scores": kl[True],
                     "relative_change": (kl[True] - kl[False]) / kl[False]})
        print(f"{text:12s} KL float scores {kl[False]:.6f}  {a.option} {kl[True]:.6f}  "
              f"change {100 * rows[-1]['relative_change']:+.2f}%", flush=True)
    state["on"] = False
    print(f"key sides: {state['int']} scored in integers, {state['float']} in float")
    write_json(a.json, {"command": [sys.executable, *sys.argv], "policy": a.policy, "option": a.option,
                        "model": engine.name,
                        "prefill": a.prefill, "steps": a.steps, "cpu": cpu_model(), "threads": a.threads,
                        "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()),
                        "key_sides": {"int": state["int"], "float": state["float"]}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
