"""The Run tab's controls: the prompt, the baseline and candidate policies, the candidate's cache mode, length and
sampling (``run_controls``, yielded in ``RunPane.compose``), read into the engine's request (``RunParams``) and
filled from a saved run (``RunControls``, a part of ``RunPane``)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.containers import Horizontal
from textual.suggester import SuggestFromList
from textual.widgets import Button, Checkbox, Input, Label, Select, TextArea

from tqbench.constants import (
    CACHE_MODE_RESIDENT,
    CACHE_MODES,
    DEFAULT_PROMPT,
    DENSE_BASELINES,
    fastest_quality_mode,
)
from tqbench.tui.widgets.prompt_box import PromptBox


@dataclass(frozen=True)
class RunParams:
    prompt: str
    chat: bool
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    baseline: str
    candidate: str
    cache_mode: str | None  # None: the device's fastest quality-faithful mode, chosen once the model loads

    @property
    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    @property
    def request(self):
        """The engine's ``GenerationRequest`` (validated: the same rules and messages as the CLI and server)."""
        from tqbench.engine import GenerationRequest

        return GenerationRequest(self.max_new_tokens, self.temperature, self.top_p, self.seed)


def run_controls(p: RunParams | None):
    """The prompt box and the two rows of controls, filled from ``p`` (None: the defaults)."""
    from tqbench.engine.policy import PRESETS

    presets = list(PRESETS)
    yield PromptBox(p.prompt if p else DEFAULT_PROMPT, id="prompt")
    with Horizontal(id="first-controls", classes="controls"):
        yield Label("baseline")
        yield Input(p.baseline if p else "fp16", id="baseline", compact=True,
                    suggester=SuggestFromList([*DENSE_BASELINES, *presets]),
                    tooltip="Baseline: a policy (preset or compact form) or a dense DynamicCache: dense (K/V in the "
                            "model's dtype), dense-fp16 or dense-bf16 (K/V rows stored in 16 bits)")
        yield Label("candidate")
        yield Input(p.candidate if p else "turbo4", id="candidate", compact=True,
                    suggester=SuggestFromList(presets), tooltip="Candidate policy: a preset, k=...,v=... or a file")
        mode = p.cache_mode if p and p.cache_mode else fastest_quality_mode("cpu")
        yield Select([(m, m) for m in CACHE_MODES], value=mode, id="mode", compact=True, allow_blank=False,
                     tooltip="Candidate cache mode. Default: the fastest mode whose quality claims hold on the loaded "
                             "device (fused on CPU), whatever the policy; the headless CLI defaults to compressed, "
                             "which needs no kernel")
        yield Label(CACHE_MODE_RESIDENT[mode], id="mode-note")
    with Horizontal(classes="controls"):
        yield Label("max tokens")
        yield Input(str(p.max_new_tokens if p else 48), id="max-tokens", compact=True, type="integer")
        yield Checkbox("chat", p.chat if p else True, id="chat", compact=True, tooltip="Apply the chat template")
        yield Label("temperature")
        yield Input(str(p.temperature if p else 0.0), id="temperature", compact=True, type="number",
                    tooltip="0 = greedy; > 0 samples with the seed")
        yield Label("top-p")
        yield Input(str(p.top_p if p else 1.0), id="top-p", compact=True, type="number")
        yield Label("seed")
        yield Input(str(p.seed if p else 0), id="seed", compact=True, type="integer")
        yield Button("Run ^r", id="run-button", compact=True, variant="primary")


class RunControls:
    """Reading and filling ``run_controls``' fields: a part of ``RunPane`` (which keeps the message handlers:
    Textual finds ``@on`` handlers on widget classes only)."""

    initial: RunParams | None
    _mode_chosen: bool  # the user (or a saved run) picked the candidate's cache mode

    def params(self) -> RunParams:
        """The form as ``RunParams``; bad input raises ``ValueError`` with a message naming the field."""
        from tqbench.engine.policy import parse_policy

        def num(widget_id: str, kind, what: str):
            raw = self.query_one(f"#{widget_id}", Input).value.strip()
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{what} {raw!r} is not a number") from None

        prompt = self.query_one("#prompt", TextArea).text
        if not prompt.strip():
            raise ValueError("the prompt is empty: type some text in the prompt box")
        max_new = num("max-tokens", int, "max tokens")
        base = self.query_one("#baseline", Input).value.strip() or "fp16"
        cand = self.query_one("#candidate", Input).value.strip()
        if base not in DENSE_BASELINES:  # dense, dense-fp16, dense-bf16: a DynamicCache, not a policy
            parse_policy(base)
        parse_policy(cand)
        p = RunParams(prompt, self.query_one("#chat", Checkbox).value, max_new, num("temperature", float, "temperature"),
                      num("top-p", float, "top-p"), num("seed", int, "seed"), base, cand,
                      str(self.query_one("#mode", Select).value))
        p.request  # noqa: B018  (validates max tokens, temperature, top-p)
        return p

    def fill(self, params: dict) -> None:
        """Put a saved run's parameters into the form."""
        self.query_one("#prompt", TextArea).text = params["prompt"]
        self.query_one("#chat", Checkbox).value = bool(params["chat"])
        self.query_one("#max-tokens", Input).value = str(params["max_new_tokens"])
        s = params.get("sampling", {})
        self.query_one("#temperature", Input).value = str(s.get("temperature", 0.0))
        self.query_one("#top-p", Input).value = str(s.get("top_p", 1.0))
        self.query_one("#seed", Input).value = str(s.get("seed", 0))
        if params.get("baseline"):
            self.query_one("#baseline", Input).value = params["baseline"]
        self.query_one("#candidate", Input).value = params["candidate"]
        mode = params.get("candidate_mode") or "compressed"
        if mode in CACHE_MODES:
            self.query_one("#mode", Select).value = mode

    def params_or_defaults(self) -> dict:
        """The form as a ``fill`` dict, without validation."""
        def val(i: str) -> str:
            return self.query_one(f"#{i}", Input).value
        return {"prompt": self.query_one("#prompt", TextArea).text, "chat": self.query_one("#chat", Checkbox).value,
                "max_new_tokens": val("max-tokens"), "baseline": val("baseline"), "candidate": val("candidate"),
                "candidate_mode": str(self.query_one("#mode", Select).value),
                "sampling": {"temperature": val("temperature"), "top_p": val("top-p"), "seed": val("seed")}}

    def engine_ready(self, device_type: str) -> None:
        """The model is loaded: a mode nobody chose becomes the fastest quality-faithful one on its device."""
        if (self.initial is None or self.initial.cache_mode is None) and not self._mode_chosen:
            with self.prevent(Select.Changed):
                self.query_one("#mode", Select).value = fastest_quality_mode(device_type)
            self._show_mode_note()

    def _show_mode_note(self) -> None:
        mode = str(self.query_one("#mode", Select).value)
        self.query_one("#mode-note", Label).update(CACHE_MODE_RESIDENT.get(mode, ""))

    def set_candidate(self, policy: str) -> None:
        """A candidate chosen elsewhere (Policies, Scan, Compare): the texts of another candidate's run leave the
        screen (a run in progress keeps its own)."""
        field = self.query_one("#candidate", Input)
        changed = field.value.strip() != policy
        field.value = policy
        if changed and not self.running:
            self.clear_shown()
