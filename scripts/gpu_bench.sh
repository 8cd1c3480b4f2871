#!/usr/bin/env bash
# The GPU benchmarks in parts that each fit one device `run` (<= 8 minutes on nvidia-h200-x2), every JSON written
# under $OUT (what a device call brings back; the benchmarks' default paths stay on the lent machine) and every
# table printed. On the device machine, source /tmp/site/env.sh first.
#   bash scripts/gpu_bench.sh decode    # cp_scaling decode cases, 1 and 2 GPUs (issues 18, 22)      ~7 min
#                                       # (runs of 128 steps: ~3 min a GPU count on nvidia-h200, 2026-12-01)
#   bash scripts/gpu_bench.sh prefill   # cp_scaling prefill cases, 1 and 2 GPUs (issue 18)          ~5 min
#   bash scripts/gpu_bench.sh kernels   # Triton decode goals (fp8, window), shared-prefix run, user graphs ~3 min
#   bash scripts/gpu_bench.sh flashinfer  # FLASHINFER's windows through the service: a windowed 1M decode, a chunk
#                                         # of 8K onto 512K (masked plans on 2 GPUs) beside TRITON's; FlashInfer's
#                                         # JIT on a fresh machine takes minutes (2026-12-05: 3 service tests, 389 s)
#   bash scripts/gpu_bench.sh windows   # a chunk of 8K onto 512K of a model whose every other layer has a 4,096
#                                       # window: TRITON prefilling vs FLASH_ATTN (FlashAttention's full layers
#                                       # beside TRITON's windowed ones): what set FLASH_ATTN's
#                                       # auto_prefill_with_windows                                      ~2 min
# Extra arguments go to cp_scaling (decode, prefill parts).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
shift || true
out=${OUT:-out/gpu_bench}
mkdir -p "$out"
py=${PYTHON:-python3}
quiet() { grep -v -e Warning -e 'socket.cpp' -e 'warnings.warn'; }   # tables, not Ray's and torch's noise
case "$part" in
  decode) "$py" benchmarks/cp_scaling.py --gpus 1,2 --repeats 40 --json "$out/cp_scaling_decode.json" \
            --cases decode_128k,decode_1m,decode_b64_32k,decode_1m_fp8,decode_1m_w4096 "$@" 2>&1 | quiet ;;
  prefill) "$py" benchmarks/cp_scaling.py --gpus 1,2 --repeats 10 --json "$out/cp_scaling_prefill.json" \
             --cases prefill_32k,prefill_128k,chunked_8k_on_512k "$@" 2>&1 | quiet ;;
  kernels) # the 2-GPU rows where the machine has 2 GPUs (nvidia-h200 has one: its rows alone)
           n=$("$py" -c 'import torch; print(torch.cuda.device_count())')
           two=$([ "$n" -ge 2 ] && echo 2 || echo 1)
           "$py" benchmarks/triton_decode_sweep.py --goals-only --json "$out/triton_decode_goals.json" 2>&1 | quiet
           "$py" benchmarks/shared_prefix.py --backend TRITON --gpus "$two" --json "$out/shared_prefix.json" 2>&1 | quiet
           "$py" benchmarks/decode_graph_bench.py --gpus "$([ "$two" = 2 ] && echo 1,2 || echo 1)" \
             --cases decode_128k,decode_b64_32k \
             --json "$out/decode_graph.json" 2>&1 | quiet ;;
  flashinfer) n=$("$py" -c 'import torch; print(torch.cuda.device_count())')
              "$py" benchmarks/cp_scaling.py --gpus "$([ "$n" -ge 2 ] && echo 1,2 || echo 1)" --repeats 20 \
                --json "$out/cp_scaling_flashinfer.json" \
                --cases decode_1m_w4096_flashinfer,chunked_8k_on_512k_w4096_flashinfer,chunked_8k_on_512k_w4096 \
                "$@" 2>&1 | quiet ;;
  windows) n=$("$py" -c 'import torch; print(torch.cuda.device_count())')
           "$py" benchmarks/cp_scaling.py --gpus "$([ "$n" -ge 2 ] && echo 1,2 || echo 1)" --repeats 10 \
             --json "$out/cp_scaling_windows.json" \
             --cases chunked_8k_on_512k_alt4096,chunked_8k_on_512k_alt4096_flash_attn "$@" 2>&1 | quiet ;;
  *) echo "usage: bash scripts/gpu_bench.sh {decode|prefill|kernels|flashinfer|windows} [cp_scaling args]" >&2; exit 1 ;;
esac
