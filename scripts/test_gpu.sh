#!/usr/bin/env bash
# The GPU tests in parts that each finish within one device `run` (under 8 minutes on nvidia-h200-x2,
# measured 2026-11-30: all four files but FlashInfer's cases took 5:16 together; FlashInfer JIT-compiles
# for ~100 s on first use, so its cases are a part of their own).
#   bash scripts/test_gpu.sh kernels     # every backend vs the torch reference, merges, DCP; the CUDA fp8 decode;
#                                        # first steps after a shard start do not compile (kernel warm-up)
#   bash scripts/test_gpu.sh variants    # the TRITON decode's launch variants, cascade splits (with kernels, the
#                                        # two no longer fit one 330 s call: cut off at ~60% on 2026-12-02)
#   bash scripts/test_gpu.sh service     # the service on one GPU, graphed decode
#   bash scripts/test_gpu.sh steady      # a decode run's steps opened without a plan (buffers from the host or
#                                        # the run's rows) vs the planned path, and through the service vs float64
#   bash scripts/test_gpu.sh dataplane   # in-process + NCCL + gloo data planes (two GPUs for most cases)
#   bash scripts/test_gpu.sh flashinfer  # FlashInfer's cases of all of the above
#   bash scripts/test_gpu.sh usergraph   # svc.decode_graph: a model's decode forward in one CUDA graph (1 and 2 GPUs)
#   bash scripts/test_gpu.sh features    # fp8 KV, sliding windows (and the pages they give back through the
#                                        # service), soft caps, sinks per backend vs float64 (not
#                                        # FlashInfer's: those run in the flashinfer part); speed goals:
#                                        # python benchmarks/triton_decode_sweep.py --goals-only
#   bash scripts/test_gpu.sh prefill     # prefill FLASH_ATTN beside decode TRITON on 1 and 2 GPUs vs float64, the
#                                        # prefill's per-rank wire on 2 GPUs (auto vs broadcast), and
#                                        # the long-context job's GPU check (its prefill on FLASH_ATTN by default)
# Extra arguments go to pytest. On the device machine, source /tmp/site/env.sh first (see its README).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
shift || true
py=${PYTHON:-python3}
# pytest keeps only the last -k, so a caller's `-k EXPR` would replace a part's own filter (`flashinfer -k release`
# once ran every backend's release cases): the two are combined, "(the part's) and (the caller's)".
user_k="" rest=()
while [ $# -gt 0 ]; do
  if [ "$1" = "-k" ] && [ $# -ge 2 ]; then user_k=$2; shift 2; else rest+=("$1"); shift; fi
done
k() {
  if [ -n "$1" ] && [ -n "$user_k" ]; then echo "($1) and ($user_k)"; else echo "${1:-$user_k}"; fi
}
case "$part" in
  kernels) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_backends_gpu.py \
             tests/gpu/test_cuda_decode_fp8_gpu.py tests/gpu/test_kernel_warmup_gpu.py -k "$(k "not FLASHINFER")" ${rest[@]+"${rest[@]}"} ;;
  variants) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_decode_variants_gpu.py \
              tests/gpu/test_prefix_cascade_gpu.py -k "$(k "not FLASHINFER")" ${rest[@]+"${rest[@]}"} ;;
  service) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_service_gpu.py \
             tests/gpu/test_decode_graphs_gpu.py -k "$(k "not FLASHINFER")" ${rest[@]+"${rest[@]}"} ;;
  steady) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/test_decode_host_refill.py \
            tests/test_steady_run.py tests/gpu/test_steady_run_gpu.py tests/gpu/test_begin_syncs_gpu.py \
            -k "$(k "")" ${rest[@]+"${rest[@]}"} ;;
  dataplane) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_data_plane_gpu.py \
               tests/gpu/test_client_graphs_gpu.py \
               -k "$(k "not FLASHINFER")" ${rest[@]+"${rest[@]}"} ;;
  features) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs -s tests/gpu/test_backend_features_gpu.py \
              tests/gpu/test_window_release_gpu.py \
              -k "$(k "not FLASHINFER")" ${rest[@]+"${rest[@]}"} ;;
  usergraph) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_decode_graph_gpu.py \
               -k "$(k "")" ${rest[@]+"${rest[@]}"} ;;
  prefill) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_prefill_backend_gpu.py \
             tests/gpu/test_wire_select_gpu.py tests/gpu/test_long_context_job_gpu.py \
             -k "$(k "")" ${rest[@]+"${rest[@]}"} ;;
  flashinfer) exec "$py" -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu -k "$(k FLASHINFER)" \
                ${rest[@]+"${rest[@]}"} ;;
  *) echo "usage: bash scripts/test_gpu.sh" \
          "{kernels|variants|service|steady|dataplane|usergraph|prefill|flashinfer|features} [pytest args]" >&2
     exit 1 ;;
esac
