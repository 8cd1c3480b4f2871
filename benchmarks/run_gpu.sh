#!/usr/bin/env bash
# One device session: GPU tests + benchmarks, logs and JSON under $OUT. FlashInfer's JIT warms up in
# the background while the Triton and FlashAttention parts run. Usage (on the GPU machine, after
# staging flashinfer + fa4): bash benchmarks/run_gpu.sh
set -u
source /tmp/site/env.sh
OUT=${OUT:-/tmp/cpattn-out}
mkdir -p "$OUT"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/timeline.txt"; }
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__)" >"$OUT/versions.txt" 2>&1
pip list 2>/dev/null | grep -i -E "flash|triton|torch|cutlass" >>"$OUT/versions.txt"
pids=()
for c in bfloat16:128 bfloat16:64 bfloat16:256 float16:128; do
  timeout 420 python3 benchmarks/warm_flashinfer.py "$c" >"$OUT/warm_${c/:/_}.log" 2>&1 &
  pids+=($!)
done
stamp "warm-up started"
timeout ${T_TESTS_A:-150} python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not FLASHINFER" -o addopts="" -rfE \
  >"$OUT/pytest_a.log" 2>&1; stamp "pytest non-flashinfer rc=$?"
timeout ${T_BENCH_A:-170} python3 benchmarks/attention_bench.py --backends TRITON,FLASH_ATTN --out "$OUT/bench_a.json" \
  >"$OUT/bench_a.log" 2>&1; stamp "bench triton+fa rc=$?"
for p in "${pids[@]}"; do wait "$p"; done; stamp "warm-up done"
timeout ${T_TESTS_B:-90} python3 -m pytest -q -p no:cacheprovider tests/gpu -k "FLASHINFER" -o addopts="" -rfE \
  >"$OUT/pytest_b.log" 2>&1; stamp "pytest flashinfer rc=$?"
timeout ${T_BENCH_B:-90} python3 benchmarks/attention_bench.py --backends FLASHINFER --sections decode,dcp,sweep,prefill \
  --out "$OUT/bench_b.json" >"$OUT/bench_b.log" 2>&1; stamp "bench flashinfer rc=$?"
