#!/bin/bash
cd /work/main
P=$(python3 -c "import json;print(json.load(open('benchmarks/results/allocate/alloc-2.5bit-joint.json'))['allocation']['kv_policy_string'])")
Q=$(python3 -c "import json;print(json.load(open('benchmarks/results/allocate/alloc-2.5bit-bits.json'))['allocation']['kv_policy_string'])")
for t in tech; do
  for name in joint bits; do
    if [ $name = joint ]; then pol="$P"; else pol="$Q"; fi
    /usr/bin/time -f "%e s" .venv/bin/python -m tqbench --headless validate --teacher-forced --prompt-file /tmp/bench/j4k/$t.txt --no-chat \
      --tf-context 4096 --tf-tokens 256 --candidate "$pol" --threads 1 --report-json /tmp/bench/j4k/$t-$name.json > /tmp/bench/j4k/$t-$name.log 2>&1
    echo "$t $name rc=$? $(tail -1 /tmp/bench/j4k/$t-$name.log)"
  done
done
