"""``AllocateSpec``: everything an allocation is asked for, checked once, before a model loads.

The CLI builds one from its options (so a bad value is refused before the model loads), the workbench and the
sweep pass the same names to ``allocate_policy`` as keywords; both end in one ``AllocateSpec`` whose
``__post_init__`` holds every model-free rule (the codec names, the axes and keep choices, the demote tier, the
base's protection, the speed rule, the texts, the counts, the rotation). What needs the model (the calibrated key
codecs it can use, the calibration tokens, the budget's bytes) is decided in ``job.allocate_policy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqbench.constants import ALLOCATE_CODECS
from tqbench.engine.allocate.budget import check_budget, resolve_min_speed
from tqbench.engine.allocate.demote import check_demote_codecs
from tqbench.engine.allocate.head_job import check_keep_granularity
from tqbench.engine.allocate.keeps import DEFAULT_AXES, KEEP_CHOICES, parse_axes, parse_keeps, speed_rule
from tqbench.engine.allocate.operating import ROTATION_CHOICES
from tqbench.engine.allocate.retrieval import (
    DEFAULT_PROBES,
    DEFAULT_WEIGHT,
    PROBE_MIN,
    PROTOCOLS,
    check_probes,
)
from tqbench.engine.allocate.texts import MIX, check_text_names
from tqbench.engine.codecs import canonical_spec
from tqbench.engine.policy.files import parse_policy
from tqbench.engine.policy.spec import Policy
from tqbench.engine.request import RequestError

DEFAULT_CODECS = ALLOCATE_CODECS
GRANULARITIES = ("layer", "head")
#: joint measurements (protection options + exchange steps) by default
DEFAULT_MEASUREMENTS = 24


@dataclass
class AllocateSpec:
    """The least-KL policy within ``budget`` bits/element at ``context`` tokens, verified on two unseen texts.

    ``base`` gives the token protection (sink, recent) the cells are measured at and the codec options every layer
    shares; ``codecs`` the choices per unit (``k_codecs``: K's, default ``codecs`` plus the calibrated ``pcaq``
    codecs when the model has a fit). ``protections``: (sink, recent) options searched (None: the default grid;
    ``[]``: ``base``'s only; ``exchange.protection_grid``). ``max_measurements``: joint measurements (0: the additive
    solution only). ``verify_text``/``unseen_text`` None skip that verification. ``partial_path``: the partial
    results file (read if present, updated per cell); or ``partial_dir``: a folder holding one such file per setup.
    ``min_speed``: decode tokens/s relative to a dense ``DynamicCache`` at ``context`` the policy must be predicted
    to reach (``speed.py``): a ratio, ``"reference"`` (no slower than uniform turbo4 fused) or None (no minimum);
    ``verify_speed``: also decode the chosen policy (fused) against dense and report the measured ratio;
    ``decode_costs``: the cost table to predict with (default: measured on this machine, cached).
    ``axes``: ``bits`` (codec widths), ``tokens`` (a keep fraction per layer among ``keeps``, evicted by
    ``base``'s score and window: ``keeps.py``, ``joint.py``) or both; ``tokens`` alone keeps every row fp16.
    ``keep_granularity``: ``layer`` (one keep per layer) or ``head`` (one per KV head, with ``granularity`` head:
    ``head_job.py``, ``head_keeps.py``).
    ``demote_codecs``: with the tokens axis, the codecs a layer's evicted rows may be kept at instead of dropped
    (the demote tier, ``demote.py``; none by default), chosen per layer (``demote@layers=codec``).
    ``rotation``: ``auto`` (the Hadamard rotation where the QR one's bytes weigh in the budget; ``operating.py``),
    ``qr`` or ``hadamard``. ``fit_transforms``: fit this model's calibrated key transforms when it has none (the
    ``calibrate`` phase). ``compare_uniform``: verify the uniform policy of no more bytes beside the allocation
    (a warning when the allocation is far worse: ``report.warnings``).
    ``probes``: with the tokens axis, every keep cell is also priced by the answer KL of this many needle probes
    (``retrieval.py``; 0, the default: calibration KL alone), added ``probe_weight`` times, under ``probe_protocols``
    (agnostic, aware or both), at ``probe_context`` tokens (None: ``calib_prefill``, at least ``retrieval.PROBE_MIN``).

    After ``__post_init__``: ``specs`` (the canonical codec choices), ``base_policy``, ``axes`` (a tuple),
    ``keep_choices``, ``demotes``, ``min_speed`` (as the speed rule leaves it) and ``notes`` (what the rules said).
    """

    budget: float
    calibration: str = MIX
    calib_prefill: int = 1024
    calib_steps: int = 32
    codecs: list[str] | tuple[str, ...] = DEFAULT_CODECS
    k_codecs: list[str] | tuple[str, ...] | None = None
    granularity: str = "layer"
    base: Policy | str = "sink=4,recent=16"
    context: int = 1024
    protections: list[tuple[int, int]] | None = None
    max_measurements: int = DEFAULT_MEASUREMENTS
    verify_text: str | None = "rivers"
    unseen_text: str | None = "heldout:technical"
    verify_prefill: int = 1024
    verify_steps: int = 256
    name: str | None = None
    partial_path: str | None = None
    partial_dir: str | None = None
    min_speed: float | str | None = None
    verify_speed: bool = False
    decode_costs: object | None = None  # speed.DecodeCosts
    axes: str | tuple[str, ...] = DEFAULT_AXES
    keeps: str | tuple[float, ...] = KEEP_CHOICES
    keep_granularity: str = "layer"
    demote_codecs: str | tuple[str, ...] = ()
    rotation: str = "auto"
    fit_transforms: bool = False
    compare_uniform: bool = True
    probes: int = DEFAULT_PROBES
    probe_weight: float = DEFAULT_WEIGHT
    probe_protocols: str | tuple[str, ...] = PROTOCOLS
    probe_context: int | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity {self.granularity!r} is invalid: layer (one width per layer and role) or "
                             "head (one width per KV head)")
        self.specs = [canonical_spec(c) for c in self.codecs]
        if len(set(self.specs)) != len(self.specs) or not self.specs:
            raise RequestError("codecs", ",".join(self.codecs), "give distinct codecs, e.g. turbo1,turbo2,turbo4")
        self.base_policy = parse_policy(self.base)
        self.axes = parse_axes(self.axes)
        self.keep_choices = parse_keeps(self.keeps) if "tokens" in self.axes else (1.0,)
        check_keep_granularity(self.keep_granularity, self.axes, self.granularity)
        kept = ([canonical_spec(c) for c in self.k_codecs] if self.k_codecs else self.specs, self.specs)
        self.demotes = check_demote_codecs(self.demote_codecs, self.axes, self.keep_granularity,
                                           kept=kept if "bits" in self.axes else (["fp16"], ["fp16"]))
        if self.base_policy.evicts:
            raise RequestError("base", self.base_policy.to_string(), "its keep values are the allocation's to "
                               "choose: drop keep from the base and search the tokens axis")
        self.probe_protocols = check_probes(self.probes, self.probe_weight, self.probe_protocols)
        if self.probe_context is not None and self.probe_context < PROBE_MIN:
            raise RequestError("probe_context", self.probe_context, f"give at least {PROBE_MIN} tokens (a needle in "
                                                                    "filler, the question and the chat template)")
        self.min_speed, why = speed_rule(self.axes, self.min_speed)
        if why:
            self.notes.append(why)
        if "tokens" not in self.axes:
            check_budget(self.budget, self.specs + [canonical_spec(c) for c in self.k_codecs or ()])
        check_text_names(self.calibration, self.verify_text, self.unseen_text)
        if self.granularity == "head":
            try:
                canonical_spec("turbo2|turbo4")
            except ValueError:
                raise RequestError("granularity", self.granularity, "it needs per-KV-head codecs (head-list specs "
                                   "like turbo2|turbo4), which this build does not have: use layer") from None
        for what, value in (("calib_prefill", self.calib_prefill), ("calib_steps", self.calib_steps)):
            if value < 1:
                raise RequestError(what, value, "use at least 1")
        if self.max_measurements < 0:
            raise RequestError("max_measurements", self.max_measurements, "use 0 or more")
        if self.context < 1:
            raise RequestError("context", self.context, "state the context length in tokens (>= 1)")
        resolve_min_speed(self.min_speed)
        if self.rotation not in ROTATION_CHOICES:
            raise ValueError(f"rotation {self.rotation!r} is invalid: auto (hadamard where the QR rotation's bytes "
                             "weigh), qr or hadamard")

    @property
    def per_head_keeps(self) -> bool:
        return self.keep_granularity == "head"
