"""``bench`` (generate under a policy; speed and what the cache costs) and ``policies`` (the preset list).

Heavy imports happen inside the commands so ``tqbench --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import json

import click

from tqbench.cli.options import (
    friendly_errors,
    model_options,
    policy_option,
    prefill_chunk_option,
    read_prompt,
    torch_threads,
)
from tqbench.cli.workbench import check_session_path, open_workbench
from tqbench.constants import (
    CACHE_MODE_HELP,
    CACHE_MODES,
    DEFAULT_CACHE_MODE,
    DENSE_BASELINES,
    KERNEL_BASELINES,
)


@click.command()
@model_options
@policy_option("--kv-policy", default=None,
               help="Preset name, compact policy or .json/.toml file. Default: the model's (turbo4; on a model mixing "
                    "sliding-window and global layers, the hybrid default: tqbench.engine.policy.default).")
@click.option("--cache-mode", type=click.Choice(CACHE_MODES), default=DEFAULT_CACHE_MODE, show_default=True,
              help=CACHE_MODE_HELP)
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", default=None, help="Read the prompt from a file.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Tokens to generate at most.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling (with --temperature > 0).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@prefill_chunk_option
@click.option("--baseline", type=click.Choice(list(DENSE_BASELINES)), default=None,
              help="Also generate the same tokens with this dense cache and report the policy's decode speed "
                   "against it: dense (K/V in the model's dtype, float32 on CPU), dense-fp16 or dense-bf16 (K/V rows "
                   "stored in 16 bits, upcast for attention), dense-fp16-kernel or dense-bf16-kernel (the same rows "
                   "read as stored by the native CPU kernel, as engines read an f16 cache).")
@click.option("--per-layer", is_flag=True, help="Print the per-layer byte table.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--save-session", "save_session", default=None, metavar="FILE",
              help="Also save the run as a workbench session (FILE.json + FILE.safetensors).")
@click.pass_context
@friendly_errors
def bench(ctx, model, device, dtype, threads, kv_policy, cache_mode, prompt, prompt_file, chat, max_new_tokens,
          temperature, top_p, seed, prefill_chunk, baseline, per_layer, as_json, save_session):
    """Generate under a KV policy; report speed and what the cache costs."""
    if not ctx.find_root().obj.get("headless"):  # the workbench's Run screen with these flags filled in
        ctx.find_root().obj["workbench"].update(model=model, device=device, dtype=dtype, threads=threads)
        return open_workbench(ctx, "run", dict(
            prompt=read_prompt(prompt, prompt_file), chat=chat, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, seed=seed, candidate=kv_policy, cache_mode=cache_mode))
    from tqbench.cli.render.console import err, load_engine, warn_policies
    from tqbench.cli.render.tables import BaselineRun, BenchRun, print_bench
    from tqbench.engine import GenerationRequest, parse_policy

    request = GenerationRequest(max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    policy = parse_policy(kv_policy) if kv_policy is not None else None
    text = read_prompt(prompt, prompt_file)
    check_session_path(save_session)
    engine = load_engine(model, device, dtype, threads, quiet=as_json)
    if policy is None:  # the model's default: turbo4, or the measured hybrid default (engine.policy.default)
        from tqbench.engine.policy import default_policy

        policy = default_policy(engine.geometry.layer_types)
    if baseline in KERNEL_BASELINES:  # refused before the policy's run, with the reason
        from tqbench.engine.cache.dense_kernel import check_kernel_baseline

        try:
            check_kernel_baseline(baseline, engine.loaded.device)
        except RuntimeError as exc:
            raise click.BadParameter(str(exc), param_hint="--baseline") from None
    warn_policies(engine, policy)
    recorder = None
    if save_session:
        from tqbench.sessions import RunRecorder

        recorder = RunRecorder(text, chat, max_new_tokens, dict(temperature=temperature, top_p=top_p, seed=seed),
                               kind="bench")
    result = _generate(engine, text, policy, cache_mode, max_new_tokens, chat, request.sampling, recorder,
                       not as_json, prefill_chunk)
    run = BenchRun.of(engine, result, policy, torch_threads())
    if baseline:
        if result.output_tokens < 2:
            raise click.UsageError("--baseline compares decode speed: the policy's run produced fewer than 2 tokens; "
                                   "raise --max-new-tokens")
        # the same prompt and number of tokens (the policy's run may have stopped at EOS), same sampling
        base = engine.generate(text, baseline, max_new_tokens=result.output_tokens, chat=chat,
                               sampling=request.sampling, stop_at_eos=False, prefill_chunk=prefill_chunk)
        run = dataclasses.replace(run, baseline=BaselineRun(baseline, engine.baseline_kv_dtype(baseline),
                                                            base.decode_tokens_per_second))
    if recorder is not None:
        saved = save_headless_session(save_session, engine, model, [recorder.record])
        if not as_json:
            err.print(f"session saved to {saved}", soft_wrap=True, highlight=False)
    if as_json:
        click.echo(json.dumps(run.to_dict(), indent=2))
    else:
        print_bench(run, per_layer=per_layer)


def _generate(engine, text, policy, cache_mode, max_new_tokens, chat, sampling, recorder, live_text: bool,
              prefill_chunk: int | None = None):
    """Stream one generation (text to stdout when ``live_text``); the engine's ``GenerationResult``."""
    from tqbench.cli.render.progress import TokenPrinter
    from tqbench.engine.events import GenerationFinished, TokenGenerated

    result = None
    live = TokenPrinter(enabled=live_text)
    for ev in engine.stream(text, policy, cache_mode, max_new_tokens=max_new_tokens, chat=chat, sampling=sampling,
                            track_bytes=recorder is not None, prefill_chunk=prefill_chunk):
        if recorder is not None:
            recorder(ev)
        if isinstance(ev, TokenGenerated):
            live.token(ev.text_delta)
        elif isinstance(ev, GenerationFinished):
            result = ev.result
    live.close()
    return result


def save_headless_session(path: str, engine, model_spec: str, runs: list, **results) -> str:
    """Write a session the workbench opens (``tqbench --session FILE``); returns its path, and the backup kept
    of the session it replaced (``sessions.store.keep_backup``)."""
    from tqbench.sessions import Session, environment

    session = Session(model=Session.model_info(engine, model_spec), runs=runs,
                      environment=environment(str(engine.loaded.device)), **results)
    saved = str(session.save(path))
    return saved + (f" (the previous version kept as {session.backup})" if session.backup else "")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.option("--seq-len", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Context length the bits/element and saving are computed for.")
@friendly_errors
def policies(as_json, seq_len):
    """List every preset with its string form, bits per element and saving (default-model geometry)."""
    from tqbench.cli.render.tables import preset_rows, print_presets

    rows = preset_rows(seq_len)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        print_presets(rows, seq_len)
