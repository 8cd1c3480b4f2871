#!/usr/bin/env bash
# The service on the GPU machine: contract tests (4 shards sharing one GPU, gloo data plane) and the
# service benchmark through the per-layer data plane. After staging fa4 + ray (flashinfer optional):
#   OUT=/tmp/out bash benchmarks/run_gpu_service.sh
set -u
source /tmp/site/env.sh
T0=$(date +%s)
timeout 280 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_service_gpu.py \
  >"$OUT/pytest_service_gpu.log" 2>&1
echo "service tests rc=$? $(( $(date +%s) - T0 ))s"; tail -12 "$OUT/pytest_service_gpu.log"
timeout 250 python3 benchmarks/service_bench.py --device cuda --backend TRITON --heads 32,8,128 --shards 1,4 \
  --batches 1,64 --contexts 32768,131072,1048576 --max-tokens 2100000 --layers 4 --repeats 5 \
  --out "$OUT" >"$OUT/service_bench_gpu.log" 2>&1
echo "service bench rc=$? $(( $(date +%s) - T0 ))s"; grep -v -E "WARNING|NumPy" "$OUT/service_bench_gpu.log" | tail -22
