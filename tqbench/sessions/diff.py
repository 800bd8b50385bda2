"""A re-run compared with its saved record: the first token where each side differs."""

from __future__ import annotations

from dataclasses import dataclass

from tqbench.sessions.schema import RunRecord


@dataclass(frozen=True)
class RunDiff:
    """A re-run compared with its saved record, side by side."""

    identical: bool
    sides: dict  # side -> {"identical", "first_difference", "saved_tokens", "new_tokens"}

    def describe(self) -> str:
        parts = []
        for side, d in self.sides.items():
            if d["identical"]:
                parts.append(f"{side}: identical ({d['new_tokens']} tokens)")
            else:
                parts.append(f"{side}: differs from token {d['first_difference']} "
                             f"({d['saved_tokens']} saved, {d['new_tokens']} now)")
        return "; ".join(parts)


def diff_runs(saved: RunRecord, new: RunRecord) -> RunDiff:
    sides = {}
    for name in ("baseline", "candidate"):
        a, b = getattr(saved, name), getattr(new, name)
        if a is None or b is None:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is None and len(a.token_ids) != len(b.token_ids):
            first = min(len(a.token_ids), len(b.token_ids))
        sides[name] = {"identical": first is None, "first_difference": first,
                       "saved_tokens": len(a.token_ids), "new_tokens": len(b.token_ids)}
    return RunDiff(all(d["identical"] for d in sides.values()), sides)
