#!/bin/bash
# The 2.5-bit joint allocation with the demote tier offered, and without it on the same cells, verified
# teacher-forced on the same two long texts as run.sh (prose: corpus rivers + bread + lighthouses, 4,973 tokens;
# technical: heldout technical + code + the first 9,790 characters of docs/cache-modes.md at commit 836492c,
# 6,138 tokens: the cut reconstructed to that token count). Run from the repository root with the venv's python.
# Codec cells: those of benchmarks/results/allocate/i21/smollm2-mix.partial.json (same setup), copied to $W; the
# keep and demote cells are measured by the first allocate and reused by the second.
set -e
W=${W:-/tmp/ad}
mkdir -p $W
[ -f $W/smol.partial.json ] || cp benchmarks/results/allocate/i21/smollm2-mix.partial.json $W/smol.partial.json
cat tqbench/data/corpus/rivers.txt tqbench/data/corpus/bread.txt tqbench/data/corpus/lighthouses.txt > $W/prose.txt
(cat tqbench/data/heldout/technical.txt tqbench/data/heldout/code.txt
 git show 836492c:docs/cache-modes.md | python3 -c "import sys; sys.stdout.write(sys.stdin.read()[:9790])") > $W/tech.txt
A="--threads 1 --budget 2.5 --axes bits,tokens --sinks '' --recents '' --max-measurements 6 --resume $W/smol.partial.json"
eval python -m tqbench --headless allocate $A --demote-codecs turbo2,turbo1 --out $W/alloc-2.5bit-demote.toml \
  --json > $W/alloc-2.5bit-demote.json 2> $W/alloc-2.5bit-demote.stderr
eval python -m tqbench --headless allocate $A --out $W/alloc-2.5bit-joint-samecells.toml \
  --json > $W/alloc-2.5bit-joint-samecells.json 2> $W/alloc-2.5bit-joint-samecells.stderr
pol() { python3 -c "import json;print(json.load(open('$1'))['allocation']['kv_policy_string'])"; }
for name in demote joint-samecells; do
  for t in prose tech; do
    python -m tqbench --headless validate --teacher-forced --prompt-file $W/$t.txt --no-chat \
      --candidate "$(pol $W/alloc-2.5bit-$name.json)" --threads 1 --report-json $W/$t-$name.json > $W/$t-$name.log 2>&1
  done
done
# the earlier joint policy (alloc-2.5bit-joint.json) on the reconstructed technical text: reproduces tech-joint.json?
python -m tqbench --headless validate --teacher-forced --prompt-file $W/tech.txt --no-chat \
  --candidate "$(pol benchmarks/results/allocate/alloc-2.5bit-joint.json)" --threads 1 \
  --report-json $W/tech-joint-check.json > $W/tech-joint-check.log 2>&1
