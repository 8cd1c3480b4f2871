#!/usr/bin/env bash
# One device session: GPU tests (three pytest processes side by side), then the benchmarks, logs
# and JSON under $OUT. FlashInfer's JIT (bf16, D=128) warms up in the background during the tests.
# Usage, on the GPU machine after staging flashinfer + fa4: bash benchmarks/run_gpu.sh
set -u
source /tmp/site/env.sh
OUT=${OUT:-/tmp/cpattn-out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/timeline.txt"; }
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__)" >"$OUT/versions.txt" 2>&1
pip list 2>/dev/null | grep -i -E "flash|triton|torch|cutlass" >>"$OUT/versions.txt"
timeout 300 python3 benchmarks/warm_flashinfer.py bfloat16:128 >"$OUT/warm.log" 2>&1 &
warm=$!
PYT="python3 -m pytest -q -p no:cacheprovider -o addopts= -rfE --durations=10 tests/gpu"
timeout ${T_TESTS:-240} $PYT -k "TRITON and not merge" >"$OUT/pytest_triton.log" 2>&1 &
a=$!
timeout ${T_TESTS:-240} $PYT -k "FLASH_ATTN and not FLASHINFER" >"$OUT/pytest_fa.log" 2>&1 &
b=$!
timeout ${T_TESTS:-240} $PYT -k "merge or selection or explicit" >"$OUT/pytest_misc.log" 2>&1 &
c=$!
wait $a; stamp "pytest triton rc=$?"
wait $b; stamp "pytest flash_attn rc=$?"
wait $c; stamp "pytest merge/selection rc=$?"
wait $warm; stamp "flashinfer warm rc=$?"
if [[ "${WITH_FI_TESTS:-0}" == 1 ]]; then
  timeout 120 $PYT -k "FLASHINFER" >"$OUT/pytest_fi.log" 2>&1; stamp "pytest flashinfer rc=$?"
fi
timeout ${T_BENCH:-280} python3 benchmarks/attention_bench.py --backends ${BACKENDS:-TRITON,FLASH_ATTN,FLASHINFER} \
  --out "$OUT/bench.json" >"$OUT/bench.log" 2>&1; stamp "bench rc=$?"
