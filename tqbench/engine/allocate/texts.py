"""The texts an allocation chooses on and the texts it is verified on, and the rule that they never overlap.

Calibration (choosing): by default the shipped mix ``tqbench/data/calibration/{prose,code,legal,chat}.txt``, one
sequence per kind in a batch: sequence ``i`` is the mix concatenated in an order rotated so that it ends in kind
``i``, cut to its last ``prefill + steps`` tokens, so each sequence prefills ``prefill`` tokens of mixed text that
ends in its kind and its measured chunk (the last ``steps`` tokens) is text of that kind. A single text (a shipped
name, ``corpus:NAME``, ``heldout:NAME``, ``calibration:NAME`` or a UTF-8 file) gives one sequence.

Verification (never chosen on): ``rivers`` (corpus) and a second unseen text of another kind
(``heldout:technical``, a maintenance manual; texts joined by ``+`` are concatenated, e.g. ``heldout:code+technical``). ``check_unseen`` refuses any overlap with a message that says which text and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tqbench.constants import CORPUS_DIR, PACKAGE_DATA_DIR
from tqbench.engine.request import RequestError

CALIBRATION_DIR = PACKAGE_DATA_DIR / "calibration"
HELDOUT_DIR = PACKAGE_DATA_DIR / "heldout"
MIX = "mix"
MIX_KINDS = ("prose", "code", "legal", "chat")
_FOLDERS = {"corpus": CORPUS_DIR, "heldout": HELDOUT_DIR, "calibration": CALIBRATION_DIR}


def shipped_names() -> list[str]:
    return sorted(f"{kind}:{p.stem}" for kind, folder in _FOLDERS.items() for p in folder.glob("*.txt"))


def resolve_text(name: str) -> tuple[Path, str]:
    """(path, label) of a text: ``corpus:NAME``, ``heldout:NAME``, ``calibration:NAME``, a bare corpus name
    (``rivers``) or a text file."""
    kind, sep, stem = name.rpartition(":")
    if sep and kind in _FOLDERS:
        path = _FOLDERS[kind] / f"{stem}.txt"
        if path.is_file():
            return path.resolve(), f"{kind}:{stem}"
    elif not sep and (CORPUS_DIR / f"{name}.txt").is_file():
        return (CORPUS_DIR / f"{name}.txt").resolve(), f"corpus:{name}"
    path = Path(name)
    if path.suffix and path.is_file():
        return path.resolve(), f"file:{path.name}"
    raise ValueError(f"text {name!r} is neither a text file nor a shipped text: give a file path or one of "
                     f"{', '.join(shipped_names())} (a bare corpus name like rivers works too), or '{MIX}' to "
                     "calibrate on the shipped mix")


@dataclass(frozen=True)
class CalibrationSet:
    ids: torch.Tensor  # [sequences, prefill + steps]
    prefill: int
    label: str  # "mix:prose+code+legal+chat" or the single text's label
    paths: tuple[Path, ...]  # every text it reads (the overlap check)

    @property
    def steps(self) -> int:
        return self.ids.shape[1] - self.prefill


def _tokens(tokenizer, path: Path) -> torch.Tensor:
    return tokenizer(path.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][0]


def calibration_set(tokenizer, calibration: str, prefill: int, steps: int) -> CalibrationSet:
    """The calibration sequences (see the module doc); ``ValueError`` when a text is too short."""
    n = prefill + steps
    if calibration == MIX:
        paths = [CALIBRATION_DIR / f"{k}.txt" for k in MIX_KINDS]
        toks = [_tokens(tokenizer, p) for p in paths]
        short = [k for k, t in zip(MIX_KINDS, toks) if t.shape[0] < steps]
        if short:
            raise RequestError("calib_steps", steps, f"calibration kinds {', '.join(short)} have fewer tokens: "
                                                     "use fewer steps")
        rows = []
        for i in range(len(MIX_KINDS)):
            order = [toks[(i + 1 + j) % len(toks)] for j in range(len(toks))]  # ends in kind i
            seq = torch.cat(order)
            while seq.shape[0] < n:  # the mix repeats (rotated the same way) when it is shorter than needed
                seq = torch.cat([torch.cat(order), seq])
            rows.append(seq[-n:])
        label = f"{MIX}:{'+'.join(MIX_KINDS)}"
        return CalibrationSet(torch.stack(rows), prefill, label, tuple(p.resolve() for p in paths))
    path, label = resolve_text(calibration)
    ids = _tokens(tokenizer, path)
    if ids.shape[0] < n:
        raise ValueError(f"calibration {label} has {ids.shape[0]} tokens, fewer than the {n} needed "
                         "(prefill + steps): give a longer text or lower calib_prefill / calib_steps")
    return CalibrationSet(ids[None, :n], prefill, label, (path,))


def resolve_texts(name: str) -> tuple[list[Path], str]:
    """``resolve_text`` for a name or texts joined by ``+`` in one folder (``heldout:code+technical``: the texts
    concatenated in that order, so the last one is what the measured steps read)."""
    kind, sep, stems = name.rpartition(":")
    if "+" not in stems or Path(name).is_file():
        path, label = resolve_text(name)
        return [path], label
    found = [resolve_text(f"{kind}{sep}{stem}") for stem in stems.split("+")]
    return [p for p, _ in found], (f"{kind}{sep}" if sep else "corpus:") + "+".join(stems.split("+"))


def check_text_names(calibration: str, *texts: str | None) -> None:
    """Every text name resolves (``MIX`` or ``resolve_texts`` names; None skips): checked before any work, so a
    typo is refused before a model loads rather than after."""
    for name in (None if calibration == MIX else calibration, *texts):
        if name is not None:
            resolve_texts(name)


def text_ids(tokenizer, name: str, n: int) -> tuple[torch.Tensor, str]:
    """The first ``n`` token ids ``[1, n]`` of a text (``resolve_texts`` names) and its label."""
    paths, label = resolve_texts(name)
    ids = torch.cat([_tokens(tokenizer, p) for p in paths])
    if ids.shape[0] < n:
        raise ValueError(f"{label} has {ids.shape[0]} tokens, fewer than the {n} needed (prefill + steps + 1)")
    return ids[None, :n], label


def check_unseen(calibration: CalibrationSet, verify: list[str | None]) -> None:
    """Refuse a verification text that the allocator chooses on, or the same text verified twice."""
    seen: dict[Path, str] = {p: f"calibration ({calibration.label})" for p in calibration.paths}
    for name, field in zip(verify, ("verify_text", "unseen_text")):
        if name is None:
            continue
        paths, label = resolve_texts(name)
        for path in paths:
            if path in seen:
                raise RequestError(field, label, f"it is also used for {seen[path]}: no text used for choosing (or "
                                                 "already verified on) may be used for verifying; give another")
        for path in paths:
            seen[path] = f"verification ({field} {label})"
