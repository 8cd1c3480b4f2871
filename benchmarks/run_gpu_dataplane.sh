#!/usr/bin/env bash
# The GPU data plane on the device machine, after staging fa4 + ray (see ../shared/device/README.md):
#   OUT=/tmp/out bash benchmarks/run_gpu_dataplane.sh tests    # data-plane + service contract tests
#   OUT=/tmp/out bash benchmarks/run_gpu_dataplane.sh bench    # benchmarks/cp_scaling.py (1 and 2 GPUs)
set -u
source /tmp/site/env.sh
export FLASHINFER_CUDA_ARCH_LIST=9.0
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
case "${1:-tests}" in
  tests)
    timeout 540 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfEs -x \
      tests/gpu/test_data_plane_gpu.py tests/gpu/test_service_gpu.py -k "not FLASHINFER" \
      >"$OUT/pytest_dataplane_gpu.log" 2>&1
    echo "tests rc=$? $(( $(date +%s) - T0 ))s"
    grep -v -E "WARNING|NumPy|^\s*$" "$OUT/pytest_dataplane_gpu.log" | tail -40 ;;
  bench)
    timeout 570 python3 benchmarks/cp_scaling.py --gpus "${GPUS:-1,2}" --layers "${LAYERS:-32}" \
      --repeats "${REPEATS:-5}" ${CASES:+--cases "$CASES"} --json "$OUT/cp_scaling.json" \
      >"$OUT/cp_scaling.log" 2>&1
    echo "bench rc=$? $(( $(date +%s) - T0 ))s"
    grep -v -E "WARNING|NumPy|token|^\s*$" "$OUT/cp_scaling.log" | tail -40 ;;
esac
