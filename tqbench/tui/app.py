"""The workbench app: header with the model, tabs (Run, Policies), sessions, help and the command palette."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.widgets import Footer, TabbedContent, TabPane

from tqbench.sessions import Session, SessionError, diff_runs, load_kept_policies, save_kept_policies
from tqbench.tui import session_flow, sweep_run
from tqbench.tui.panes.compare import ComparePane
from tqbench.tui.panes.policies import PoliciesPane
from tqbench.tui.panes.run import RunPane, RunParams
from tqbench.tui.panes.scan import ScanPane
from tqbench.tui.widgets.model_bar import ModelBar

TABS = ("run", "policies", "scan", "compare")
#: the widget that takes focus when a tab is shown (focus left behind in a hidden tab would pull it back)
TAB_FOCUS = {"run": "#run-button", "policies": "#policy-list", "scan": "#scan-prompt", "compare": "#cmp-policies"}


@dataclass
class WorkbenchOptions:
    """What ``tqbench [flags]`` (or a subcommand without --headless) asked for."""

    model: str | None = None  # None: the session's model, else "default"
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    session: str | None = None
    session_dir: str | None = None
    screen: str = "run"
    run: RunParams | None = None
    scan: dict = field(default_factory=dict)  # ScanPane fields (prompt, layers, codecs, max_prompt_tokens)
    compare: dict = field(default_factory=dict)  # ComparePane fields (policies, baseline, prompts, ...)


class WorkbenchApp(App):
    TITLE = "tqbench"
    CSS_PATH = "tqbench.tcss"
    AUTO_FOCUS = None  # on_mount focuses the first tab's widget: a late auto-focus would pull a fast key back
    #: the app's keys work from every widget: priority bindings come before a focused Input's or TextArea's own
    #: (ctrl+e would move to the end of the line). Escape stays a plain binding: an open Select list, the command
    #: palette and the modal screens close on it first.
    BINDINGS = [
        Binding("ctrl+r", "run", "Run", tooltip="Start this tab's work: generate (Run, Policies), scan (Scan), compare "
                "(Compare)", id="app.run", priority=True),
        Binding("escape", "cancel", "Cancel", tooltip="Stop the running generation, scan or comparison",
                id="app.cancel"),
        Binding("f1", "help", "Help", tooltip="Every key binding (f1 again closes it)", id="app.help",
                priority=True),
        Binding("ctrl+s", "save_session", "Save", tooltip="Save the session (JSON + safetensors)", id="app.save",
                priority=True),
        Binding("ctrl+o", "open_session", "Open", tooltip="Open a saved session from a list", id="app.open",
                priority=True),
        Binding("ctrl+e", "rerun", "Re-run+diff", tooltip="Re-run the shown run and diff it against the saved one",
                id="app.rerun", priority=True),
        Binding("f2", "tab('run')", "Run tab", tooltip="Side-by-side generation", id="app.tab_run", priority=True),
        Binding("f3", "tab('policies')", "Policies tab", tooltip="Presets and the policy builder",
                id="app.tab_policies", priority=True),
        Binding("f4", "tab('scan')", "Scan tab", tooltip="Per layer x KV head codec errors and norms",
                id="app.tab_scan", priority=True),
        Binding("f5", "tab('compare')", "Compare tab", tooltip="Several policies vs the baseline, sortable",
                id="app.tab_compare", priority=True),
        Binding("f8", "kept", "Kept tokens", tooltip="(Run) which prompt tokens each KV head kept after a run of a "
                "policy that evicts (keep=); f8 again shows the graph", id="app.kept", priority=True, show=False),
        Binding("ctrl+q", "quit", "Quit", tooltip="Leave the workbench", id="app.quit", priority=True),
    ]
    #: actions of the main screen that wait while a dialog (help, the session list, the palette) is open: their
    #: priority keys then reach the dialog instead
    MAIN_SCREEN_ACTIONS = frozenset({"run", "save_session", "open_session", "rerun"})

    def __init__(self, options: WorkbenchOptions | None = None, engine=None) -> None:
        super().__init__()
        self.options = options or WorkbenchOptions()
        self.engine = engine
        self.model_spec = self.options.model or "default"
        self.session = None
        self.session_path: Path | None = None
        self.saved_record = None  # the RunRecord shown from a session (for re-run and diff)
        self.pending_session: str | None = self.options.session  # opened on mount, or once the model loaded

    # ---- layout ----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield ModelBar(id="model-bar")
        with WorkbenchTabs(initial=self.options.screen if self.options.screen in TABS else "run", id="tabs"):
            with TabPane("Run", id="run"):
                yield RunPane(self.options.run, id="run-pane")
            with TabPane("Policies", id="policies"):
                yield PoliciesPane(id="policies-pane")
            with TabPane("Scan", id="scan"):
                yield ScanPane(self.options.scan, id="scan-pane")
            with TabPane("Compare", id="compare"):
                yield ComparePane(self.options.compare, id="compare-pane")
        yield Footer()

    def on_mount(self) -> None:
        self.show_tab(self.query_one(TabbedContent).active)
        self.session = Session()
        try:
            self.policies_pane.set_kept(load_kept_policies())
        except SessionError as exc:
            self.notify(str(exc), title="kept policies not loaded", severity="warning", timeout=10)
        if self.pending_session and self.options.model is None:  # open on the session's model
            if not session_flow.use_session_model(self, self.pending_session):
                self.pending_session = None
        if self.engine is not None:
            self._engine_ready(self.engine)  # opens the pending session
            return
        if self.pending_session:  # a version-2 session shows now; an older one waits for the tokenizer
            path, self.pending_session = self.pending_session, None
            self.open_session(path)
        self.load_model()

    @property
    def run_pane(self) -> RunPane:
        return self.query_one("#run-pane", RunPane)

    @property
    def policies_pane(self) -> PoliciesPane:
        return self.query_one("#policies-pane", PoliciesPane)

    @property
    def scan_pane(self) -> ScanPane:
        return self.query_one("#scan-pane", ScanPane)

    @property
    def compare_pane(self) -> ComparePane:
        return self.query_one("#compare-pane", ComparePane)

    @property
    def busy(self) -> bool:
        return self.run_pane.running or self.scan_pane.running or self.compare_pane.running

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.MAIN_SCREEN_ACTIONS and len(self.screen_stack) > 1:
            return False
        return True

    def key_for(self, binding_id: str) -> str:
        """The key of a binding by its id, as help shows it (the palette's hints come from the same bindings)."""
        from tqbench.tui.screens.help import binding_by_id

        return self.get_key_display(binding_by_id(self, binding_id))

    # ---- model ------------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def load_model(self) -> None:
        from tqbench.engine.engine import Engine

        bar = self.query_one(ModelBar)
        self.call_from_thread(bar.loading, f"{self.model_spec} ...")
        try:
            engine = Engine.load(self.model_spec, device=self.options.device, dtype=self.options.dtype,
                                 threads=self.options.threads,
                                 on_progress=lambda m: self.call_from_thread(bar.loading, m))
        except Exception as exc:  # shown in the header; the app keeps running
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.call_from_thread(bar.failed, msg)
            self.call_from_thread(self.notify, msg, title="model failed to load", severity="error", timeout=15)
            return
        self.call_from_thread(self._engine_ready, engine)

    def _engine_ready(self, engine) -> None:
        self.engine = engine
        self.query_one(ModelBar).loaded(engine)
        self.run_pane.engine_ready(engine.loaded.device.type)
        if self.session_path is None:  # a new session is made with this model
            self.session.model = Session.model_info(engine, self.model_spec)
        else:  # a session opened before the model had loaded
            session_flow.warn_if_other_model(self)
        self.policies_pane.reload_list()
        self.policies_pane.recompute()
        if self.pending_session:
            path, self.pending_session = self.pending_session, None
            self.open_session(path)

    # ---- sessions ---------------------------------------------------------------------------------
    @on(RunPane.Finished)
    def _run_finished(self, msg: RunPane.Finished) -> None:
        if msg.error or not msg.record.candidate.token_ids:
            return
        self.session.runs.append(msg.record)

    @on(ScanPane.Finished)
    def _scan_finished(self, msg: ScanPane.Finished) -> None:
        if msg.result is not None:
            self.session.scans.append(msg.result)

    @on(ComparePane.Finished)
    def _compare_finished(self, msg: ComparePane.Finished) -> None:
        if msg.result is not None:
            self.session.compares.append(msg.result)

    def policy_kept(self, name: str, text: str) -> None:
        """Kept in the session and in the data dir (``policies.json``), so every later session lists it."""
        self.session.policies[name] = text
        try:
            save_kept_policies(load_kept_policies() | {name: text})
        except (OSError, SessionError) as exc:
            self.notify(f"kept in this session only: {exc}", severity="warning")

    def action_save_session(self) -> None:
        session_flow.save(self)

    def action_save_session_as(self) -> None:
        session_flow.save_as(self)

    def action_open_session(self) -> None:
        from tqbench.tui.screens.sessions import OpenSessionScreen

        def chosen(path) -> None:
            if path is not None:
                self.open_session(path)

        self.push_screen(OpenSessionScreen(self.options.session_dir), chosen)

    def open_session(self, path) -> bool:
        """Load a session and show its last run; errors are shown and the app keeps running."""
        return session_flow.open_session(self, path)

    def action_rerun(self) -> None:
        saved = self.saved_record or self.run_pane.record
        if saved is None:
            self.notify("nothing to re-run: open a session (ctrl+o) or run a prompt first", severity="warning")
            return
        self.run_pane.fill(saved.params())

        def done(record) -> None:
            d = diff_runs(saved, record)
            colour = "green" if d.identical else "red"
            self.run_pane.set_diff_note(f"[b {colour}]re-run vs saved: {d.describe()}[/]")
            self.notify(d.describe(), title="re-run identical" if d.identical else "re-run differs",
                        severity="information" if d.identical else "warning", timeout=10)

        self.show_run()
        self.run_pane.action_run(on_finish=done)

    async def action_quit(self) -> None:
        """Stop running work first: thread workers check the cancel flag every step, so exit is prompt."""
        for pane in (self.run_pane, self.scan_pane, self.compare_pane):
            pane.action_cancel()
        self.exit()

    # ---- tabs, help, palette ---------------------------------------------------------------------
    def show_run(self) -> None:
        self.show_tab("run")

    def show_tab(self, tab: str) -> None:
        """Activate ``tab`` and move focus into it, whichever tab (and widget) had focus before.

        Focus must move with the tab: a focused widget left in the now hidden pane hands focus to its
        scrollable neighbour, and ``TabbedContent`` switches back to the pane that holds the focus.
        """
        if tab not in TABS:
            raise ValueError(f"unknown tab {tab!r}: one of {', '.join(TABS)}")
        while len(self.screen_stack) > 1:  # a tab key pressed over help or the session list closes it
            self.pop_screen()
        self.query_one(TabbedContent).active = tab
        self.screen.set_focus(self.query_one(f"#{tab} {TAB_FOCUS[tab]}"))

    def action_tab(self, tab: str) -> None:
        self.show_tab(tab)

    def action_kept(self) -> None:
        """The Run tab's map of which tokens each KV head kept, in the graph's place; on Run, again: the graph.
        (f8, not f6: f6 and f7 select in the prompt box.)"""
        toggle = self.query_one(TabbedContent).active == "run" and len(self.screen_stack) == 1
        self.show_run()
        if not self.run_pane.show_kept(None if toggle else True):
            self.notify("no kept-token map yet: run a candidate policy that evicts tokens (e.g. turbo4,keep=0.5; "
                        "the Policies builder's keep field)", severity="warning", timeout=6)

    def action_help(self) -> None:
        """f1 opens the key list, and closes it again (the binding has priority over the help screen's)."""
        from tqbench.tui.screens.help import HelpScreen

        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss()
        else:
            self.push_screen(HelpScreen())

    def action_run(self) -> None:
        """ctrl+r: the active tab's work (Policies: use the built policy in Run and generate)."""
        active = self.query_one(TabbedContent).active
        if active == "scan":
            self.scan_pane.action_scan()
        elif active == "compare":
            self.compare_pane.action_compare()
        else:
            self.show_run()
            self.run_pane.action_run()

    def action_cancel(self) -> None:
        stopped = [p.action_cancel() for p in (self.run_pane, self.scan_pane, self.compare_pane)]
        if not any(stopped):
            self.notify("nothing is running", severity="information", timeout=2)

    @on(ScanPane.UsePolicy)
    def _use_scanned(self, msg: ScanPane.UsePolicy) -> None:
        """The "Run suggested policy" button: the scan's policy becomes Run's candidate and runs beside the baseline."""
        self.run_pane.set_candidate(msg.policy)
        self.show_run()
        self.notify(f"running the scan's suggested policy: {msg.policy}", timeout=4)
        self.run_pane.action_run()

    @on(ComparePane.OpenInRun)
    def _open_compared(self, msg: ComparePane.OpenInRun) -> None:
        pane = self.run_pane
        params = pane.params_or_defaults()
        pane.fill(params | {"prompt": msg.prompt or params["prompt"], "candidate": msg.policy,
                            "max_new_tokens": msg.max_new_tokens, "candidate_mode": msg.cache_mode})
        if not pane.running:
            pane.clear_shown()
        self.show_run()
        self.notify(f"opened {msg.policy} in Run: {self.key_for('app.run')} generates it beside the baseline",
                    timeout=4)

    @on(TabbedContent.TabActivated)
    def _tab_shown(self, event: TabbedContent.TabActivated) -> None:
        """A tab clicked with the mouse: focus its first widget, as the keys do."""
        if event.pane.id != self.query_one(TabbedContent).active:
            return  # a late message about a tab already left
        focused, pane = self.focused, self.query_one(f"#{event.pane.id}")
        if focused is None or pane not in focused.ancestors:
            self.screen.set_focus(pane.query_one(TAB_FOCUS[event.pane.id]))

    @on(PoliciesPane.Chosen)
    def _policy_chosen(self, msg: PoliciesPane.Chosen) -> None:
        self.run_pane.set_candidate(msg.policy)
        self.show_run()
        self.notify(f"candidate policy: {msg.policy} · {self.key_for('app.run')} runs it", timeout=3)

    def action_tasks(self) -> None:
        """The long-context task suite on Run's candidate (``screens.tasks.TasksScreen``)."""
        from textual.widgets import Input

        from tqbench.tui.screens.tasks import TasksScreen

        candidate = self.run_pane.query_one("#candidate", Input).value.strip() or "turbo4"
        self.push_screen(TasksScreen(candidate))

    def get_system_commands(self, screen):
        """Every action by name; the keys in the descriptions are read from the bindings."""
        yield from super().get_system_commands(screen)
        k = self.key_for
        yield SystemCommand("Run", f"Generate baseline and candidate side by side ({k('app.run')})", self.action_run)
        yield SystemCommand("Cancel run", f"Stop the running generation ({k('app.cancel')})", self.action_cancel)
        yield SystemCommand("Save session", f"Save everything to the data dir ({k('app.save')})",
                            self.action_save_session)
        yield SystemCommand("Save session as", "Save to a file name you give", self.action_save_session_as)
        yield SystemCommand("Open session", f"Open a saved session from a list ({k('app.open')})",
                            self.action_open_session)
        yield SystemCommand("Re-run and diff", "Re-run the shown run and compare with the saved tokens "
                            f"({k('app.rerun')})", self.action_rerun)
        yield SystemCommand("Run tab", f"Side-by-side generation ({k('app.tab_run')})", lambda: self.action_tab("run"))
        yield SystemCommand("Policies tab", f"Presets and the builder ({k('app.tab_policies')})",
                            lambda: self.action_tab("policies"))
        yield SystemCommand("Scan tab", f"Per layer x KV head errors and norms ({k('app.tab_scan')})",
                            lambda: self.action_tab("scan"))
        yield SystemCommand("Compare tab", f"Several policies vs the baseline ({k('app.tab_compare')})",
                            lambda: self.action_tab("compare"))
        yield SystemCommand("Kept tokens", f"Which tokens each KV head kept in the last run ({k('app.kept')})",
                            self.action_kept)
        yield SystemCommand("Start scan", "Scan the prompt's K/V with every codec", self.scan_pane.action_scan)
        yield SystemCommand("Run suggested policy", "Run the scan's suggested policy as the candidate in Run",
                            self.scan_pane.action_use_suggested)
        yield SystemCommand("Start comparison", "Compare the listed policies on the prompts",
                            self.compare_pane.action_compare)
        yield SystemCommand("Run sweep", "Run a sweep spec; its cells stream into Compare", lambda: sweep_run.ask(self))
        yield SystemCommand("Task suite", "Long-context tasks (needles, variable tracking, common words, QA): "
                            "baseline vs the candidate", self.action_tasks)
        yield SystemCommand("Use built policy", f"Put the built policy into Run's candidate ({k('policies.use')})",
                            self.policies_pane.action_use)
        yield SystemCommand("Keep built policy", f"Name and keep the built policy ({k('policies.keep')})",
                            self.policies_pane.action_keep)
        yield SystemCommand("Help", f"Every key binding ({k('app.help')})", self.action_help)


class WorkbenchTabs(TabbedContent):
    """The tabs, following focus only to where focus still is.

    ``TabbedContent`` shows the pane of every widget that received focus, in the order the focus events
    arrive; a focus event that is already stale (focus has moved on to another tab since) would pull the
    user back to the tab they left.
    """

    def _on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        event.prevent_default()  # Textual would also call TabbedContent's handler
        event.stop()
        focused = self.screen.focused
        if event.tab_pane.id is not None and focused is not None and event.tab_pane in focused.ancestors:
            self.active = event.tab_pane.id


def run_workbench(options: WorkbenchOptions) -> None:
    WorkbenchApp(options).run()
