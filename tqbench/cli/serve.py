"""``tqbench serve``: the OpenAI-compatible server (registered on the main group in ``tqbench.cli``).

Heavy imports (torch, fastapi, uvicorn) happen inside the command so ``tqbench --help`` stays fast.
"""

from __future__ import annotations

import click

from tqbench.cli.flags import spelled
from tqbench.cli.options import fail, policy_option
from tqbench.constants import CACHE_MODE_RESIDENT, CACHE_MODES, DEFAULT_KV_SHARE
from tqbench.engine.policy.default import DEFAULT_POLICY, HYBRID_DEFAULT_POLICY

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.command()
@click.option("--model", "model", default="default", show_default=True,
              help="'default' (SmolLM2-135M-Instruct), 'tiny' (random test model), 'tiny-<family>' (a random gemma2, falcon, ... model), a hub id, a folder or a .gguf.")
@click.option("--device", default="auto", show_default=True, help="auto (cuda > mps > cpu), cpu, cuda, mps.")
@click.option("--dtype", default="auto", show_default=True,
              help="auto (fp32 on CPU, bf16/fp16 on GPU), float32, float16, bfloat16, float64.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads for torch.")
@policy_option("--kv-policy", default=None,
              help="Default KV policy (preset or compact form); requests may override it with \"kv_policy\". "
                   f"Default: the model's ({DEFAULT_POLICY}; on a model mixing sliding-window and global layers, "
                   f"{HYBRID_DEFAULT_POLICY}).")
@click.option("--cache-mode", type=click.Choice(("auto", *CACHE_MODES)), default="auto", show_default=True,
              help="What stays resident during decode: " + "; ".join(f"{m}: {CACHE_MODE_RESIDENT[m]}" for m in CACHE_MODES)
              + ". auto: fused where its kernel runs (native C++ on CPU, Triton on CUDA), else compressed; the "
              "start-up line and /health say which and why. Requests may override it with \"cache_mode\".")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback by default).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True,
              help="TCP port (0: any free port).")
@click.option("--max-new-tokens", type=int, default=256, show_default=True,
              help="Cap on max_tokens per request (also the default when a request sends none).")
@click.option("--max-queue", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests allowed to wait behind the running one; more get 429 with Retry-After.")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Most requests decoding together (one forward per step) when they share policy and cache mode.")
@click.option("--prefill-chunk", type=click.IntRange(min=0), default=0, show_default=True,
              help="Prompt tokens per prefill forward call; 0 = the whole prompt in one call (it attends over "
                   "exact K/V). With N > 0 later chunks read earlier ones compressed, so echo/logprob scores "
                   "show the policy's cost.")
@click.option("--kv-budget", default="auto", show_default=True,
              help="KV bytes the running requests may reserve together (512MiB, 2GB, ...): a request is admitted when "
                   "its cache at prompt + max_tokens under its own policy fits beside the running ones, else it "
                   f"waits. auto: {DEFAULT_KV_SHARE:.0%} of the memory available after loading the model.")
@click.option("--prefix-cache", default="256MiB", show_default=True,
              help="Bytes of compressed shared prefixes kept (0: off). A request names its prefix with "
                   "'cache_prefix' (a chat's system messages, a prompt's leading text or tokens): it is compressed "
                   "once under the request's policy and read by every request that starts with it; the least "
                   "recently used prefixes are evicted past the cap.")
@click.option("--api-key", default=None, envvar="TQBENCH_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 (env TQBENCH_API_KEY).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True, help="Server log verbosity.")
def serve(model, device, dtype, threads, kv_policy, cache_mode, host, port, max_new_tokens, max_queue, max_batch,
          prefill_chunk, kv_budget, prefix_cache, api_key, log_level):
    """Serve a model over an OpenAI-compatible HTTP API with a chosen KV policy."""
    from tqbench.engine import ModelLoadError

    try:
        import uvicorn

        from tqbench.engine import check_max_new_tokens, parse_policy
        from tqbench.server import create_app
        from tqbench.server.admission import KVBudget
        from tqbench.server.prefix import PrefixCache
    except ImportError as exc:
        fail(f"the server needs fastapi and uvicorn ({exc}): pip install 'fastapi>=0.110' 'uvicorn>=0.29'")
    try:
        check_max_new_tokens(max_new_tokens)
        if kv_policy is not None:
            parse_policy(kv_policy)
        if kv_budget != "auto":
            KVBudget.resolve(kv_budget)
        PrefixCache(prefix_cache)
    except (ValueError, FileNotFoundError) as exc:
        fail(spelled(exc).splitlines()[0])
    _check_port(host, port)  # before the model load, so a taken port fails at once
    try:
        from tqbench.cli.render.console import load_engine

        engine = load_engine(model, device, dtype, threads)
        if kv_policy is None:  # the model's default: turbo4, or the measured hybrid default (engine.policy.default)
            from tqbench.engine.policy import default_policy

            kv_policy = default_policy(engine.geometry.layer_types).label
        warning = engine.policy_warning(kv_policy)  # also in every response: tqbench.policy_warning + a header
        if warning:
            click.echo(f"warning: kv_policy {parse_policy(kv_policy).label}: {warning}", err=True)
        app = create_app(engine, kv_policy=kv_policy, cache_mode=cache_mode, kv_budget=kv_budget, max_new_tokens=max_new_tokens,
                         max_queue=max_queue, api_key=api_key, model_aliases=(model,), max_batch=max_batch,
                         prefill_chunk=prefill_chunk, prefix_cache=prefix_cache)
    except (ValueError, ModelLoadError, FileNotFoundError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    if host not in LOOPBACK:
        click.echo(f"warning: binding {host}: the server is reachable from other machines"
                   + ("" if api_key else " and has no --api-key"), err=True)
    auth = "Bearer key required" if api_key else "no key"
    click.echo(f"tqbench serve: {engine.name}, kv_policy {app.state.server.policy.label}, cache mode {app.state.server.cache_mode}, "
               f"max_new_tokens {max_new_tokens}, queue {max_queue}, batch {max_batch}, "
               f"prefill chunk {prefill_chunk or 'whole prompt'}, {auth}", err=True)
    budget = app.state.server.kv_budget
    click.echo(f"  cache mode {app.state.server.cache_mode}: {app.state.server.mode_reason}", err=True)
    click.echo(f"  KV budget {budget.bytes} bytes ({budget.bytes / 2**20:.1f} MiB): {budget.source}", err=True)
    click.echo(f"  {app.state.server.break_even_line()}", err=True)
    cap = app.state.server.prefix_cache.cap
    click.echo(f"  prefix cache {cap} bytes ({cap / 2**20:.1f} MiB): --prefix-cache {prefix_cache}" if cap else
               "  prefix cache off (--prefix-cache 0): requests may not name a cache_prefix", err=True)
    click.echo(f"  OpenAI base URL: http://{_url_host(host)}:{port}/v1", err=True)
    worker = app.state.server.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # Ctrl-C: end running streams now instead of after the grace period
            worker.cancel_all()
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)).run()


def _check_port(host: str, port: int) -> None:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        fail(f"cannot resolve --host {host!r} ({exc.strerror}): use an address such as 127.0.0.1")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            fail(f"cannot bind {host}:{port} ({exc.strerror or exc}): pick another --port")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

