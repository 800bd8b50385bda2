"""One example (or a few) per subcommand, shown at the end of its ``--help`` (``Group.add_command`` sets each
command's epilog from here), and for the long jobs what the defaults cost on a 2-core CPU, measured and with
the load it was measured at. Every example line is a command that runs (``tests/unit/test_cli_help.py``
checks each names only options its command has)."""

from __future__ import annotations

EXAMPLES: dict[str, tuple[str, ...]] = {
    "bench": ("tqbench --headless bench --kv-policy turbo4 --max-new-tokens 48",
              "tqbench --headless bench --kv-policy turbo3 --cache-mode fused --json"),
    "policies": ("tqbench --headless policies", "tqbench --headless policies --json"),
    "validate": ("tqbench --headless validate --candidate turbo4",
                 "tqbench --headless validate --candidate turbo3 --teacher-forced --corpus bread"),
    "compare-policies": ("tqbench --headless compare-policies --policies 'turbo4;turbo3;turbo2'",),
    "niah": ("tqbench --headless niah --policies 'turbo4;turbo2' --lengths 256,1024",),
    "scan": ("tqbench --headless scan --layers 0,-1", "tqbench --headless scan --json"),
    "kv-estimate": ("tqbench --headless kv-estimate --kv-policy 'turbo4;turbo3' --seq-len 1024,4096,8192,32768",
                    "tqbench --headless kv-estimate --model Llama-3.1-8B --kv-policy turbo4 --json"),
    "serve": ("tqbench serve --kv-policy turbo4 --threads 2",),
    "allocate": ("tqbench --headless allocate --budget 3.5 --out my-3.5bit.toml",
                 "tqbench --headless allocate --budget 2.5 --granularity head --json",
                 "tqbench --headless allocate --budget 2 --axes bits,tokens --out evict.toml"),
    "sweep": ("tqbench --headless sweep examples/sweep.toml --out sweeps/example",),
    "export": ("tqbench --headless export turbo4 --to llamacpp",
               "tqbench --headless export turbo4 --to llamacpp --no-measure",
               "tqbench --headless export turbo4 --to vllm --json"),
    "tasks": ("tqbench --headless tasks --candidate turbo4,keep=0.5,chunk=8",
              "tqbench --headless tasks --context 2048 --samples 2 --json"),
    "calibrate": ("tqbench --headless calibrate",),
    "llamacpp": ("tqbench --headless llamacpp status", "tqbench --headless llamacpp build --tool llama-perplexity"),
}

#: what the defaults of a long job cost on a 2-core CPU (the load of each measurement said with it)
COSTS: dict[str, str] = {
    "export": "Cost of the defaults on a 2-core CPU (load 6-10, --threads 1): the flags print in ~10 s; all of it "
              "took 3 min 05 s (model load 28 s, teacher-forced 38 s, 4 KLD forward passes of ~27 s). --no-measure "
              "only maps.",
    "allocate": "Cost on a 2-core CPU, default model: a cold run of the defaults took over 10 min on a busy machine "
                "(issue 42); --granularity head --budget 2.5: 5 min 4 s at 2 threads on a quiet machine (1,350 cells, "
                "542 CPU s). Progress gives each "
                "phase's units and the time left; a rerun with the same --out (or --resume) reuses the measured "
                "cells.",
    "tasks": "Cost of the defaults on a 2-core CPU (default model, 4096 tokens, 2 tasks x 3 samples, baseline and "
             "candidate: 12 answers; the baseline's are cached for reruns): the model load and the first 2 answers "
             "took 43 CPU s at 1 thread but 7 min of wall time at load 13-20 (the run was stopped there; its ETA "
             "said 35 min more); issue 42 measured 12 min for --context 2048 on a busy machine. Progress says the "
             "answers up front and the time left after the first.",
    "validate": "Cost on a 2-core CPU, default model, --threads 1: --teacher-forced without --corpus (the prompt, "
                "64 steps, baseline and candidate) took 1 min 40 s of wall time but 20 CPU s, model load included, at "
                "load 17-20; with --corpus the defaults (256 + 128 tokens) cost a few times more. Progress counts the "
                "steps of each run and gives the time left.",
    "sweep": "Cost on a 2-core CPU: examples/sweep.toml (9 cells) took 104 s in-process at load 4.5-7.8, 1 thread "
             "(docs/sweeps.md); progress counts the cells and gives the time left after the first.",
}


def epilog(name: str) -> str | None:
    """The ``--help`` epilog of command ``name``: its cost (long jobs) and examples, lines kept as written."""
    lines = []
    if name in COSTS:
        lines += [COSTS[name], ""]
    if name in EXAMPLES:
        lines += ["\b", "Examples:", *(f"  {e}" for e in EXAMPLES[name])]
    return "\n".join(lines) or None
