"""A sweep spec (TOML): models x policies x texts and the measurements to take on each cell.

Parsed into frozen dataclasses, validated before any model loads; every error names the bad key (as
``models[1].dtype``, ``policies[2]``, ``texts[0].niah.depth``, ``texts[1].tasks.context``) and says what to write
instead. A ``tasks`` text is the long-context task suite (``engine.tasks``) at one context, scored by the
``tasks`` measurement. Torch-free apart
from policy parsing (which the engine does anyway). See the README's "Sweeps" section for the format.

Policies are presets, compact strings or ``{file = "policy.toml"}`` tables (relative to the spec's folder).
An ``{allocate = ...}`` table (a per-layer bit budget from the ``allocate`` command) is rejected today with a
message naming the missing command: the spec reserves the key so budgets can be added without a format change.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqbench.constants import CACHE_MODES

#: every measurement a sweep can take, and the text kinds each applies to
MEASUREMENTS = {
    "validate": ("prompt",),  # greedy baseline vs candidate: verdict, token match, same-context KL
    "teacher_forced": ("prompt", "corpus"),  # KL, perplexity, top-1 with both caches fed the same tokens
    "niah": ("niah",),  # needle-in-a-haystack recall, candidate and baseline
    "speed": ("prompt",),  # decode tokens/s of candidate and baseline (same process), their ratio
    "bytes": ("prompt", "corpus", "niah", "tasks"),  # cache-report bytes of the run + exact estimates at given lengths
    "tasks": ("tasks",),  # the long-context task suite (engine.tasks): candidate and baseline scores per task
}
TEXT_KINDS = ("prompt", "corpus", "niah", "tasks")
_TOP_KEYS = {"name", "models", "policies", "texts", "measure", "baseline", "cache_mode", "chat", "threads",
             "device", "dtype", "validate", "teacher_forced", "niah", "tasks", "bytes", "ray"}


class SpecError(ValueError):
    """A sweep spec that cannot run; the message names the key and the fix."""


def slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_.")
    return s[:60] or "x"


@dataclass(frozen=True)
class ModelEntry:
    spec: str  # what --model takes: default, tiny, a hub id, a folder, a .gguf
    device: str = "auto"
    dtype: str = "auto"

    @property
    def key(self) -> str:
        base = Path(self.spec).name if ("/" in self.spec and Path(self.spec).exists()) else self.spec
        extra = [x for x in (self.dtype, self.device) if x != "auto"]
        return slug("-".join([base, *extra]))

    @property
    def label(self) -> str:
        extra = [x for x in (self.dtype, self.device) if x != "auto"]
        return self.spec + (f" ({', '.join(extra)})" if extra else "")


@dataclass(frozen=True)
class PolicyEntry:
    label: str  # the policy's label (preset name or compact string)
    policy_string: str  # the full compact form (what Run and --kv-policy take)
    source: str  # "preset", "string" or "file:<path>"
    policy: object = field(compare=False, repr=False)  # the parsed Policy

    @property
    def key(self) -> str:
        return slug(self.label)


@dataclass(frozen=True)
class TextEntry:
    name: str
    kind: str  # prompt | corpus | niah | tasks
    prompt: str | None = None
    corpus: str | None = None
    niah_length: int | None = None
    niah_depth: float | None = None
    tasks_context: int | None = None  # the suite's context in tokens
    tasks_samples: int | None = None  # samples per task
    tasks_names: tuple[str, ...] | None = None  # None: the suite's default set

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ValidateSettings:
    max_new_tokens: int = 32
    quality_threshold: float = 0.9


@dataclass(frozen=True)
class TeacherForcedSettings:
    max_new_tokens: int = 32  # prompt texts: the baseline's continuation fed through both caches
    context_tokens: int = 256  # corpus texts: prefill this many tokens ...
    eval_tokens: int = 64  # ... then feed this many


@dataclass(frozen=True)
class NiahSettings:
    max_new_tokens: int = 24
    seed: int = 0


@dataclass(frozen=True)
class TasksSettings:
    seed: int = 0
    cache: bool = True  # reuse (and write) the baseline's answers in the on-disk cache of ``engine.tasks``


@dataclass(frozen=True)
class SweepSpec:
    name: str
    models: tuple[ModelEntry, ...]
    policies: tuple[PolicyEntry, ...]
    texts: tuple[TextEntry, ...]
    measure: tuple[str, ...]
    baseline: PolicyEntry
    cache_mode: str = "compressed"
    chat: bool = True
    threads: int | None = None
    validate: ValidateSettings = ValidateSettings()
    teacher_forced: TeacherForcedSettings = TeacherForcedSettings()
    niah: NiahSettings = NiahSettings()
    tasks: TasksSettings = TasksSettings()
    bytes_tokens: tuple[int, ...] = (1024, 8192)
    shards_per_model: int = 0  # Ray: 0 = as many as the cluster has task slots
    source: str = ""  # the spec file (for the report)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "source": self.source,
            "models": [asdict(m) for m in self.models],
            "policies": [{"label": p.label, "policy_string": p.policy_string, "source": p.source}
                         for p in self.policies],
            "texts": [t.to_dict() for t in self.texts], "measure": list(self.measure),
            "baseline": self.baseline.label, "cache_mode": self.cache_mode, "chat": self.chat,
            "threads": self.threads, "validate": asdict(self.validate),
            "teacher_forced": asdict(self.teacher_forced), "niah": asdict(self.niah),
            "tasks": asdict(self.tasks), "bytes": {"tokens": list(self.bytes_tokens)}, "ray": {"shards_per_model": self.shards_per_model},
        }


# ---- parsing ---------------------------------------------------------------------------------------------
def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a TOML sweep spec."""
    from tqbench.engine.tomlfile import read_toml

    path = Path(path)
    if not path.is_file():
        raise SpecError(f"sweep spec {str(path)!r} does not exist: give the path of a .toml file "
                        "(examples/sweep.toml is one)")
    try:
        data = read_toml(path, "sweep spec")
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    return parse_spec(data, base_dir=path.parent, source=str(path))


def _want(value, types, key: str, what: str):
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SpecError(f"{key} = {value!r} is invalid: give {what}")
    if not isinstance(value, types):
        raise SpecError(f"{key} = {value!r} is invalid: give {what}")
    return value


def _unknown(table: dict, allowed: set, where: str) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise SpecError(f"unknown key {where + '.' if where else ''}{extra[0]}: the keys allowed "
                        f"{'in ' + where if where else 'at the top level'} are {', '.join(sorted(allowed))}")


def _positive(table: dict, key: str, where: str, default: int) -> int:
    v = table.get(key, default)
    _want(v, int, f"{where}.{key}", "a whole number >= 1")
    if v < 1:
        raise SpecError(f"{where}.{key} = {v} is invalid: give a whole number >= 1")
    return v


def _models(raw, device: str, dtype: str) -> tuple[ModelEntry, ...]:
    if raw is None:
        raise SpecError("the spec has no `models`: add e.g. models = [\"default\"]")
    if isinstance(raw, str):
        raw = [raw]
    _want(raw, list, "models", "a list of model names or {spec = ...} tables")
    if not raw:
        raise SpecError("models = [] is empty: list at least one model")
    out = []
    for i, m in enumerate(raw):
        key = f"models[{i}]"
        if isinstance(m, str):
            m = {"spec": m}
        _want(m, dict, key, 'a model name ("default", "tiny", a hub id, a folder) or {spec = "..."}')
        _unknown(m, {"spec", "device", "dtype"}, key)
        if "spec" not in m:
            raise SpecError(f"{key} has no `spec`: give the model, e.g. {{spec = \"default\"}}")
        for k in m:
            _want(m[k], str, f"{key}.{k}", "a string")
        out.append(ModelEntry(m["spec"], m.get("device", device), m.get("dtype", dtype)))
    keys = [m.key for m in out]
    for i, k in enumerate(keys):
        if keys.index(k) != i:
            raise SpecError(f"models[{i}] ({out[i].spec!r}) is listed twice: give each model once")
    return tuple(out)


def _policy(raw, key: str, base_dir: Path) -> PolicyEntry:
    from tqbench.engine.policy.files import load_policy_file, parse_policy
    from tqbench.engine.policy.presets import PRESETS

    try:
        if isinstance(raw, str):
            pol = parse_policy(raw)
            source = "preset" if raw in PRESETS else "string"
        elif isinstance(raw, dict):
            if "allocate" in raw:
                raise SpecError(f"{key}: an `allocate` budget needs the `tqbench allocate` command, which this "
                                "build does not have yet: run the allocation separately and list its policy "
                                "file as {file = \"...\"} instead")
            _unknown(raw, {"file", "allocate"}, key)
            if "file" not in raw:
                raise SpecError(f"{key} is a table without `file`: write {{file = \"policy.toml\"}} or a "
                                "policy string")
            path = Path(_want(raw["file"], str, f"{key}.file", "a path"))
            path = path if path.is_absolute() else base_dir / path
            if not path.is_file():
                raise SpecError(f"{key}.file: {str(path)!r} does not exist")
            pol = load_policy_file(str(path))
            source = f"file:{path}"
        else:
            raise SpecError(f"{key} = {raw!r} is invalid: give a preset name, a compact policy string or "
                            "{file = \"policy.toml\"}")
    except SpecError:
        raise
    except ValueError as exc:
        raise SpecError(f"{key}: {str(exc).splitlines()[0]}") from None
    return PolicyEntry(pol.label, pol.to_string(), source, pol)


def _texts(raw, base_dir: Path) -> tuple[TextEntry, ...]:
    if raw is None:
        raise SpecError("the spec has no [[texts]]: add at least one, e.g. [[texts]] name = \"q\" prompt = \"...\"")
    _want(raw, list, "texts", "[[texts]] tables")
    if not raw:
        raise SpecError("texts = [] is empty: add at least one [[texts]] table")
    out = []
    for i, t in enumerate(raw):
        key = f"texts[{i}]"
        _want(t, dict, key, "a table with name and one of prompt, prompt_file, corpus, niah, tasks")
        _unknown(t, {"name", "prompt", "prompt_file", "corpus", "niah", "tasks"}, key)
        kinds = [k for k in ("prompt", "prompt_file", "corpus", "niah", "tasks") if k in t]
        if len(kinds) != 1:
            raise SpecError(f"{key} must have exactly one of prompt, prompt_file, corpus, niah, tasks (it has "
                            f"{', '.join(kinds) or 'none'})")
        name = _want(t.get("name", f"text{i}"), str, f"{key}.name", "a string")
        kind = kinds[0]
        if kind == "prompt":
            prompt = _want(t["prompt"], str, f"{key}.prompt", "the prompt text")
            if not prompt.strip():
                raise SpecError(f"{key}.prompt is empty: give some text")
            out.append(TextEntry(name, "prompt", prompt=prompt))
        elif kind == "prompt_file":
            p = Path(_want(t["prompt_file"], str, f"{key}.prompt_file", "a path"))
            p = p if p.is_absolute() else base_dir / p
            if not p.is_file():
                raise SpecError(f"{key}.prompt_file: {str(p)!r} does not exist")
            out.append(TextEntry(name, "prompt", prompt=p.read_text(encoding="utf-8")))
        elif kind == "corpus":
            from tqbench.constants import CORPUS_DIR

            c = _want(t["corpus"], str, f"{key}.corpus", "a shipped corpus name")
            if not (CORPUS_DIR / f"{c}.txt").is_file():
                names = ", ".join(sorted(p.stem for p in CORPUS_DIR.glob("*.txt")))
                raise SpecError(f"{key}.corpus = {c!r} is unknown: shipped texts are {names}")
            out.append(TextEntry(name, "corpus", corpus=c))
        elif kind == "tasks":
            out.append(_tasks_text(name, t["tasks"], f"{key}.tasks"))
        else:
            n = _want(t["niah"], dict, f"{key}.niah", "{length = 512, depth = 0.5}")
            _unknown(n, {"length", "depth"}, f"{key}.niah")
            length = _positive(n, "length", f"{key}.niah", 512)
            if length < 16:
                raise SpecError(f"{key}.niah.length = {length} is too short: use at least 16 tokens")
            depth = _want(n.get("depth", 0.5), (int, float), f"{key}.niah.depth", "a fraction between 0 and 1")
            if not 0 <= depth <= 1:
                raise SpecError(f"{key}.niah.depth = {depth} is invalid: give a fraction between 0 and 1")
            out.append(TextEntry(name, "niah", niah_length=length, niah_depth=float(depth)))
    names = [slug(t.name) for t in out]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise SpecError(f"texts[{i}].name = {out[i].name!r} is used twice: give each text its own name")
    return tuple(out)


def _tasks_text(name: str, raw, key: str) -> TextEntry:
    """``tasks = {context = 4096, samples = 3, names = ["niah_single"]}``: the suite's own rules
    (``engine.tasks.check_tasks``; the model's context limit is checked once it has loaded)."""
    from tqbench.engine.request import RequestError
    from tqbench.engine.tasks import CONTEXTS, DEFAULT_SAMPLES, check_tasks

    t = _want(raw, dict, key, f"{{context = {CONTEXTS[1]}, samples = {DEFAULT_SAMPLES}}} (names: optional)")
    _unknown(t, {"context", "samples", "names"}, key)
    if "context" not in t:
        raise SpecError(f"{key} has no `context`: give the suite's context in tokens, e.g. "
                        f"{{context = {CONTEXTS[1]}}}")
    context = _want(t["context"], int, f"{key}.context", "a whole number of tokens, e.g. 4096")
    samples = _want(t.get("samples", DEFAULT_SAMPLES), int, f"{key}.samples", "a whole number of samples per task")
    names = t.get("names")
    if names is not None:
        _want(names, list, f"{key}.names", "a list of task names")
        for i, n in enumerate(names):
            _want(n, str, f"{key}.names[{i}]", "a task name")
    try:
        check_tasks(names, context, samples)
    except RequestError as exc:
        raise SpecError(exc.spelled(f"{key}.{'names' if exc.field == 'tasks' else exc.field}")) from None
    return TextEntry(name, "tasks", tasks_context=context, tasks_samples=samples,
                     tasks_names=tuple(names) if names is not None else None)


def parse_spec(data: dict, base_dir: str | Path = ".", source: str = "") -> SweepSpec:
    """Validate a spec's TOML tables (see the module docstring) into a ``SweepSpec``."""
    base_dir = Path(base_dir)
    _unknown(data, _TOP_KEYS, "")
    name = _want(data.get("name", Path(source).stem if source else "sweep"), str, "name", "a string")
    device = _want(data.get("device", "auto"), str, "device", "auto, cpu, cuda or mps")
    dtype = _want(data.get("dtype", "auto"), str, "dtype", "auto, float32, bfloat16, float16 or float64")
    models = _models(data.get("models"), device, dtype)
    raw_pols = data.get("policies")
    if raw_pols is None:
        raise SpecError("the spec has no `policies`: add e.g. policies = [\"turbo4\", \"turbo3\"]")
    _want(raw_pols, list, "policies", "a list of presets, policy strings or {file = ...} tables")
    if not raw_pols:
        raise SpecError("policies = [] is empty: list at least one candidate policy")
    policies = tuple(_policy(p, f"policies[{i}]", base_dir) for i, p in enumerate(raw_pols))
    baseline = _policy(data.get("baseline", "fp16"), "baseline", base_dir)
    labels = [p.label for p in policies]
    for i, p in enumerate(policies):
        if labels.index(p.label) != i:
            raise SpecError(f"policies[{i}] ({p.label!r}) is listed twice: give each policy once")
        if p.label == baseline.label:
            raise SpecError(f"policies[{i}] ({p.label!r}) is the baseline: list only candidates in `policies`")
    texts = _texts(data.get("texts"), base_dir)
    measure = data.get("measure", list(MEASUREMENTS))
    _want(measure, list, "measure", f"a list drawn from {', '.join(MEASUREMENTS)}")
    for i, m in enumerate(measure):
        if m not in MEASUREMENTS:
            raise SpecError(f"measure[{i}] = {m!r} is unknown: choose from {', '.join(MEASUREMENTS)}")
    if not measure:
        raise SpecError(f"measure = [] is empty: choose from {', '.join(MEASUREMENTS)}")
    for i, t in enumerate(texts):
        if not any(t.kind in MEASUREMENTS[m] for m in measure):
            fits = [m for m, kinds in MEASUREMENTS.items() if t.kind in kinds]
            raise SpecError(f"texts[{i}] ({t.name!r}) is a {t.kind} text and `measure` has nothing for it: "
                            f"add one of {', '.join(fits)}")
    cache_mode = _want(data.get("cache_mode", "compressed"), str, "cache_mode", ", ".join(CACHE_MODES))
    if cache_mode not in CACHE_MODES:
        raise SpecError(f"cache_mode = {cache_mode!r} is unknown: choose from {', '.join(CACHE_MODES)}")
    chat = _want(data.get("chat", True), bool, "chat", "true or false")
    threads = data.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise SpecError(f"threads = {threads!r} is invalid: give a whole number >= 1 (or leave it out)")
    v = _want(data.get("validate", {}), dict, "validate", "a [validate] table")
    _unknown(v, {"max_new_tokens", "quality_threshold"}, "validate")
    qt = _want(v.get("quality_threshold", 0.9), (int, float), "validate.quality_threshold", "a number in (0, 1]")
    if not 0 < qt <= 1:
        raise SpecError(f"validate.quality_threshold = {qt} is invalid: give a number in (0, 1]")
    val = ValidateSettings(_positive(v, "max_new_tokens", "validate", 32), float(qt))
    tf = _want(data.get("teacher_forced", {}), dict, "teacher_forced", "a [teacher_forced] table")
    _unknown(tf, {"max_new_tokens", "context_tokens", "eval_tokens"}, "teacher_forced")
    tfs = TeacherForcedSettings(*(_positive(tf, k, "teacher_forced", d) for k, d in
                                  (("max_new_tokens", 32), ("context_tokens", 256), ("eval_tokens", 64))))
    nh = _want(data.get("niah", {}), dict, "niah", "a [niah] table")
    _unknown(nh, {"max_new_tokens", "seed"}, "niah")
    seed = _want(nh.get("seed", 0), int, "niah.seed", "a whole number")
    nhs = NiahSettings(_positive(nh, "max_new_tokens", "niah", 24), seed)
    ts = _want(data.get("tasks", {}), dict, "tasks", "a [tasks] table")
    _unknown(ts, {"seed", "cache"}, "tasks")
    tss = TasksSettings(_want(ts.get("seed", 0), int, "tasks.seed", "a whole number"),
                        _want(ts.get("cache", True), bool, "tasks.cache", "true or false"))
    by = _want(data.get("bytes", {}), dict, "bytes", "a [bytes] table")
    _unknown(by, {"tokens"}, "bytes")
    toks = _want(by.get("tokens", [1024, 8192]), list, "bytes.tokens", "a list of context lengths")
    for i, n in enumerate(toks):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecError(f"bytes.tokens[{i}] = {n!r} is invalid: give whole numbers >= 1")
    ray = _want(data.get("ray", {}), dict, "ray", "a [ray] table")
    _unknown(ray, {"shards_per_model"}, "ray")
    shards = _want(ray.get("shards_per_model", 0), int, "ray.shards_per_model", "a whole number >= 0 (0 = auto)")
    if shards < 0:
        raise SpecError(f"ray.shards_per_model = {shards} is invalid: give 0 (auto) or more")
    return SweepSpec(name, models, policies, texts, tuple(measure), baseline, cache_mode, chat, threads, val, tfs,
                     nhs, tss, tuple(toks), shards, source)
