"""Policies: the presets and a builder with live bits per element and a KV estimate at a chosen context."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Button, Checkbox, Input, Label, OptionList, Select, Static
from textual.widgets.option_list import Option

from tqbench.engine.policy.keep import fmt_keep
from tqbench.tui.panes.allocate import AllocatePanel


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


class PoliciesPane(Horizontal):
    HELP_SCOPE = "Policies"
    #: priority: from the builder's text fields too (an Input's ctrl+u / ctrl+k would erase its text)
    BINDINGS = [
        Binding("ctrl+u", "use", "Use as candidate", tooltip="Put the built policy into Run's candidate (ctrl+r "
                "runs it)", id="policies.use", priority=True),
        Binding("ctrl+k", "keep", "Keep policy", tooltip="Name and keep the built policy (saved with the session)",
                id="policies.keep", priority=True),
        # from anywhere on the tab (it did nothing, without a word, unless the allocation panel had focus)
        Binding("ctrl+t", "frontier", "Measure frontier",
                tooltip="Measure every preset on the held-out text and plot it beside the allocations",
                id="policies.frontier", priority=True),
    ]

    DEFAULT_CSS = """
    PoliciesPane { height: 1fr; }
    PoliciesPane #policy-list { width: 44; min-width: 30; border: round $panel; height: 1fr; }
    PoliciesPane #builder { width: 1fr; border: round $panel; padding: 0 1; }
    PoliciesPane .row { height: 1; }
    PoliciesPane .row Label { width: 16; color: $text-muted; }
    PoliciesPane .row Select { width: 22; }
    PoliciesPane .row Input { width: 1fr; max-width: 40; }
    PoliciesPane #estimate { height: auto; padding: 1 0 0 0; }
    PoliciesPane #export { height: auto; padding: 0 0 1 0; }
    PoliciesPane #policy-buttons { height: 1; }
    PoliciesPane #policy-buttons Button { margin-right: 2; }
    """

    class Chosen(Message):
        """The user picked a policy to run as the candidate."""

        def __init__(self, policy: str) -> None:
            super().__init__()
            self.policy = policy

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kept: dict[str, str] = {}
        self.current: str = ""
        self.estimate = None
        #: the policy last loaded into the builder: the keys the builder has no field for (srecent, budget, kblock
        #: ...) are carried from it into the built policy, so loading a policy and running it loses nothing
        self.loaded = None

    def compose(self) -> ComposeResult:
        from tqbench.engine.codecs import CODEC_SPECS
        from tqbench.engine.deploy import ENGINE_LABELS
        from tqbench.engine.policy import ROTATION_CHOICES, SLIDING_CHOICES
        from tqbench.engine.policy.checks import demote_choices
        from tqbench.engine.policy.keep import ADA_FLOOR, SCORES

        codecs = [(c, c) for c in CODEC_SPECS]
        yield OptionList(id="policy-list")
        # not focusable itself: the first Tab from the list goes to the K codec, not to an unmarked container
        # (the builder scrolls to whichever of its fields has focus)
        with VerticalScroll(id="builder", can_focus=False):
            with Horizontal(classes="row"):
                yield Label("K codec")
                yield Select(codecs, value="turbo4", id="k-codec", compact=True, allow_blank=False)
            with Horizontal(classes="row"):
                yield Label("V codec")
                yield Select(codecs, value="turbo4", id="v-codec", compact=True, allow_blank=False)
            with Horizontal(classes="row"):
                yield Label("rotation")
                yield Select([(r, r) for r in ROTATION_CHOICES], value="qr", id="rotation", compact=True,
                             allow_blank=False)
            with Horizontal(classes="row"):
                yield Label("key centering")
                yield Checkbox("on", True, id="center", compact=True)
            with Horizontal(classes="row"):
                yield Label("sink tokens")
                yield Input("4", id="sink", compact=True, type="integer")
            with Horizontal(classes="row"):
                yield Label("recent window")
                yield Input("16", id="recent", compact=True, type="integer")
            with Horizontal(classes="row"):
                yield Label("protect layers")
                yield Input("", id="protect", compact=True, placeholder="first2+last2, 5, 3-6")
            with Horizontal(classes="row"):
                yield Label("overrides")
                yield Input("", id="overrides", compact=True, placeholder="v@last8=int8 k@0-3=fp16")
            with Horizontal(classes="row"):
                yield Label("keep tokens")
                yield Input("1.0", id="keep", compact=True,
                            placeholder="1 = keep all · 0.5 = half · 1024rows = rows per KV head",
                            tooltip="Token eviction: a fraction of the evictable rows (0.5) or rows per KV head "
                            "(1024); sinks and the last max(window, recent) rows are never evicted")
            with Horizontal(classes="row"):
                yield Label("evict by score")
                yield Select([(sc, sc) for sc in SCORES], value="snapkv", id="score", compact=True,
                             allow_blank=False, tooltip="How rows are ranked (docs/policies.md: which published "
                             "method each follows)")
            with Horizontal(classes="row"):
                yield Label("obs. window")
                yield Input("32", id="window", compact=True, type="integer",
                            tooltip="The last queries a score reads (never evicted themselves)")
            with Horizontal(classes="row"):
                yield Label("evict in chunks of")
                yield Input("1", id="chunk", compact=True, type="integer",
                            tooltip="chunk=: keep or evict rows in aligned chunks of this many positions, ranked by "
                            "the chunk's mean score (ChunkKV; keeps a number's digits together); 1: row by row")
            with Horizontal(classes="row"):
                yield Label("re-evict every")
                yield Input("0", id="every", compact=True, type="integer",
                            tooltip="While decoding, evict again every N decoded tokens (0: only at the prompt)")
            with Horizontal(classes="row"):
                yield Label("head budgets")
                yield Select([("same rows per head", "uniform"), ("AdaKV: shared by score", "ada")], value="uniform",
                             id="heads", compact=True, allow_blank=False,
                             tooltip="heads=: every KV head keeps the same rows, or a layer's kept rows go to "
                             "the heads whose scores are best (AdaKV; same bytes)")
                yield Input(str(ADA_FLOOR), id="ada-floor", compact=True,
                            tooltip="ada_floor=: with AdaKV, the fraction of its even share each head keeps at least")
            with Horizontal(classes="row"):
                yield Label("evicted rows")
                yield Select([("dropped", "drop"), *((f"demoted to {c}", c) for c in demote_choices("turbo4", "turbo4"))],
                             value="drop",
                             id="demote", compact=True, allow_blank=False,
                             tooltip="Drop the evicted rows, or keep them at a cheaper codec that attention still "
                             "reads (demote=; every mode but dense-shadow)")
            with Horizontal(classes="row"):
                yield Label("sliding layers")
                yield Select([(c, c) for c in SLIDING_CHOICES], value="auto", id="sliding", compact=True,
                             allow_blank=False)
            with Horizontal(classes="row"):
                yield Label("context tokens")
                yield Input("1024", id="context", compact=True, type="integer")
            with Horizontal(classes="row"):
                yield Label("geometry of")
                yield Input("", id="geometry-model", compact=True,
                            placeholder="loaded model · Gemma-2-9B · path/to/config.json")
            with Horizontal(classes="row"):
                yield Label("name")
                yield Input("", id="policy-name", compact=True, placeholder="a name to keep it as")
            yield Static("", id="estimate")
            with Horizontal(classes="row"):
                yield Label("export to")
                yield Select([(label, e) for e, label in ENGINE_LABELS.items()], value="llamacpp",
                             id="export-engine", compact=True, allow_blank=False)
            yield Static("", id="export")
            with Horizontal(id="policy-buttons"):
                yield Button("Use as candidate ^u", id="use", compact=True, variant="primary")
                yield Button("Keep ^k", id="keep", compact=True)
            yield AllocatePanel(id="allocate-panel")

    def on_mount(self) -> None:
        self.reload_list()
        self.recompute()

    # ---- the list --------------------------------------------------------------------------------
    def reload_list(self) -> None:
        from tqbench.engine.cache.estimate import estimate_kv
        from tqbench.engine.policy import ENGINE_PRESETS, PRESET_TEXT, parse_policy, shipped_policy_names

        geo, ctx = self.geometry(), self.context()
        fingerprint = self._fingerprint()
        ol = self.query_one("#policy-list", OptionList)
        ol.clear_options()
        entries = [(name, PRESET_TEXT[name][0]) for name in PRESET_TEXT] + \
            [(name, name) for name in shipped_policy_names()] + [(name, name) for name in ENGINE_PRESETS] + \
            list(self.kept.items())
        marked = False
        for name, text in entries:
            tag = " [i](kept)[/i]" if name in self.kept else ""
            try:
                pol = parse_policy(text)
                est = estimate_kv(pol, geo, ctx)
                bits = f"{est.bits_per_element:5.2f} b"
                if pol.fitted_on is not None and pol.fitted_on.warning(fingerprint, geo):
                    tag += " [dim]*[/dim]"  # fitted on another model (the border says; highlighting says which)
                    marked = True
            except ValueError:  # e.g. an allocation or a calibrated fit made for another geometry
                bits = "  n/a "
                tag += " [dim]not for this model: highlight it for why[/dim]"
            ol.add_option(Option(f"{name:<26} {bits}{tag}", id=f"p:{name}"))
        ol.border_title = f"presets · bits/element at {ctx} tokens"
        ol.border_subtitle = "* fitted on another model" if marked else ""

    def policy_text(self, name: str) -> str:
        from tqbench.engine.policy import PRESET_TEXT

        if name in self.kept:
            return self.kept[name]
        return PRESET_TEXT[name][0] if name in PRESET_TEXT else name  # a shipped policy file, by name

    @on(OptionList.OptionHighlighted, "#policy-list")
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self.load_into_builder(event.option.id[2:])

    @on(OptionList.OptionSelected, "#policy-list")
    def _selected(self, event: OptionList.OptionSelected) -> None:
        name = event.option.id[2:]
        self.load_into_builder(name)
        self.post_message(self.Chosen(name if name not in self.kept else self.kept[name]))

    def load_into_builder(self, name: str) -> None:
        from tqbench.engine.policy import parse_policy

        pol = parse_policy(self.policy_text(name))
        self.loaded = pol
        with self.prevent(Input.Changed, Select.Changed, Checkbox.Changed):
            _set_codec(self.query_one("#k-codec", Select), pol.k)
            _set_codec(self.query_one("#v-codec", Select), pol.v)
            self.query_one("#rotation", Select).value = pol.rotation
            self.query_one("#center", Checkbox).value = pol.center
            self.query_one("#sliding", Select).value = pol.sliding
            self.query_one("#sink", Input).value = str(pol.sink)
            self.query_one("#recent", Input).value = str(pol.recent)
            self.query_one("#keep", Input).value = fmt_keep(pol.keep)
            self.query_one("#score", Select).value = pol.score
            self.query_one("#window", Input).value = str(pol.window)
            self.query_one("#chunk", Input).value = str(pol.chunk)
            self.query_one("#every", Input).value = str(pol.every)
            self.query_one("#heads", Select).value = pol.heads
            self.query_one("#ada-floor", Input).value = f"{pol.ada_floor:g}"
            self._offer_demotes()
            demote = self.query_one("#demote", Select)
            if (pol.demote or "drop") not in {value for _, value in demote._options}:
                demote.set_options([*demote._options, (f"demoted to {pol.demote}", pol.demote)])
            demote.value = pol.demote or "drop"
            self.query_one("#protect", Input).value = pol.protect
            self.query_one("#overrides", Input).value = " ".join(f"{r}@{s}={c}" for r, s, c in pol.overrides)
            self.query_one("#policy-name", Input).value = name
        self.recompute()

    # ---- the builder -----------------------------------------------------------------------------
    def geometry(self):
        """The KV geometry estimates use: the model named in "geometry of" (a shipped config name, a local
        config.json or model folder: no weights needed), else the loaded model's, else the default model's.
        A name that does not resolve raises ValueError (shown in place of the estimate)."""
        from tqbench.engine.cache import KVGeometry, default_geometry, model_geometry

        named = self.query_one("#geometry-model", Input).value.strip()
        if named:
            return model_geometry(named).geometry
        engine = getattr(self.app, "engine", None)
        if engine is not None:
            return KVGeometry.from_config(engine.config)
        return default_geometry()

    def _fingerprint(self) -> str | None:
        """The loaded model's fingerprint where estimates are for it (no "geometry of" named), else None."""
        engine = getattr(self.app, "engine", None)
        if engine is None or self.query_one("#geometry-model", Input).value.strip():
            return None
        return engine.loaded.fingerprint

    def _fitted_line(self, geo) -> str:
        """The loaded policy's "fitted on another model" warning (``FittedOn.warning``, the one rule), or ""."""
        fitted = getattr(self.loaded, "fitted_on", None)
        warning = fitted.warning(self._fingerprint(), geo) if fitted is not None else None
        return f"[b yellow]{warning}[/]\n" if warning else ""

    def _context_warning(self, tokens: int) -> str:
        """The line kv-estimate's note gives when the context is beyond the model's (empty when it is not)."""
        from tqbench.engine.cache import model_geometry

        named = self.query_one("#geometry-model", Input).value.strip()
        engine = getattr(self.app, "engine", None)
        try:
            limit = (model_geometry(named).max_context if named else engine.max_context if engine is not None
                     else model_geometry("default").max_context)
        except (ValueError, OSError, AttributeError):
            return ""
        if not limit or tokens <= limit:
            return ""
        return f"[b yellow]context {tokens} is beyond the model's context of {limit} tokens[/]\n"

    def context(self) -> int:
        try:
            return max(1, int(self.query_one("#context", Input).value or "1024"))
        except ValueError:
            return 1024

    def built_policy(self):
        """The builder's fields as the engine's ``Policy`` (its checks; bad fields raise ``ValueError`` naming the
        field) over the last loaded policy (the keys the builder has no field for are carried from it). Overrides
        are read by the compact grammar, the one reader of ``ROLE@LAYERS=VALUE``."""
        from dataclasses import replace

        from tqbench.engine.policy import Policy, parse_policy
        from tqbench.engine.policy.keep import parse_keep

        def val(i: str) -> str:
            return self.query_one(f"#{i}", Input).value.strip()

        def whole(i: str, what: str) -> int:
            text = val(i)
            if not text:
                return getattr(Policy(), i)
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{what} {text!r} is not a whole number") from None

        overrides = " ".join(o for o in val("overrides").replace(",", " ").split() if o)
        # (parsed over an evicting scratch policy: a demote@ override needs one; only the overrides are kept)
        parsed = parse_policy(",".join(["k=fp16,keep=0.5", *overrides.split()])).overrides if overrides else ()
        return replace(
            self.loaded if self.loaded is not None else Policy(), name=None, fitted_on=None,
            k=str(self.query_one("#k-codec", Select).value), v=str(self.query_one("#v-codec", Select).value),
            sink=whole("sink", "sink tokens"), recent=whole("recent", "recent window"), protect=val("protect"),
            rotation=str(self.query_one("#rotation", Select).value), center=self.query_one("#center", Checkbox).value,
            sliding=str(self.query_one("#sliding", Select).value), overrides=parsed,
            keep=parse_keep(val("keep") or "1.0"), score=str(self.query_one("#score", Select).value),
            window=whole("window", "observation window"), chunk=whole("chunk", "chunk"),
            every=whole("every", "re-evict every"),
            demote=_demote(self.query_one("#demote", Select).value),
            heads=str(self.query_one("#heads", Select).value), ada_floor=_fraction(val("ada-floor"), "ada_floor"),
        )

    def built_string(self) -> str:
        """The built policy's compact form, written by the engine (``Policy.to_string``)."""
        return self.built_policy().to_string()

    @on(Input.Changed)
    @on(Select.Changed)
    @on(Checkbox.Changed)
    def _changed(self, event) -> None:
        if getattr(event, "input", None) is not None and event.input.id in ("context", "geometry-model"):
            try:
                self.reload_list()
            except ValueError:  # a geometry name being typed: the estimate below says what is wrong
                pass
        if getattr(event, "input", None) is not None and event.input.id == "policy-name":
            return
        if getattr(event, "select", None) is not None and event.select.id == "export-engine":
            self.show_export()
            return
        if getattr(event, "select", None) is not None and event.select.id in ("k-codec", "v-codec"):
            self._offer_demotes()
        self.recompute()

    def _offer_demotes(self) -> None:
        """The demote tiers cheaper than the chosen K and V codecs (``policy.checks.demote_choices``, the policy's
        own rule): a tier that would be refused is never offered; a chosen one that no longer is becomes "dropped"."""
        from tqbench.engine.policy.checks import demote_choices

        demote = self.query_one("#demote", Select)
        k, v = (str(self.query_one(f"#{r}-codec", Select).value) for r in ("k", "v"))
        choices = demote_choices(k, v)
        current = demote.value if demote.value in choices else "drop"
        with self.prevent(Select.Changed):
            demote.set_options([("dropped", "drop"), *((f"demoted to {c}", c) for c in choices)])
            demote.value = current

    def recompute(self) -> None:
        from tqbench.engine.cache.estimate import estimate_kv

        out = self.query_one("#estimate", Static)
        try:
            geo = self.geometry()
        except ValueError as exc:
            self.current, self.estimate = "", None
            out.update(f"[b red]no geometry for \"geometry of\"[/]: {exc}")
            self.show_export()  # clears what the previous policy mapped to
            return
        try:
            pol = self.built_policy()
            est = estimate_kv(pol, geo, self.context())
        except ValueError as exc:
            self.current, self.estimate = "", None
            out.update(f"[b red]invalid policy[/]: {exc}")
            self.show_export()  # clears what the previous policy mapped to (or its error)
            return
        self.current, self.estimate = pol.to_string(), est
        g = geo
        n_sliding = sum(t == "sliding_attention" for t in g.layer_types or ())
        sliding = f", {n_sliding} sliding (window {g.sliding_window})" if n_sliding else ""
        out.update(
            f"[b]{pol.to_string()}[/b]\n"
            f"[b]{est.bits_per_element:.2f}[/b] bits/element · KV at {est.seq_len} tokens: "
            f"[b]{_mib(est.total_bytes)}[/b] vs fp16 {_mib(est.dense_fp16_bytes)} "
            f"([b green]{est.saved_pct:.1f}% saved[/]) · shared {est.shared_bytes} B\n"
            f"{self._context_warning(est.seq_len)}"
            f"{self._fitted_line(g)}"
            f"{_eviction_line(pol, g, est.seq_len)}"
            f"[dim]geometry: {g.num_layers} layers{sliding} × {g.kv_heads} KV heads × head_dim {g.head_dim}"
            f"{f' (V {g.v_dim})' if g.v_dim != g.head_dim else ''}; every byte "
            f"counted (norms, scales, fp16 sink/window rows, rotations and codebooks once)[/dim]"
        )
        self.show_export()

    def show_export(self) -> None:
        """The built policy as the chosen engine's closest KV setting (``deploy.map_policy``, what ``export``
        prints): its flags, the bits against the policy's, and what the setting cannot carry."""
        from rich.markup import escape

        from tqbench.engine.deploy import map_policy

        out = self.query_one("#export", Static)
        engine = self.query_one("#export-engine", Select).value
        if not self.current:
            out.update("")
            return
        try:
            s = map_policy(self.current, engine, self.geometry(), self.context())
        except ValueError as exc:
            out.update(f"[b red]no {engine} setting[/]: {escape(str(exc))}")
            return
        lines = [f"[b]{escape(s.lines[0])}[/b]", *(escape(x) for x in s.lines[1:] if not x.startswith("(")),
                 f"{s.mapped_bits:.2f} bits/element vs the policy's {s.original_bits:.2f}"]
        if s.unmapped:
            lines.append("[b yellow]could not map[/]: " + " · ".join(escape(u) for u in s.unmapped))
        lines += [f"[dim]{escape(n)}[/dim]" for n in s.notes]
        lines.append(f"[dim]measured next to the policy: tqbench --headless export "
                     f"\"{escape(self.current)}\" --to {engine}[/dim]")
        out.update("\n".join(lines))

    # ---- actions ---------------------------------------------------------------------------------
    def action_frontier(self) -> None:
        self.query_one(AllocatePanel).action_frontier()

    @on(Button.Pressed, "#use")
    def action_use(self) -> None:
        if not self.current:
            self.app.notify("the built policy is invalid: fix the fields shown in red", severity="error")
            return
        name = self.query_one("#policy-name", Input).value.strip()
        from tqbench.engine.policy import PRESET_TEXT, parse_policy

        unchanged = name in PRESET_TEXT and parse_policy(name).to_string() == self.current
        self.post_message(self.Chosen(name if unchanged else self.current))

    @on(Button.Pressed, "#keep")
    def action_keep(self) -> None:
        from tqbench.engine.policy import PRESET_TEXT

        name = self.query_one("#policy-name", Input).value.strip()
        if not self.current:
            self.app.notify("the built policy is invalid: fix the fields shown in red", severity="error")
            return
        if not name or name in PRESET_TEXT or "," in name or "=" in name:
            self.app.notify("give the policy a new name (not a preset's, no ',' or '=') in the name field",
                            severity="error")
            return
        self.keep_policy(name, self.current)
        self.app.notify(f"kept policy {name}: {self.current}")

    def keep_policy(self, name: str, text: str) -> None:
        """List ``name`` as a kept policy and keep it in the session (the app's ``policy_kept``)."""
        self.kept[name] = text
        self.reload_list()
        keep = getattr(self.app, "policy_kept", None)
        if keep is not None:
            keep(name, text)

    def set_kept(self, kept: dict[str, str]) -> None:
        self.kept = dict(kept)
        self.reload_list()


def _eviction_line(pol, geo, seq_len: int) -> str:
    """What the policy's eviction keeps at ``seq_len`` prompt tokens (``policy.keep.held_rows``, the estimate's
    rule), or nothing when it evicts nothing."""
    from tqbench.engine.policy.keep import head_keeps, held_rows

    plans = [p for p in pol.plan(geo.num_layers, list(geo.layer_types) if geo.layer_types else None) if p.evicts]
    if not pol.evicts:
        return ""
    if not plans:
        return "[b yellow]keep evicts nothing here[/]: no full-attention layer to evict from (sliding layers hold their window)\n"
    held = sorted({held_rows(seq_len, seq_len, k, p.sink, pol.window, p.recent, pol.every) for p in plans
                   for k in head_keeps(p.keep, geo.kv_heads, p.layer)})
    rows = f"{held[0]}" if len(held) == 1 else f"{held[0]}-{held[-1]}"
    return (f"eviction: {len(plans)} of {geo.num_layers} layers keep [b]{rows}[/b] of {seq_len} rows per KV head "
            f"(score {pol.score}, window {pol.window}" + (f", every {pol.every}" if pol.every else "") + ")\n")


def _fraction(text: str, key: str) -> float:
    """A fraction field's text (empty: the engine's default), or ValueError naming the key."""
    from tqbench.engine.policy.keep import ADA_FLOOR

    if not text:
        return ADA_FLOOR
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a number: give a fraction between 0 and 1") from None


def _demote(value) -> str:
    return "" if value == "drop" else str(value)


def _set_codec(select: Select, spec: str) -> None:
    """Show ``spec`` in a codec choice; a spec the list does not hold (a per-KV-head list such as
    ``turbo1|turbo2|turbo2``, an allocation's own codec) is added as a choice of its own, so the builder keeps the
    policy as it is instead of refusing it."""
    from tqbench.engine.codecs import CODEC_SPECS

    if spec not in {value for _, value in select._options}:
        select.set_options([(c, c) for c in CODEC_SPECS] + [(spec, spec)])
    select.value = spec
