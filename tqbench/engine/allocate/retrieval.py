"""A keep cell's retrieval price: what evicting a layer's rows costs the answer of a needle probe.

Next-token KL on calibration text (``keeps.KeepCells``) does not see retrieval: a layer that drops the one row a
question needs barely moves the next token of running text. So the tokens axis also prices every keep cell on a
few *probes*: needle prompts generated the way the task suite's are (``tasks.generate``: a key-value needle or a
variable chain in filler, a question, the answer prefix), followed by the gold answer, teacher-forced. The price of
(layer, keep) is the mean KL(exact || evicted) of the answer tokens' next-token distributions with that layer alone
evicting, in the same units as the calibration cell, so ``keep_kl + weight * price`` is what the solver minimises.

Held out from the suite: the probes' filler is the allocation's calibration texts
(``tqbench/data/calibration/{prose,legal,chat}``; the suite's needles sit in ``tqbench/data/corpus`` or RULER's
noise sentences), their keys are words of those texts the suite's key vocabulary does not hold, and their seeds
are in a namespace of their own (``probe/<seed>/<kind>/<index>``).

Protocols (``tasks --protocol``): ``agnostic`` evicts at the end of the context (before the question, the
``Engine.compress`` protocol); the question, the answer prefix and the answer are the chunk. ``aware`` evicts at
the end of the prompt (the question inside the scored window), the answer is the chunk. Each probe is measured
under every protocol asked; the price is the mean over (probe, protocol).
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

import torch

from tqbench.engine.allocate.chunk import ChunkRunner
from tqbench.engine.allocate.keeps import KeepCells, _ranking
from tqbench.engine.request import RequestError

PROTOCOLS = ("agnostic", "aware")
KINDS = ("single", "chain", "multikey")
#: probes (none: opt-in, the measured suite scores did not show a gain: docs/allocation.md) and their weight
DEFAULT_PROBES = 0
DEFAULT_WEIGHT = 1.0
FILLER = ("prose", "legal", "chat")
#: the shortest probe (a needle in filler, the chat template, the question): the default probe context is at least this
PROBE_MIN = 512


@dataclass(frozen=True)
class Probe:
    """One retrieval probe: ``ids`` [1, T] = chat-template user turn, answer prefix, gold answer; ``cut`` the first
    token of the question (what the agnostic protocol compresses before), ``answer`` the first gold-answer token."""

    kind: str
    index: int
    ids: torch.Tensor
    cut: int
    answer: int


def check_probes(probes: int, weight: float, protocols) -> tuple[str, ...]:
    if probes < 0:
        raise RequestError("probes", probes, "give 0 (no retrieval price) or more probes, e.g. 3")
    if not weight >= 0:
        raise RequestError("probe_weight", weight, "give a weight of 0 or more (1: as much as the calibration KL)")
    items = protocols.split(",") if isinstance(protocols, str) else list(protocols)
    items = [p.strip() for p in items if p.strip()]
    bad = [p for p in items if p not in PROTOCOLS]
    if bad or not items:
        raise RequestError("probe_protocols", protocols, "give agnostic, aware or agnostic,aware")
    return tuple(p for p in PROTOCOLS if p in items)


@functools.lru_cache(maxsize=1)
def _filler() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(sentences, key words) of the probes' filler texts: words the suite's key vocabulary does not hold."""
    from tqbench.engine.allocate.texts import CALIBRATION_DIR
    from tqbench.engine.tasks.generate import vocabulary

    text = " ".join(" ".join((CALIBRATION_DIR / f"{n}.txt").read_text(encoding="utf-8").split()) for n in FILLER)
    sentences = tuple(s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 20 < len(s.strip()) < 400)
    words = set(re.findall(r"\b[a-z]{5,10}\b", text)) - set(vocabulary())
    return sentences, tuple(sorted(words))


def _build(tok, kind: str, rng: random.Random, length: int, depth: float) -> tuple[str, str, str]:
    """(user text, answer prefix, gold answer) of one probe with ``length`` filler tokens."""
    from tqbench.engine.tasks.generate import _needle, _niah_text, _var_name, magic_number
    from tqbench.engine.validate.niah import build_haystack_needles

    sentences, words = _filler()
    pool = list(sentences)
    rng.shuffle(pool)
    if kind == "chain":
        names = []
        while len(names) < 3:
            v = _var_name(rng)
            if v not in names:
                names.append(v)
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in (1, 2)]
        depths = sorted([depth] + [rng.uniform(0.05, 0.95) for _ in (1, 2)])
        hay, _ = build_haystack_needles(tok, length, list(zip(depths, chain)), pool=pool)
        text = (f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{hay}\n\n"
                f"Question: Find all variables that are assigned the value {value} in the text above.")
        prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, 3 variables are "
                  f"assigned the value {value}, they are:")
        return text, prefix, " " + ", ".join(names)
    n = 4 if kind == "multikey" else 1
    keys = rng.sample(words, n)
    values = [magic_number(rng) for _ in keys]
    depths = [depth] + [rng.uniform(0.05, 0.95) for _ in range(n - 1)]
    hay, _ = build_haystack_needles(tok, length, [(d, _needle(k, v)) for d, k, v in zip(depths, keys, values)],
                                    pool=pool)
    q = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
    return _niah_text(hay, q), f"The special magic number for {keys[0]} mentioned in the provided text is", \
        " " + values[0] + "."


def make_probes(engine, n: int, context: int, seed: int = 0) -> list[Probe]:
    """``n`` probes of about ``context`` tokens (kinds in turn, needle depths spread 10%..90%), deterministic in
    (seed, kind, index, context)."""
    from tqbench.engine.tasks.generate import Sample, _encode, question_start

    tok = engine.tokenizer
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        depth = 0.1 + 0.8 * (i + 0.5) / max(n, 1)
        length, best = max(16, context - 256), None
        for _ in range(8):  # the filler budget that lands the whole probe within the context (never over)
            rng = random.Random(f"probe/{seed}/{kind}/{i}/{context}")
            text, prefix, gold = _build(tok, kind, rng, length, depth)
            prompt = _encode(engine, text, prefix)
            answer = tok(gold, add_special_tokens=False, return_tensors="pt")["input_ids"].to(prompt.dtype)
            over = int(prompt.shape[1] + answer.shape[1]) - context
            if over <= 0 and (best is None or prompt.shape[1] > best[1].shape[1]):
                best = (text, prompt, answer, prefix, gold)
            if (over <= 0 and -over <= 64) or (over > 0 and length == 16):
                break
            length = max(16, length - over - 16 if over > 0 else length + (-over) // 2)
        if best is None:
            raise ValueError(f"a {kind} probe does not fit in {context} tokens: give a larger probe context")
        text, prompt, answer, prefix, gold = best
        ids = torch.cat([prompt, answer], dim=1)
        cut = question_start(engine, Sample(f"probe_{kind}", i, text, (gold,), prefix, prompt))
        out.append(Probe(kind, i, ids, cut, int(prompt.shape[1])))
    return out


def price_key(layer: int, head: int | None, score: str, window: int, keep: float, chunk: int, n: int,
              context: int, protocols: tuple[str, ...], seed: int = 0) -> str:
    """A retrieval cell's key in the partial results file:
    ``L[.h]/rkeep/<score>.w<window>[.c<chunk>].p<probes>x<context>s<seed>.<protocols>.<keep>``."""
    unit = f"{layer}" if head is None else f"{layer}.{head}"
    return (f"{unit}/rkeep/{_ranking(score, window, chunk)}.p{n}x{context}s{seed}."
            f"{'+'.join(protocols)}.{keep:g}")


class RetrievalCells:
    """``KeepCells`` over every (probe, protocol): a runner whose prefill ends where that protocol evicts and whose
    KL counts the gold answer's tokens only (``ChunkRunner.scored``)."""

    def __init__(self, engine, probes: list[Probe], protocols: tuple[str, ...] = PROTOCOLS, score: str = "snapkv",
                 window: int = 32, chunk: int = 1) -> None:
        if not probes:
            raise ValueError("no probes to price keep cells on")
        self.cells: list[tuple[Probe, str, KeepCells]] = []
        for p in probes:
            for proto in protocols:
                prefill = p.cut if proto == "agnostic" else p.answer - 1  # (the answer's first token is scored)
                runner = ChunkRunner(engine, p.ids, prefill)
                runner.scored = slice(p.answer - 1 - prefill, None)
                self.cells.append((p, proto, KeepCells(runner, score, window, chunk)))

    def cell(self, layer: int, keep, sink: int, recent: int) -> float:
        """Mean answer KL over (probe, protocol) with ``layer`` alone evicting to ``keep``."""
        return sum(kc.cell(layer, keep, sink, recent) for _, _, kc in self.cells) / len(self.cells)

    def head_cell(self, layer: int, head: int, keep, sink: int, recent: int) -> float:
        """Mean answer KL with KV head ``head`` of ``layer`` alone evicting to ``keep``."""
        return sum(kc.head_cell(layer, head, keep, sink, recent) for _, _, kc in self.cells) / len(self.cells)


def price_keeps(engine, keep_kl: dict, base, *, probes: int, weight: float, protocols: tuple[str, ...],
                context: int, seed: int = 0, known: dict, cells: dict, persist, on_event=None, cancel=None):
    """``keep_kl`` with every cell's retrieval price added (``weight`` times), and the report's ``retrieval`` part:
    the probes, the protocols, the weight and the price of every cell (keys as ``keep_kl``'s: ``(layer, keep)`` or
    ``(layer, head, keep)``). Cells in ``known`` (the partial results file) are not measured again."""
    from tqbench.engine.events import Progress, emit, raise_if_cancelled

    keys = {cell: price_key(cell[0], cell[1] if len(cell) == 3 else None, base.score, base.window, cell[-1],
                            base.chunk, probes, context, protocols, seed) for cell in keep_kl}
    rc = None
    price = {}
    for i, (cell, key) in enumerate(keys.items()):
        emit(on_event, Progress("retrieval", i, len(keys), f"probe price of {'.'.join(map(str, cell))}"))
        if key not in known:
            raise_if_cancelled(cancel, "allocate")
            if rc is None:
                rc = RetrievalCells(engine, make_probes(engine, probes, context, seed), protocols, base.score,
                                    base.window, base.chunk)
            if len(cell) == 3:
                persist(key, rc.head_cell(cell[0], cell[1], cell[2], base.sink, base.recent))
            else:
                persist(key, rc.cell(cell[0], cell[1], base.sink, base.recent))
        price[cell] = cells[key]
    priced = {cell: kl + weight * price[cell] for cell, kl in keep_kl.items()}
    report = {"probes": probes, "probe_context": context, "protocols": list(protocols), "weight": weight,
              "seed": seed, "measure": "mean answer-token KL of needle probes (filler: calibration texts)",
              "price": {".".join(map(str, cell[:-1])) + f"/{cell[-1]:g}": p for cell, p in price.items()}}
    return priced, report
