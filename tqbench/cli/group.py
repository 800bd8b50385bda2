"""``tqbench``: the workbench (TUI), ``tqbench --headless <command>`` for scripts and CI.

Heavy imports (torch, transformers) happen inside commands so ``tqbench --help`` starts at once.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import click

from tqbench import __version__
from tqbench.cli.workbench import open_workbench

CACHE_MODES = ("dense-shadow", "simulate", "compressed", "fused")
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def friendly_errors(fn):
    """Bad input becomes a one-line error and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from tqbench.engine.models.load import ModelLoadError

        try:
            return fn(*args, **kwargs)
        except (ValueError, ModelLoadError, FileNotFoundError) as exc:
            fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    return wrapper


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if prompt and prompt_file:
        raise click.UsageError("give either --prompt or --prompt-file, not both")
    if prompt_file:
        if not os.path.isfile(prompt_file):
            raise click.BadParameter(f"prompt file {prompt_file!r} does not exist", param_hint="--prompt-file")
        with open(prompt_file, encoding="utf-8") as fh:
            return fh.read()
    return prompt if prompt is not None else DEFAULT_PROMPT


def model_options(fn):
    fn = click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")(fn)
    fn = click.option("--dtype", default="auto", show_default=True,
                      help="auto (fp32 on CPU, bf16/fp16 on GPU), float32, float16, bfloat16, float64.")(fn)
    fn = click.option("--device", default="auto", show_default=True, help="auto (cuda > mps > cpu), cpu, cuda, mps.")(fn)
    fn = click.option("--model", "model", default="default", show_default=True,
                      help="'default' (SmolLM2-135M-Instruct), 'tiny' (random test model), a hub id, a folder or a .gguf.")(fn)
    return fn


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--headless", is_flag=True, help="Run a command without the UI (for scripts and CI).")
@click.option("--model", "wb_model", default=None, help="Workbench model (default: the session's, else 'default').")
@click.option("--device", "wb_device", default="auto", help="Workbench device: auto, cpu, cuda, mps.")
@click.option("--dtype", "wb_dtype", default="auto", help="Workbench dtype.")
@click.option("--threads", "wb_threads", type=click.IntRange(min=1), default=None, help="Workbench CPU threads.")
@click.option("--kv-policy", "wb_policy", default=None, help="Workbench candidate policy (default turbo4).")
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


@main.command()
@model_options
@click.option("--kv-policy", default="turbo4", show_default=True, help="Preset name, compact policy or .json/.toml file.")
@click.option("--cache-mode", type=click.Choice(CACHE_MODES), default="compressed", show_default=True)
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", default=None, help="Read the prompt from a file.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--per-layer", is_flag=True, help="Print the per-layer byte table.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--save-session", "save_session", default=None, metavar="FILE",
              help="Also save the run as a workbench session (FILE.json + FILE.safetensors).")
@click.pass_context
@friendly_errors
def bench(ctx, model, device, dtype, threads, kv_policy, cache_mode, prompt, prompt_file, chat, max_new_tokens,
          temperature, top_p, seed, per_layer, as_json, save_session):
    """Generate under a KV policy; report speed and what the cache costs."""
    if not ctx.find_root().obj.get("headless"):  # the workbench's Run screen with these flags filled in
        ctx.find_root().obj["workbench"].update(model=model, device=device, dtype=dtype, threads=threads)
        return open_workbench(ctx, "run", dict(
            prompt=read_prompt(prompt, prompt_file), chat=chat, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, seed=seed, candidate=kv_policy, cache_mode=cache_mode))
    from tqbench.cli.render import tables as render
    from tqbench.engine.events import TokenGenerated
    from tqbench.engine.generate import GenerationFinished, Sampling
    from tqbench.engine.policy.spec import parse_policy

    if max_new_tokens < 1:
        raise click.BadParameter(f"{max_new_tokens} is invalid: ask for at least 1 token", param_hint="--max-new-tokens")
    policy = parse_policy(kv_policy)
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    text = read_prompt(prompt, prompt_file)
    engine = render.load_engine(model, device, dtype, threads, quiet=as_json)
    result = None
    live = render.TokenPrinter(enabled=not as_json)
    recorder = None
    if save_session:
        from tqbench.sessions.session import RunRecorder

        recorder = RunRecorder(text, chat, max_new_tokens, dict(temperature=temperature, top_p=top_p, seed=seed),
                               kind="bench")
    for ev in engine.stream(text, policy, cache_mode, max_new_tokens=max_new_tokens, chat=chat, sampling=sampling,
                            track_bytes=recorder is not None):
        if recorder is not None:
            recorder(ev)
        if isinstance(ev, TokenGenerated):
            live.token(ev.text_delta)
        elif isinstance(ev, GenerationFinished):
            result = ev.result
    live.close()
    payload = render.bench_payload(engine, result, policy)
    if recorder is not None:
        saved = save_headless_session(save_session, engine, model, [recorder.record])
        if not as_json:
            render.err.print(f"session saved to {saved}", soft_wrap=True, highlight=False)
    if as_json:
        click.echo(json.dumps(payload, indent=2))
    else:
        render.print_bench(payload, per_layer=per_layer)


def save_headless_session(path: str, engine, model_spec: str, runs: list, **results) -> str:
    """Write a session the workbench opens (``tqbench --session FILE``)."""
    from tqbench.sessions.session import Session, environment

    session = Session(model=Session.model_info(engine, model_spec), runs=runs,
                      environment=environment(str(engine.loaded.device)), **results)
    return str(session.save(path))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.option("--seq-len", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Context length the bits/element and saving are computed for.")
@friendly_errors
def policies(as_json, seq_len):
    """List every preset with its string form, bits per element and saving (default-model geometry)."""
    from tqbench.cli.render import tables as render

    rows = render.preset_rows(seq_len)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        render.print_presets(rows, seq_len)


from tqbench.cli.validate import add_validation_commands  # noqa: E402

add_validation_commands(main, model_options, friendly_errors)

from tqbench.cli.serve import serve  # noqa: E402  (its own module; registered here)

main.add_command(serve)

if __name__ == "__main__":  # pragma: no cover
    main()
