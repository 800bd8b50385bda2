"""``tqbench``: the workbench (TUI), ``tqbench --headless <command>`` for scripts and CI.

The click group lives here and every command family is registered on it from its own module: ``bench``
(bench, policies), ``validate``, ``compare`` (compare-policies, niah), ``scan``, ``estimate`` (kv-estimate),
``export`` (a policy as an engine's KV setting), ``tasks`` (the long-context task suite) and ``serve``. Heavy imports (torch, transformers) happen inside commands so ``tqbench --help`` starts at once.
"""

from __future__ import annotations

import click

from tqbench import __version__
from tqbench.cli.allocate import allocate
from tqbench.cli.bench import bench, policies
from tqbench.cli.calibrate import calibrate
from tqbench.cli.compare import compare_policies, niah
from tqbench.cli.estimate import kv_estimate
from tqbench.cli.export import export
from tqbench.cli.llamacpp import llamacpp
from tqbench.cli.options import policy_option
from tqbench.cli.scan import scan
from tqbench.cli.serve import serve
from tqbench.cli.sweep import sweep
from tqbench.cli.tasks import tasks
from tqbench.cli.validate import validate
from tqbench.cli.workbench import open_workbench


class HeadlessContext(click.Context):
    """A context whose command path names ``--headless`` when the group was given it, so a subcommand's usage
    line (in ``--help`` and in usage errors) is a command that runs: ``tqbench --headless bench [OPTIONS]``."""

    @property
    def command_path(self) -> str:
        path = super().command_path
        root = self.find_root()
        if self is root or not (root.obj or {}).get("headless") or not root.info_name:
            return path
        return path.replace(root.info_name, f"{root.info_name} --headless", 1)


class OneLineUsageError(click.UsageError):
    """click's usage error as tqbench says every bad input: one line on stderr, exit 2."""

    def show(self, file=None) -> None:
        message = " ".join(self.format_message().split()).rstrip(".")
        message = message[:1].lower() + message[1:]
        where = ""
        if self.ctx is not None:
            where = f" (usage: {self.ctx.command_path} {' '.join(self.ctx.command.collect_usage_pieces(self.ctx))}; " \
                    f"{self.ctx.command_path} --help lists the options)"
        click.echo(f"error: {message}{where}", err=True, file=file)


class Group(click.Group):
    """The ``tqbench`` group: its subcommands' contexts are ``HeadlessContext`` and their usage errors
    ``OneLineUsageError``."""

    context_class = HeadlessContext

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        from tqbench.cli.examples import epilog

        cmd.context_class = HeadlessContext
        cmd.epilog = cmd.epilog or epilog(name or cmd.name)
        super().add_command(cmd, name)

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise _one_line(exc) from None


def _one_line(exc: click.UsageError) -> OneLineUsageError:
    if isinstance(exc, OneLineUsageError):
        return exc
    new = OneLineUsageError(exc.format_message(), exc.ctx)
    new.exit_code = exc.exit_code
    return new


@click.group(cls=Group, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--headless", is_flag=True, help="Run a command without the UI (for scripts and CI).")
@click.option("--model", "wb_model", default=None, help="Workbench model (default: the session's, else 'default').")
@click.option("--device", "wb_device", default="auto", help="Workbench device: auto, cpu, cuda, mps.")
@click.option("--dtype", "wb_dtype", default="auto", help="Workbench dtype.")
@click.option("--threads", "wb_threads", type=click.IntRange(min=1), default=None, help="Workbench CPU threads.")
@policy_option("--kv-policy", "wb_policy", default=None, help="Workbench candidate policy (default turbo4).")
@click.option("--session", "wb_session", default=None, help="Open this saved session (.json) in the workbench.")
@click.option("--session-dir", "wb_session_dir", default=None,
              help="Where sessions are saved and listed (default $TQBENCH_DATA_DIR/sessions or the user data dir).")
@click.version_option(__version__, "--version", prog_name="tqbench")
@click.pass_context
def main(ctx: click.Context, headless: bool, wb_model, wb_device, wb_dtype, wb_threads, wb_policy, wb_session,
         wb_session_dir) -> None:
    """tqbench: how far can you compress a model's KV cache without changing what it says?

    With no command, opens the workbench (a terminal UI); `tqbench --headless <command>` runs without it.
    """
    ctx.ensure_object(dict)
    ctx.obj["headless"] = headless
    ctx.obj["workbench"] = dict(model=wb_model, device=wb_device, dtype=wb_dtype, threads=wb_threads,
                                session=wb_session, session_dir=wb_session_dir, policy=wb_policy)
    if ctx.invoked_subcommand is None:
        if headless:
            click.echo(ctx.get_help())
            return
        open_workbench(ctx)


for command in (bench, policies, validate, compare_policies, niah, scan, kv_estimate, serve, allocate, sweep, export,
                tasks):
    main.add_command(command)
main.add_command(calibrate)  # calibrated key transforms (pcaq codecs)
main.add_command(llamacpp)  # llama.cpp's CPU tools, built from source (export --verify, benchmarks/engines.py)

if __name__ == "__main__":  # pragma: no cover
    main()
