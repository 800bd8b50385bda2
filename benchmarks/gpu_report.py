"""The Markdown table of ``benchmarks/gpu_check.sh``: device, each step's status, the kernel tests, the attention
benchmark and the decode ratios, from the files that script wrote (``gpu-*.json``, ``gpu-kernel-tests.xml``,
``gpu-steps.tsv``). ``python benchmarks/gpu_report.py --dir benchmarks/results`` writes ``gpu-check.md`` and
``gpu-check.json`` there."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def kernel_tests(path: Path) -> dict | None:
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    out = {k: int(suite.get(k, 0)) for k in keys}
    out["failed"] = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None
                     or c.find("error") is not None]
    return out


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="benchmarks/results")
    p.add_argument("--dry-run", default="0")
    a = p.parse_args(argv)
    d = Path(a.dir)
    steps = []
    if (d / "gpu-steps.tsv").is_file():
        for line in (d / "gpu-steps.tsv").read_text().splitlines():
            name, rc, secs, cmd = line.split("\t", 3)
            steps.append({"step": name, "rc": int(rc), "seconds": int(secs), "command": cmd})
    tests = kernel_tests(d / "gpu-kernel-tests.xml")
    att = load(d / "gpu-attention-llama3-8b.json")
    dec = load(d / "gpu-decode-default.json")
    device = (att or {}).get("device_name") or "unknown device"
    dry = a.dry_run == "1"
    md = [f"# gpu_check on {device}{' (DRY RUN: CPU, Triton interpreter, tiny sizes)' if dry else ''}", "",
          f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}", "",
          "| step | exit | seconds | command |", "| --- | --- | --- | --- |"]
    md += [f"| {s['step']} | {s['rc']} | {s['seconds']} | `{s['command']}` |" for s in steps]
    md += ["", "## Kernel tests (Triton vs the torch reference)", ""]
    if tests is None:
        md.append("no junit file: the kernel tests did not run")
    else:
        md.append(f"{tests['tests']} tests, {tests['failures']} failures, {tests['errors']} errors, "
                  f"{tests['skipped']} skipped" + (f"; failed: {', '.join(tests['failed'])}" if tests["failed"] else ""))
    md += ["", "## Attention (packed store vs SDPA, both timed cold)", ""]
    if att is None:
        md.append("no attention JSON: the benchmark did not finish")
    else:
        md.append(f"copy bandwidth {att['copy_bandwidth_gbs']} GB/s, dense {att['dense_dtype']} SDPA"
                  f"{' + flash-attn' if att.get('flash_attn') else ' (flash-attn not installed)'}, shape "
                  f"{att.get('shape') or 'custom'}")
        md += ["", "| batch | context | q tok | codec | impl | SDPA ms | flash ms | fused ms | speedup | % copy bw | rel err |",
               "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in att["rows"]:
            flash = "-" if r.get("flash_ms") is None else f"{r['flash_ms']:.3f}"
            md.append(f"| {r['batch']} | {r['context']} | {r['queries']} | {r['codec']} | {r['impl']} | "
                      f"{r['dense_ms']:.3f} | {flash} | {r['fused_ms']:.3f} | {r['speedup']:.2f}x | "
                      f"{100 * r['fused_frac_copy_bw']:.0f}% | {r['rel_err_vs_sdpa']:.4f} |")
    md += ["", "## Decode (default model, dense DynamicCache vs fused)", ""]
    if dec is None:
        md.append("no decode JSON: the benchmark did not finish")
    else:
        md += [f"model {dec['model']} on {dec['device']}", "", "| context | policy | mode | decode tok/s | vs dense | impl |",
               "| --- | --- | --- | --- | --- | --- |"]
        for c in dec["results"]:
            for r in [c["baseline"], *c["rows"]]:
                md.append(f"| {r['context']} | {r['policy']} | {r['mode']} | {r['decode_tok_s']:.2f} | "
                          f"{r['ratio_vs_dense']:.2f}x | {', '.join(r.get('fused_impl') or {}) or '-'} |")
    (d / "gpu-check.md").write_text("\n".join(md) + "\n")
    summary = {"device": device, "dry_run": dry, "steps": steps, "kernel_tests": tests,
               "attention_rows": len((att or {}).get("rows", [])), "decode_contexts": [c["context"] for c in
                                                                                       (dec or {}).get("results", [])]}
    (d / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(md))
    ok = tests is not None and not tests["failures"] and not tests["errors"] and att is not None and dec is not None
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
