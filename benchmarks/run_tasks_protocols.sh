#!/bin/sh
# The query-agnostic vs query-aware table in docs/validation.md ("Eviction: both protocols"): the default model at
# 2K tokens, the default task set, 2 samples per task, one thread, nice 10, each candidate under both protocols
# (the baseline's answers are cached after the first run). Results: benchmarks/results/tasks/protocols-*.json.
# usage: sh benchmarks/run_tasks_protocols.sh [samples] [context]
set -u
SAMPLES=${1:-2}
CONTEXT=${2:-2048}
OUT=benchmarks/results/tasks
mkdir -p "$OUT"
PY=${PYTHON:-python}
i=0
for cand in "turbo4,keep=0.5,score=snapkv" "turbo4,keep=0.5,score=tova" "turbo4,keep=0.5,chunk=8" \
            "k=turbo4,v=turbo2,keep=0.5,chunk=8" "turbo4,keep=0.5,score=kvzip" "fp16,keep=0.5,score=kvzip" "fp16"; do
  i=$((i + 1))
  for proto in agnostic aware; do
    echo "$(date -u +%H:%M:%S) $cand $proto load: $(cut -d' ' -f1-3 /proc/loadavg)"
    nice -n 10 "$PY" -m tqbench --headless tasks --threads 1 --context "$CONTEXT" --samples "$SAMPLES" \
      --protocol "$proto" --candidate "$cand" --json > "$OUT/protocols-$CONTEXT-$i-$proto.json" \
      || echo "failed: $cand $proto"
  done
done
echo "$(date -u +%H:%M:%S) done load: $(cut -d' ' -f1-3 /proc/loadavg)"
