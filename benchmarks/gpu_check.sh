#!/usr/bin/env bash
# Everything a lent GPU should answer, in one call of under 8 minutes:
#   1. the kernel tests on the device (Triton vs the torch reference, every width: tests/unit/test_kernels.py)
#   2. the attention benchmark at llama3-8b shapes, 8K..128K, 1 and 16 query tokens, vs SDPA (and flash-attn
#      where installed), every turbo width + int8:int4
#   3. decode of the default model, dense DynamicCache vs fused (Triton), at 1K and 4K
# then benchmarks/gpu_report.py writes gpu-check.md (a Markdown table naming the device) from the JSON.
#
#   bash benchmarks/gpu_check.sh                   # on the GPU machine, from the repository root
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh   # CPU, tiny sizes, Triton interpreter (tests run this)
#
# Env: GPU_CHECK_OUT (default benchmarks/results), PYTHON (default python), GPU_CHECK_DRY_RUN (0/1).
# Every step runs under its own timeout and its exit status is recorded; the script exits non-zero when a step
# failed (the report says which), so a broken step never hides behind the others.
set -u
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-benchmarks/results}
PY=${PYTHON:-python}
DRY=${GPU_CHECK_DRY_RUN:-0}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STATUS="$OUT/gpu-steps.tsv"
: > "$STATUS"

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/gpu-$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" >> "$STATUS"
  tail -n 25 "$OUT/gpu-$name.log"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
}

if [ "$DRY" = "1" ]; then
  export TRITON_INTERPRET=1
  step kernel-tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py \
    -k "turbo4-turbo4-b1h1 or int8-int4-b1h3 or turbo1-turbo1 or split_k or matches_codec and 64-" \
    --junitxml "$OUT/gpu-kernel-tests.xml"
  step attention 300 "$PY" benchmarks/attention.py --device cpu --quick --queries 1,4 \
    --codecs turbo4:turbo4,turbo2:turbo2 --impls triton,torch-reference --threads 1 \
    --json "$OUT/gpu-attention-llama3-8b.json"
  step decode 300 "$PY" benchmarks/decode.py --model tiny --quick --policies turbo4 --modes fused --threads 1 \
    --json "$OUT/gpu-decode-default.json"
else
  export TRITON_INTERPRET=0
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh: no CUDA device here (GPU_CHECK_DRY_RUN=1 runs the CPU dry run)')" || exit 2
  nvidia-smi > "$OUT/gpu-nvidia-smi.txt" 2>&1 || true
  step kernel-tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py \
    -k "not end_to_end and not multi_token_chunk" --junitxml "$OUT/gpu-kernel-tests.xml"
  step attention 200 "$PY" benchmarks/attention.py --device cuda --shape llama3-8b \
    --contexts 8192,32768,131072 --queries 1,16 --batch 1,8 --repeats 30 \
    --codecs turbo4:turbo4,turbo3:turbo3,turbo2:turbo2,int8:int4 --json "$OUT/gpu-attention-llama3-8b.json"
  step decode 120 "$PY" benchmarks/decode.py --contexts 1024,4096 --new-tokens 32 --repeats 2 \
    --policies turbo4 --modes fused --json "$OUT/gpu-decode-default.json"
fi
"$PY" benchmarks/gpu_report.py --dir "$OUT" --dry-run "$DRY"
rc=$?
cut -f2 "$STATUS" | grep -qv '^0$' && exit 1
exit $rc
