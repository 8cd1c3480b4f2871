#!/usr/bin/env bash
# The decode path on the device machine, after staging fa4 + ray (see ../shared/device/README.md):
#   OUT=/tmp/out bash benchmarks/run_gpu_decode.sh tests   # kernels, decode graphs, service and data plane on GPU
#   OUT=/tmp/out bash benchmarks/run_gpu_decode.sh sweep   # TRITON decode launch configurations
#   OUT=/tmp/out bash benchmarks/run_gpu_decode.sh bench   # benchmarks/cp_scaling.py (GPUS=1,2 CASES=...)
#   OUT=/tmp/out bash benchmarks/run_gpu_decode.sh fp8-sweep     # issue 22: CONFIG_OVERRIDES["fp8"], ~2 min, 1 GPU
#   OUT=/tmp/out bash benchmarks/run_gpu_decode.sh prefix-sweep  # issue 24: CONFIG_OVERRIDES["query_groups"], ~2 min
#   OUT=/tmp/out bash benchmarks/run_gpu_decode.sh fp8-cuda      # issue 22: the CUDA fp8 kernel's candidates, ncu
#   OUT=/tmp/out bash benchmarks/run_gpu_decode.sh fp8-tests     # issue 22: every fp8 sweep candidate (the heads kernel
#                                                                # too) and TRITON's features vs float64; fp8_tests.json
#   OUT=/tmp/out bash benchmarks/run_gpu_decode.sh begin   # issue 18: benchmarks/op_cost.py (a small torch call's cost at
#                                                          # each stage of the client), benchmarks/profile_begin.py (where
#                                                          # opening a decode step spends the caller's time, by phase)
#                                                          # and the no-sync test
set -u
source /tmp/site/env.sh
export PYTHONUNBUFFERED=1
T0=$(date +%s)
case "${1:-tests}" in
  tests)
    timeout "${LIMIT:-400}" python3 -m pytest -q -p no:cacheprovider -o addopts= -rfEs \
      tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_backends_gpu.py tests/gpu/test_data_plane_gpu.py \
      tests/gpu/test_service_gpu.py -k "not FLASHINFER" ${K:+-k "$K"} 2>&1 | tee "$OUT/pytest_decode_gpu.log" \
      | grep -v -E "WARNING|NumPy|^\s*$" | tail -30
    echo "tests $(( $(date +%s) - T0 ))s" ;;
  sweep)
    timeout "${LIMIT:-300}" python3 benchmarks/decode_sweep.py --json "$OUT/decode_sweep.json" 2>&1 \
      | tee "$OUT/decode_sweep.log" | grep -E "^best|error" | tail -20
    echo "sweep $(( $(date +%s) - T0 ))s" ;;
  bench)
    timeout "${LIMIT:-560}" python3 benchmarks/cp_scaling.py --gpus "${GPUS:-1,2}" --layers "${LAYERS:-32}" \
      --repeats "${REPEATS:-5}" ${CASES:+--cases "$CASES"} --json "$OUT/cp_scaling.json" 2>&1 \
      | tee "$OUT/cp_scaling.log" | grep -v -E "WARNING|NumPy|token|^\s*$" | tail -40
    echo "bench $(( $(date +%s) - T0 ))s" ;;
  fp8-sweep)
    timeout "${LIMIT:-200}" python3 benchmarks/triton_decode_sweep.py --fp8-sweep --seconds "${SECONDS_BUDGET:-100}" \
      --json "$OUT/triton_fp8_sweep.json" 2>&1 | tee "$OUT/triton_fp8_sweep.log" | grep -v -E "WARNING|NumPy" | tail -40
    echo "fp8-sweep $(( $(date +%s) - T0 ))s" ;;
  fp8-cuda)   # issue 22: cuda_decode_fp8.py's candidates (fp8_cuda_probe.py), then Nsight Compute on one 1M-key
              # launch where ncu exists (where the kernel's time goes: memory, issue, stalls, occupancy)
    timeout "${LIMIT:-200}" python3 benchmarks/fp8_cuda_probe.py --json "$OUT/fp8_cuda_probe.json" 2>&1 \
      | tee "$OUT/fp8_cuda_probe.log" | grep -v -E "Warning|warn" | tail -40
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    if [ -n "$NCU" ]; then
      timeout "${NCU_LIMIT:-150}" "$NCU" -k regex:cpattn_fp8_decode -c 1 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis python3 -c "import sys; sys.path.insert(0, 'benchmarks')
import fp8_cuda_probe as p; p.probe(1, 1 << 20, [{}])" 2>&1 | tee "$OUT/fp8_cuda_ncu.log" | grep -v -E "Warning|warn" | tail -80
    else
      echo "no ncu here"
    fi
    echo "fp8-cuda $(( $(date +%s) - T0 ))s" ;;
  fp8-tests)
    timeout "${LIMIT:-420}" python3 -m pytest -q -p no:cacheprovider -o addopts= -rfEs \
      tests/gpu/test_decode_variants_gpu.py tests/gpu/test_backend_features_gpu.py \
      -k "not FLASHINFER and not FLASH_ATTN" \
      --junitxml "$OUT/fp8_tests.xml" 2>&1 | tee "$OUT/fp8_tests.log" | grep -v -E "WARNING|NumPy|^\s*$" | tail -30
    python3 benchmarks/junit_json.py "$OUT/fp8_tests.xml" "$OUT/fp8_tests.json"
    echo "fp8-tests $(( $(date +%s) - T0 ))s" ;;
  begin)
    timeout 120 python3 benchmarks/op_cost.py --json "$OUT/op_cost.json" 2>&1 | grep -v -E "WARNING|NumPy|^\s*$" | tail -10
    timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_begin_syncs_gpu.py 2>&1 \
      | tee "$OUT/pytest_begin_syncs_gpu.log" | grep -v -E "WARNING|NumPy|^\s*$" | tail -8
    timeout "${LIMIT:-450}" python3 benchmarks/profile_begin.py --torch-profile ${CASES:+--cases "$CASES"} \
      --json "$OUT/profile_begin.json" 2>&1 | tee "$OUT/profile_begin.log" | grep -v -E "WARNING|NumPy|token|^\s*$" \
      | head -60
    echo "begin $(( $(date +%s) - T0 ))s" ;;
  prefix-sweep)
    timeout "${LIMIT:-200}" python3 benchmarks/prefix_pass_sweep.py --seconds "${SECONDS_BUDGET:-100}" \
      --json "$OUT/prefix_pass_sweep.json" 2>&1 | tee "$OUT/prefix_pass_sweep.log" | grep -v -E "WARNING|NumPy" | tail -40
    echo "prefix-sweep $(( $(date +%s) - T0 ))s" ;;
esac
