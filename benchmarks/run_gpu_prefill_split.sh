#!/usr/bin/env bash
# Issue 18's prefill split (a remote shard's causal share smaller by its wire's cost, its compact message attended
# as it arrived) on nvidia-h200-x2, after staging fa4 + ray (../shared/device/README.md); each part fits one run:
#   OUT=/tmp/out bash benchmarks/run_gpu_prefill_split.sh tests   # tests/gpu/test_prefill_split_gpu.py      ~4 min
#   OUT=/tmp/out bash benchmarks/run_gpu_prefill_split.sh wire    # per-rank wire, prefill backend, data plane ~6 min
#   OUT=/tmp/out bash benchmarks/run_gpu_prefill_split.sh bench   # cp_scaling prefill cases, 1 and 2 GPUs    ~5 min
#   OUT=/tmp/out bash benchmarks/run_gpu_prefill_split.sh sweep   # prefill_32k, 2 GPUs, FPB="0 2000 4500"    ~6 min
# Test results land as JSON ($OUT/<part>_tests.json: counts and every failure), benchmark rows as cp_scaling JSON.
set -u
source /tmp/site/env.sh
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
T0=$(date +%s)
quiet() { grep -v -E "WARNING|NumPy|Warning|socket.cpp|warnings.warn|^\s*$"; }

pytest_json() {   # pytest_json NAME FILES...: run, then $OUT/NAME_tests.json from its junit XML
  local name=$1
  shift
  timeout "${LIMIT:-450}" python3 -m pytest -q -p no:cacheprovider -o addopts= -rfEs --junitxml="$OUT/$name.xml" \
    "$@" 2>&1 | tee "$OUT/$name.log" | quiet | tail -30
  python3 benchmarks/junit_json.py "$OUT/$name.xml" "$OUT/${name}_tests.json" && echo "$OUT/${name}_tests.json written"
}

case "${1:-tests}" in
  tests) pytest_json prefill_split tests/gpu/test_prefill_split_gpu.py ;;
  wire) pytest_json wire tests/gpu/test_wire_select_gpu.py tests/gpu/test_prefill_backend_gpu.py \
          tests/gpu/test_data_plane_gpu.py ;;
  bench)
    timeout "${LIMIT:-470}" python3 benchmarks/cp_scaling.py --gpus 1,2 --layers 32 --repeats 10 \
      --cases prefill_32k,prefill_128k,chunked_8k_on_512k --json "$OUT/cp_scaling_prefill.json" 2>&1 \
      | tee "$OUT/cp_scaling_prefill.log" | quiet | tail -20 ;;
  sweep)
    for fpb in ${FPB:-0 2000 4500}; do
      timeout "${LIMIT:-150}" python3 benchmarks/cp_scaling.py --gpus 2 --layers 32 --repeats 10 --cases prefill_32k \
        --pcp-wire-flops-per-byte "$fpb" --json "$OUT/cp_scaling_32k_fpb$fpb.json" 2>&1 \
        | tee "$OUT/cp_scaling_32k_fpb$fpb.log" | quiet | tail -4
    done ;;
  *) echo "usage: OUT=DIR bash benchmarks/run_gpu_prefill_split.sh {tests|wire|bench|sweep}" >&2; exit 1 ;;
esac
echo "${1:-tests} $(( $(date +%s) - T0 ))s"
