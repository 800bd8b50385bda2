"""A sweep's cells: one (model, policy, text) each, with the measurements that apply to the text's kind.

A cell's ``key()`` holds everything its numbers depend on (model, policy string, text, the measurement
settings, cache mode, baseline, threads): ``--resume`` reuses a stored result only when its key is equal, so an
edited spec re-runs exactly the cells it changed.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from tqbench.engine.sweep.spec import MEASUREMENTS, ModelEntry, PolicyEntry, SweepSpec, TextEntry, slug


@dataclass(frozen=True)
class Cell:
    index: int  # position in the spec's expansion (models, then texts, then policies)
    model: ModelEntry
    policy: PolicyEntry
    text: TextEntry
    measure: tuple[str, ...]  # the spec's measurements that apply to this text's kind

    @property
    def cell_id(self) -> str:
        h = hashlib.sha256(f"{self.model.key}\0{self.text.name}\0{self.policy.policy_string}".encode()).hexdigest()
        return f"{self.model.key}--{slug(self.text.name)}--{self.policy.key}-{h[:6]}"

    @property
    def label(self) -> str:
        return f"{self.policy.label} @ {self.text.name} [{self.model.label}]"

    def key(self, spec: SweepSpec) -> dict:
        settings = {}
        if "validate" in self.measure or "speed" in self.measure:
            settings["validate"] = asdict(spec.validate)
        if "teacher_forced" in self.measure:
            settings["teacher_forced"] = asdict(spec.teacher_forced)
        if "niah" in self.measure:
            settings["niah"] = asdict(spec.niah)
        if "tasks" in self.measure:
            from tqbench.engine.tasks import SUITE_VERSION

            settings["tasks"] = {**asdict(spec.tasks), "suite_version": SUITE_VERSION}
        if "bytes" in self.measure:
            settings["bytes_tokens"] = list(spec.bytes_tokens)
        return {
            "model": asdict(self.model), "policy": self.policy.label, "policy_string": self.policy.policy_string,
            "text": self.text.to_dict(), "measure": list(self.measure), "baseline": spec.baseline.policy_string,
            "cache_mode": spec.cache_mode, "chat": spec.chat, "threads": spec.threads, "settings": settings,
        }


def expand(spec: SweepSpec) -> list[Cell]:
    """Every cell of the spec, grouped by model, then text (so a shard reuses each text's baseline)."""
    cells = []
    for model in spec.models:
        for text in spec.texts:
            measure = tuple(m for m in spec.measure if text.kind in MEASUREMENTS[m])
            for pol in spec.policies:
                cells.append(Cell(len(cells), model, pol, text, measure))
    return cells


def shards(cells: list[Cell], n: int) -> list[list[Cell]]:
    """Split one model's cells into at most ``n`` contiguous shards of near-equal size (texts stay together
    where the split allows, so each shard computes few baselines)."""
    n = max(1, min(n, len(cells)))
    size, extra = divmod(len(cells), n)
    out, at = [], 0
    for i in range(n):
        k = size + (1 if i < extra else 0)
        out.append(cells[at:at + k])
        at += k
    return [s for s in out if s]
