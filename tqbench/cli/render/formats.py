"""Cell formats every table and Markdown report shares: numbers, percentages, byte sizes, verdict colours."""

from __future__ import annotations

VERDICT_STYLE = {"exact-match": "green", "near-stable": "yellow", "prefix-stable-then-diverged": "dark_orange",
                 "diverged": "red"}

#: how to get more evidence, in each command's own flags (the engine's caveat names none)
EVIDENCE_HINT = {
    "validate": "`tqbench validate --teacher-forced --tf-tokens 128` scores every position; or raise --max-new-tokens",
    "compare": "`tqbench validate --teacher-forced --tf-tokens 128` scores every position; or add --prompt / raise "
               "--max-new-tokens",
}


def num(x, fmt: str = ".4f") -> str:
    """``x`` in ``fmt``; '-' for None."""
    return "-" if x is None else format(x, fmt)


def pct(x) -> str:
    return "-" if x is None else f"{x:.1f}%"


def verdict_markup(verdict: str) -> str:
    return f"[{VERDICT_STYLE.get(verdict, 'white')}]{verdict}[/]"


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"
