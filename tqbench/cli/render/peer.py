"""The side-by-side of tqbench's candidates and a peer's presses (``engine.tasks.peer.side_by_side``): a table, its
Markdown, and the score-vs-ratio plot (plotext in the terminal, a self-contained SVG for the docs). Front-end code."""

from __future__ import annotations

from html import escape

from rich.table import Table
from rich.text import Text

from tqbench.cli.render.console import out

MARKERS = ("*", "+", "x", "o", "#", "=", "@", "%", "&", "$")
#: SVG line colours (colour-blind-safe Okabe-Ito first, then greys); tqbench solid lines, the peer dashed
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#999999", "#F0E442",
           "#666666")


def _cells(r: dict, tasks: list[str]) -> list[str]:
    lo, hi = r["ci95"]
    return [r["library"], r["method"], f"{r['ratio']:g}", r["protocol"],
            *("-" if r["scores"].get(t) is None else f"{r['scores'][t]:.0f}" for t in tasks),
            f"{r['score']:.1f} [{lo:.0f}-{hi:.0f}]", f"{r['agreement']:.0f}%", str(r["samples"])]


def _columns(tasks: list[str]) -> list[str]:
    return ["library", "method", "ratio", "protocol", *tasks, "score [95%]", "agreement", "n"]


def _title(sbs: dict) -> str:
    v = sbs.get("peer_versions") or {}
    peer = ", ".join(f"{k} {x}" for k, x in v.items())
    return (f"{sbs['dataset']}, {sbs['model']}: score by compression ratio (kvpress's: the fraction of context rows "
            f"removed; tqbench keep=1-ratio), points [95% interval]" + (f"; peer: {peer}" if peer else ""))


def print_side_by_side(sbs: dict) -> None:
    t = Table(title=_title(sbs))
    for col in _columns(sbs["tasks"]):
        t.add_column(col, justify="left" if col in ("library", "method", "protocol") else "right")
    last = None
    for r in sbs["rows"]:
        if last is not None and (r["ratio"], r["protocol"]) != last:
            t.add_section()
        last = (r["ratio"], r["protocol"])
        best = sbs["best"].get(f"{r['ratio']:g}|{r['protocol']}|{r['library']}", {}).get("method") == r["method"]
        t.add_row(*_cells(r, sbs["tasks"]), style="bold" if best else None)
    out.print(t)


def side_by_side_md(sbs: dict) -> str:
    cols = _columns(sbs["tasks"])
    lines = [f"# {_title(sbs)}", "", "| " + " | ".join(cols) + " |",
             "| --- | --- | ---: | --- |" + " ---: |" * (len(cols) - 4)]
    for r in sbs["rows"]:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _cells(r, sbs["tasks"])) + " |")
    return "\n".join(lines) + "\n"


def _series(sbs: dict) -> dict[tuple[str, str, str], list[tuple[float, float]]]:
    """(library, method, protocol) -> [(ratio, score)] sorted by ratio; the baseline (ratio 0, protocol both)
    starts every line of its library's side, so each curve begins at the uncompressed score."""
    lines: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    base = [r for r in sbs["rows"] if r["protocol"] == "both"]
    for r in sbs["rows"]:
        if r["protocol"] != "both":
            lines.setdefault((r["library"], r["method"], r["protocol"]), []).append((r["ratio"], r["score"]))
    for pts in lines.values():
        pts.sort()
    return {k: ([(0.0, base[0]["score"])] if base else []) + v for k, v in lines.items()
            if any(x > 0 for x, _ in v)}  # a method only at ratio 0 (kvpress's ``none``) is a point, not a line


def _short(library: str, method: str) -> str:
    """A legend's name: tqbench's policy keys past its codecs and keep (the part that differs), the peer's press."""
    if library != "tqbench":
        return method
    keys = [k for k in method.split(",") if not k.startswith(("k=", "v=", "keep="))]
    return "tqbench " + (",".join(keys) or method)


def plot_terminal(sbs: dict, protocol: str) -> None:
    """Score against ratio under ``protocol``, one line per method (plotext 6)."""
    import plotext as plt

    series = {k: v for k, v in _series(sbs).items() if k[2] == protocol and len(v) > 1}
    if not series:
        return
    fig = plt.figure
    fig.clear()
    fig.plot_size(min(out.width, 100), 22)
    keys = []
    for i, ((lib, method, _), pts) in enumerate(series.items()):
        mark = MARKERS[i % len(MARKERS)]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        for j in range(len(xs) - 1):
            fig.draw(fig.segment(xs[j: j + 2], ys[j: j + 2], marker=mark))
        keys.append(f"{mark} {_short(lib, method)}")
    fig.title(f"score (points) against compression ratio, {protocol}")
    fig.legend(active=False)
    out.print(Text.from_ansi(fig.build().string()))
    out.print("   ".join(keys), markup=False, highlight=False)


def plot_svg(sbs: dict, width: int = 900, height: int = 380) -> str:
    """Score against ratio, one panel per protocol, one line per method (tqbench solid, the peer dashed), as a
    self-contained SVG (no plotting library needed)."""
    series = _series(sbs)
    protocols = [p for p in ("agnostic", "aware") if any(k[2] == p for k in series)]
    methods = list(dict.fromkeys((k[0], k[1]) for k in series))
    colour = {m: COLOURS[i % len(COLOURS)] for i, m in enumerate(methods)}
    n = max(1, len(protocols))
    left, top, legend_h = 50, 30, 18 * ((len(methods) + 1) // 2) + 10
    pw, ph = (width - left - 20 * n) / n, height - top - 40
    total_h = height + legend_h
    xs = sorted({x for pts in series.values() for x, _ in pts}) or [0.0, 1.0]
    x_hi = max(xs[-1], 0.9)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total_h}" '
             f'viewBox="0 0 {width} {total_h}" font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{total_h}" fill="white"/>',
             f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">{escape(sbs["dataset"])}, '
             f'{escape(sbs["model"])}: score against kvpress compression ratio</text>']
    for i, protocol in enumerate(protocols):
        x0 = left + i * (pw + 20)

        def px(x, x0=x0):
            return x0 + pw * x / x_hi

        def py(y):
            return top + ph * (1 - y / 100)

        parts.append(f'<rect x="{x0}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
        parts.append(f'<text x="{x0 + pw / 2}" y="{top - 4}" text-anchor="middle">{protocol}</text>')
        for y in range(0, 101, 25):
            parts.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{py(y)}" y2="{py(y)}" stroke="#ddd"/>')
            if i == 0:
                parts.append(f'<text x="{x0 - 4}" y="{py(y) + 4}" text-anchor="end">{y}</text>')
        for x in xs:
            parts.append(f'<text x="{px(x)}" y="{top + ph + 14}" text-anchor="middle">{x:g}</text>')
        for (lib, method, proto), pts in series.items():
            if proto != protocol:
                continue
            dash = "" if lib == "tqbench" else ' stroke-dasharray="5,3"'
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            c = colour[(lib, method)]
            parts.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>' for x, y in pts]
    parts.append(f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">compression ratio (fraction of '
                 'context rows removed; tqbench keep = 1 - ratio); y: score in points</text>')
    for j, (lib, method) in enumerate(methods):
        lx, ly = left + (j % 2) * (width - left) / 2, height + 12 + 18 * (j // 2)
        dash = "" if lib == "tqbench" else ' stroke-dasharray="5,3"'
        parts.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colour[(lib, method)]}" '
                     f'stroke-width="2"{dash}/>')
        parts.append(f'<text x="{lx + 30}" y="{ly}">{escape(_short(lib, method))}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
