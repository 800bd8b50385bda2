"""What every command shares: option groups, prompt and list parsing, report writing, the one-line errors
and the gate. Torch-free: the commands import the engine inside their bodies.

Exit codes: 0 = done and the gate passed, 1 = a gate failed (named on stderr), 2 = bad input.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import click

from tqbench.cli.flags import spelled
from tqbench.constants import COMPARE_PROMPTS, DEFAULT_PROMPT


# ---- errors and gates ---------------------------------------------------------------------------------
def fail(message: str, code: int = 2) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def friendly_errors(fn):
    """Bad input becomes a one-line error and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not isinstance(exc, (ValueError, FileNotFoundError, *_model_load_errors())):
                raise
            text = spelled(exc)  # an engine field named as this command's flag
            fail(text.splitlines()[0] if text else type(exc).__name__)

    return wrapper


def _model_load_errors() -> tuple[type, ...]:
    """The engine's ``ModelLoadError`` when its module is loaded (else no exception can be one): looked up, not
    imported, so a command refused at the door never imports the model loader."""
    errors = sys.modules.get("tqbench.engine.models.errors")
    return (errors.ModelLoadError,) if errors is not None else ()


def gate(ok: bool, message: str) -> None:
    """Exit 1 with ``gate failed: message`` on stderr unless ``ok``."""
    if not ok:
        click.echo(f"gate failed: {message}", err=True)
        sys.exit(1)


# ---- option groups ------------------------------------------------------------------------------------
def model_options(fn):
    fn = click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")(fn)
    fn = click.option("--dtype", default="auto", show_default=True,
                      help="auto (fp32 on CPU, bf16/fp16 on GPU), float32, float16, bfloat16, float64.")(fn)
    fn = click.option("--device", default="auto", show_default=True, help="auto (cuda > mps > cpu), cpu, cuda, mps.")(fn)
    fn = click.option("--model", "model", default="default", show_default=True,
                      help="'default' (SmolLM2-135M-Instruct), 'tiny' (random test model), 'tiny-<family>' (a random gemma2, falcon, ... model), a hub id, a folder or a .gguf.")(fn)
    return fn


def prefill_chunk_option(fn):
    """``--prefill-chunk auto|0|N`` (the engine's ``prefill_chunk``: None, 0 or N; ``constants.auto_prefill_chunk``)."""
    from tqbench.constants import (
        PREFILL_CHUNK_ABOVE,
        PREFILL_CHUNK_AUTO,
        PREFILL_CHUNK_TOKENS,
        parse_prefill_chunk,
    )

    def convert(ctx, param, value):
        try:
            return parse_prefill_chunk(value)
        except ValueError as e:
            raise click.BadParameter(str(e).removeprefix(f"--prefill-chunk {value!r} is invalid: "),
                                     param_hint="--prefill-chunk") from None

    return click.option(
        "--prefill-chunk", default=PREFILL_CHUNK_AUTO, show_default=True, callback=convert,
        help=f"Prompt tokens per prefill forward call, appended into the compressed store as they go (0: the whole "
             f"prompt in one call over exact K/V). auto: {PREFILL_CHUNK_TOKENS} for prompts over "
             f"{PREFILL_CHUNK_ABOVE} tokens in compressed/fused mode, else one call.")(fn)


def report_options(fn):
    fn = click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")(fn)
    fn = click.option("--report-md", default=None, help="Write a Markdown report to this file.")(fn)
    fn = click.option("--report-json", default=None, help="Write the JSON report to this file.")(fn)
    return fn


# ---- prompts --------------------------------------------------------------------------------------------
def checked_prompt(text: str, flags: str = "--prompt or --prompt-file") -> str:
    """The engine's prompt rule (``request.check_prompt``) at the door, the message naming the CLI's flags."""
    from tqbench.engine.request import check_prompt

    try:
        return check_prompt(text)
    except ValueError as exc:
        raise ValueError(f"{exc} with {flags}") from None


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """``bench``'s prompt: click usage errors (``Error: ...`` with the usage line)."""
    if prompt and prompt_file:
        raise click.UsageError("give either --prompt or --prompt-file, not both")
    if prompt_file:
        if not os.path.isfile(prompt_file):
            raise click.BadParameter(f"prompt file {prompt_file!r} does not exist", param_hint="--prompt-file")
        with open(prompt_file, encoding="utf-8") as fh:
            return checked_prompt(fh.read())
    return checked_prompt(prompt if prompt is not None else DEFAULT_PROMPT)


def prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    """The validation suite's prompt: bad input is a ValueError (``friendly_errors`` makes it one line)."""
    if prompt is not None and prompt_file:
        raise ValueError("give either --prompt or --prompt-file, not both")
    if prompt_file:
        if not os.path.isfile(prompt_file):
            raise ValueError(f"prompt file {prompt_file!r} does not exist: check the path given to --prompt-file")
        with open(prompt_file, encoding="utf-8") as fh:
            return checked_prompt(fh.read())
    return checked_prompt(prompt if prompt is not None else DEFAULT_PROMPT)


def prompt_list(prompts: tuple[str, ...], prompt_files: tuple[str, ...]) -> list[str]:
    out = [checked_prompt(p) for p in prompts]
    for f in prompt_files:
        out.append(prompt_text(None, f))
    return out or list(COMPARE_PROMPTS)


# ---- teacher-forced and gates -------------------------------------------------------------------------
TF_FLAGS = {"context_tokens": "--tf-context", "eval_tokens": "--tf-tokens"}


def check_teacher_forced_flags(corpus: str | None, tf_context: int, tf_tokens: int) -> None:
    """``--corpus``, ``--tf-context``, ``--tf-tokens`` by the engine's rule (``check_teacher_forced_args``),
    before the model loads; a bad count is named by its flag."""
    from tqbench.engine.request import RequestError
    from tqbench.engine.validate import check_teacher_forced_args

    try:
        check_teacher_forced_args(corpus, tf_context, tf_tokens)
    except RequestError as exc:
        raise ValueError(exc.spelled(TF_FLAGS.get(exc.field, exc.field))) from None


def check_max_kl(max_kl: float | None) -> None:
    """A KL gate (``--max-kl``) is 0 or more: checked before any measuring."""
    if max_kl is not None and not max_kl >= 0:
        raise ValueError(f"--max-kl {max_kl:g} is invalid: a KL is 0 or more (e.g. 0.05)")


# ---- lists ----------------------------------------------------------------------------------------------
def csv(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [p.strip() for p in text.split(",") if p.strip()]


POLICIES_HELP = ("Repeat the option for several policies, or put ';' between them. Commas separate policies only "
                 "when no part is key=value (fp16,turbo4: preset, shipped or engine-setting names and files); "
                 "a value with key=value is ONE compact policy (k=turbo4,v=turbo3,sink=4,recent=16).")


def policy_option(*decls: str, **kwargs):
    """A click option (or, with ``argument=True``, an argument) that takes policies: the shared help (the grammar's
    eviction keys in kvpress's terms: ``keep.EVICTION_HELP``) and the grammar checked as the command line is read,
    before any command imports torch (``checked_policies``): a bad policy is a one-line error in well under a
    second."""
    if kwargs.pop("argument", False):
        return click.argument(*decls, callback=checked_policies, **kwargs)
    from tqbench.engine.policy.keep import EVICTION_HELP

    kwargs["help"] = f"{kwargs.get('help', '')} {EVICTION_HELP}".strip()
    return click.option(*decls, callback=checked_policies, **kwargs)


def checked_policies(ctx, param, value):
    """Every policy of ``value`` parsed by the engine's torch-free door (``parse_policy``: grammar, presets, files);
    the first bad one ends the command with its one-line error and exit code 2. ``value`` comes back unchanged."""
    if value is None or value == ():
        return value
    from tqbench.engine.policy import parse_policy

    try:
        for name in policy_list(value):
            parse_policy(name)
    except ValueError as exc:
        fail(str(exc).splitlines()[0])
    return value


def policy_list(values: str | tuple[str, ...] | list[str]) -> list[str]:
    """The policies of a (repeatable) policy option: each value split by the engine's one rule
    (``split_policies``: ';' always, ',' only between names; a compact policy is never cut at its commas)."""
    from tqbench.engine import split_policies

    if isinstance(values, str):
        values = (values,)
    names = [name for value in values for name in split_policies(value)]
    if not names:
        raise ValueError("no policy given: name a preset (see `tqbench --headless policies`) or k=...,v=...")
    return names


def ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in csv(text) or []]
    except ValueError:
        raise ValueError(f"{flag} {text!r} is invalid: give whole numbers like 256,512") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{flag} {text!r} is invalid: give whole numbers >= 1 like 256,512")
    return vals


def floats(text: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in csv(text) or []]
    except ValueError:
        raise ValueError(f"{flag} {text!r} is invalid: give fractions like 0.1,0.5,0.9") from None
    if not vals or any(not 0 <= v <= 1 for v in vals):
        raise ValueError(f"{flag} {text!r} is invalid: give fractions between 0 and 1 like 0.1,0.5,0.9")
    return vals


# ---- reports ----------------------------------------------------------------------------------------------
def check_out_path(path: str | None, flag: str, suffix: str | None = None, folder: bool = False) -> None:
    """Every output path a command takes (``--report-json``, ``--report-md``, ``--save-session``, ``--out`` ...)
    is checked before any work by this one rule: the engine's ``atomic.check_output_path`` (the folder exists and
    takes a file, the path is not a folder; a folder output is not a file). A ValueError names ``flag``."""
    if path:
        from tqbench.engine.atomic import check_output_path

        check_output_path(path, suffix, flag, folder=folder)


def check_out_paths(report_json: str | None, report_md: str | None) -> None:
    """``--report-json`` and ``--report-md`` (``check_out_path``)."""
    check_out_path(report_json, "--report-json")
    check_out_path(report_md, "--report-md")


def write_reports(payload: dict, md: str | None, report_json: str | None, report_md: str | None,
                  as_json: bool) -> None:
    """``--report-json`` / ``--report-md`` (written atomically: ``engine.atomic``) and ``--json`` on stdout."""
    from tqbench.engine.atomic import atomic_write

    if report_json:
        atomic_write(report_json, json.dumps(payload, indent=2).encode("utf-8"))
    if report_md and md is not None:
        atomic_write(report_md, md.encode("utf-8"))
    if as_json:
        click.echo(json.dumps(payload, indent=2))


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
