"""The two rich consoles (``out`` for tables and text, ``err`` for progress and notes) and the model load
spinner every model command shows."""

from __future__ import annotations

from rich.console import Console

err = Console(stderr=True)
out = Console()
if not out.is_terminal:  # pipes and files get full-width tables instead of 80 columns
    out = Console(width=160)


def load_engine(model: str, device: str, dtype: str, threads: int | None, quiet: bool = False):
    from tqbench.engine import Engine

    with err.status(f"loading {model} ...", spinner="dots") as status:
        engine = Engine.load(model, device=device, dtype=dtype, threads=threads,
                             on_progress=lambda m: status.update(m))
    info = engine.loaded
    if not quiet:
        err.print(
            f"[bold]{info.name}[/] on {info.device} ({str(info.dtype).replace('torch.', '')}), "
            f"{info.num_params / 1e6:.0f}M parameters, loaded in {info.load_seconds:.1f}s"
        )
    return engine


def warn_policies(engine, *policies) -> list[str]:
    """Print on stderr (so ``--json`` stdout stays clean) the engine's ``policy_warning`` of each policy: a saved
    policy fitted on another model. Returns the warnings printed."""
    from rich.markup import escape

    shown = []
    for pol in policies:
        warning = engine.policy_warning(pol) if pol is not None else None
        if warning and warning not in shown:
            err.print(f"[bold yellow]warning:[/] {escape(warning)}", soft_wrap=True, highlight=False)
            shown.append(warning)
    return shown


def check_policies(engine, *policies) -> list:
    """Each policy checked once against the engine's model (``Engine.check_policy``), its warning printed as
    ``warn_policies`` does; the ``CheckedPolicy`` objects, which the engine's jobs take without checking again.
    A refused policy has its warning printed before the refusal propagates."""
    checked = []
    for pol in policies:
        try:
            checked.append(engine.check_policy(pol))
        except ValueError:
            warn_policies(engine, pol)
            raise
    warn_policies(engine, *checked)
    return checked
