#!/usr/bin/env bash
# Re-check after a change to the Triton / FlashAttention paths (no FlashInfer JIT): their GPU tests
# side by side, then decode / DCP / merge / sweep benchmarks. On the GPU machine, after staging
# flashinfer + fa4: OUT=/tmp/out bash benchmarks/run_gpu_quick.sh
set -u
source /tmp/site/env.sh
T0=$(date +%s)
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE tests/gpu"
timeout 200 $PYT -k "TRITON and not merge" >"$OUT/pytest_triton.log" 2>&1 & a=$!
timeout 200 $PYT -k "FLASH_ATTN and not FLASHINFER" >"$OUT/pytest_fa.log" 2>&1 & b=$!
timeout 200 $PYT -k "merge or selection or explicit" >"$OUT/pytest_misc.log" 2>&1 & c=$!
wait $a; echo "triton rc=$? $(( $(date +%s) - T0 ))s"; wait $b; echo "fa rc=$? $(( $(date +%s) - T0 ))s"; wait $c; echo "misc rc=$? $(( $(date +%s) - T0 ))s"
timeout 150 python3 benchmarks/attention_bench.py --backends TRITON,FLASH_ATTN --sections copy,decode,dcp,merge,sweep --out "$OUT/bench3.json" >"$OUT/bench3.log" 2>&1; echo "bench rc=$? $(( $(date +%s) - T0 ))s"
tail -1 $OUT/pytest_*.log; grep -E "^(decode|dcp|merge) " $OUT/bench3.log | grep -v "{"
