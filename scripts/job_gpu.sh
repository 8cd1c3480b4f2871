#!/usr/bin/env bash
# The long-context job on the GPU machine (issue 23): a Ray head on this machine, the job submitted as the README
# says, one JSON per row merged into $OUT/job_gpu_rows.json, every log line in $OUT/job_gpu.log.
#
#   OUT=/tmp/out bash scripts/job_gpu.sh check cp1-128k cp2-128k sdpa-128k      # rows run in the order given
#   bash scripts/job_gpu.sh list                                                 # the rows and their estimates
#
# Each device command is limited to 10 minutes: rows whose estimate no longer fits in BUDGET_S (default 540 s,
# counted from the script's start) are skipped and say so; each row is also cut off at what is left (the job is
# stopped: `cpattn submit` stops its job on SIGINT). Estimates are for 2 x H200 with Triton's cache warm (the
# first row of a fresh machine pays ~30-60 s more for kernel JIT), from: an 8B forward of an 8K chunk ~0.2 s of
# MLP/projections; a full prefill's attention ~2*L^2*4096*32 FLOP (1M: 2.9e17). The job's prefill chunks run on
# FLASH_ATTN (flash-attn-4, ~500-590 TFLOP/s per GPU; 8K onto 512K keys ~68 ms per layer on 2 GPUs) where it
# serves, its decode on TRITON (--prefill-backend, the job's default on cuda); an fp8 cache's pages are dequantised
# for FLASH_ATTN per layer (~1% of a chunk's attention; until 2026-12-01 fp8 prefilled on TRITON, ~356 TFLOP/s).
# So: 128K ~13 s on 1 GPU; 512K ~160 s on 1 GPU, ~100 s on 2; 1M bf16 on 2 GPUs ~320 s; 1M fp8 ~520 s on 1 GPU
# (unmeasured: at the edge of one command), ~320 s on 2;
# plus ~30 s to start the job, build the model and check layer 0. Measured 2026-11-30 with TRITON prefilling too:
# cp1-128k 18.5 s, cp2-128k 12.5 s; cp2-1m still prefilling when cut off at 494 s.
# PREFILL=NAME passes --prefill-backend NAME to every cpattn row (PREFILL=same: the decode backend prefills too).
# Full cpattn rows also check layer 0 of their last decode step against float64 over the whole context
# (--oracle-check: its K/V recomputed from the ids, a few seconds even at 1M).
# Rows "-synth" write random KV for all but the last 8K tokens (--synthetic-prefix): decode at that length and
# whether it fits, in about a minute, without the prefill's time (their prefill tokens/s is of 8K tokens only).
#
# Ray: `ray start --head` returns once the head runs in the background (it records no PID for us: its processes
# stay in this command's process session, where the device machine ends them when the command returns, so each
# call starts its own head, ~10-20 s). This script never runs `ray stop` (that would stop every Ray instance on
# the machine); a head still answering from an earlier call is reused. The lent machine is discarded afterwards.
# GPUs: a cpattn row's entrypoint asks for half a GPU (--entrypoint-num-gpus 0.5); Ray's fractional GPUs are
# best-fit, so the job's first shard (--gpus-per-shard 0.5, the job's default in such an entrypoint) takes the
# other half of the job's GPU and is computed in the job's process (CUDA IPC), a second shard gets the other GPU
# (NCCL). An SDPA row asks for a whole GPU. SUBMIT=ray uses Ray's own `ray job submit` instead of `cpattn submit`;
# SUBMIT=direct (also taken when no job server answers) runs the job as a plain process with an embedded Ray:
# then its shards take one GPU each, the first on GPU 0 where the model runs (the same placement).
# The job server needs ray[default]: stage it with `bash scripts/stage_ray_default.sh` after
# ../shared/device/stage-wheels.sh (plain `ray` has none: the rows of 2026-11-30 ran SUBMIT=direct).
set -u
cd "$(dirname "$0")/.."
[ -f /tmp/site/env.sh ] && source /tmp/site/env.sh   # staged packages; exports PYTHONPATH, which Ray's workers inherit
PY=${PYTHON:-python3}
OUT=${OUT:-out/job_gpu}
BUDGET_S=${BUDGET_S:-540}
SUBMIT=${SUBMIT:-cpattn}
NEW=${NEW_TOKENS:-64}
PREFILL=${PREFILL:-}
ROWS_DIR=/tmp/job_gpu_rows
mkdir -p "$OUT" "$ROWS_DIR"
LOG="$OUT/job_gpu.log"
T0=$(date +%s)
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
M=1048576; K512=524288; K128=131072
RAY_PORT=${RAY_PORT:-6379}
DASH_PORT=${DASH_PORT:-8265}
JOBS=http://127.0.0.1:$DASH_PORT

# name | estimate (s) | entrypoint GPUs, or pytest / check | job arguments (GPU rows: after --device cuda
# --chunk-size 8192); cpu-smoke checks this script's plumbing where there is no GPU (tiny model, 2 CPU shards)
row_spec() {
  case "$1" in
    cpu-smoke)      echo "120|0|--device cpu --prompt-len 300 --chunk-size 64 --shards 2" ;;
    check)          echo "300|pytest|" ;;   # tests/gpu/test_long_context_job_gpu.py: 4 layers vs SDPA on 1 and 2 GPUs, the job on CUDA, small windowed models (Mistral, Gemma 2, gpt-oss) vs transformers (unmeasured: ~200 s before them)
    check32)        echo "150|check|--shards 1" ;;   # the full 32 layers vs SDPA (+ float32 floor), 2K prompt, 1 GPU
    cp1-128k)       echo "60|0.5|--prompt-len $K128 --shards 1 --oracle-check" ;;
    cp2-128k)       echo "60|0.5|--prompt-len $K128 --shards 2 --oracle-check" ;;
    sdpa-128k)      echo "80|1|--prompt-len $K128 --attn sdpa" ;;
    cp1-512k)       echo "200|0.5|--prompt-len $K512 --shards 1 --oracle-check" ;;
    cp2-512k)       echo "140|0.5|--prompt-len $K512 --shards 2 --oracle-check" ;;
    sdpa-512k)      echo "400|1|--prompt-len $K512 --attn sdpa" ;;
    cp1fp8-1m)      echo "540|0.5|--prompt-len $M --shards 1 --kv-cache-dtype fp8_e4m3 --oracle-check" ;;   # at the edge of one command
    cp2-1m)         echo "400|0.5|--prompt-len $M --shards 2 --oracle-check" ;;
    cp2fp8-1m)      echo "350|0.5|--prompt-len $M --shards 2 --kv-cache-dtype fp8_e4m3 --oracle-check" ;;
    sdpa-1m)        echo "700|1|--prompt-len $M --attn sdpa" ;;
    cp1-512k-synth) echo "70|0.5|--prompt-len $K512 --synthetic-prefix $((K512 - 8192)) --shards 1" ;;
    cp2-512k-synth) echo "70|0.5|--prompt-len $K512 --synthetic-prefix $((K512 - 8192)) --shards 2" ;;
    sdpa-512k-synth) echo "80|1|--prompt-len $K512 --synthetic-prefix $((K512 - 8192)) --attn sdpa" ;;
    cp1fp8-1m-synth) echo "80|0.5|--prompt-len $M --synthetic-prefix $((M - 8192)) --shards 1 --kv-cache-dtype fp8_e4m3" ;;
    cp1-1m-synth)   echo "60|0.5|--prompt-len $M --synthetic-prefix $((M - 8192)) --shards 1" ;;   # bf16: refused (does not fit), on purpose
    cp2-1m-synth)   echo "80|0.5|--prompt-len $M --synthetic-prefix $((M - 8192)) --shards 2" ;;
    sdpa-1m-synth)  echo "80|1|--prompt-len $M --synthetic-prefix $((M - 8192)) --attn sdpa" ;;   # OOM expected
    # Mistral-7B's shape (a 4,096 window on every layer): every chunk and decode step reads at most 4,096 keys a
    # layer, so a whole 1M prefill is 128 chunks of ~0.3 s (41 s on one H200, 2026-12-06). The service gives back the
    # pages before the window, so the cache is sized for ~12K tokens a sequence (it held all 1M before, 64 GiB of fp8).
    mis1fp8-1m)     echo "120|0.5|--model mistral-7b --prompt-len $M --shards 1 --kv-cache-dtype fp8_e4m3 --oracle-check" ;;   # 95 s on one H200, 2026-12-06 (the whole cache then)
    mis1-1m)        echo "130|0.5|--model mistral-7b --prompt-len $M --shards 1 --oracle-check" ;;   # bf16 on one GPU: 123 s on one H200, 0.5 GiB of KV held, 2026-12-06
    mis2-1m)        echo "120|0.5|--model mistral-7b --prompt-len $M --shards 2 --oracle-check" ;;
    mis1fp8-1m-synth) echo "85|0.5|--model mistral-7b --prompt-len $M --synthetic-prefix $((M - 8192)) --shards 1 --kv-cache-dtype fp8_e4m3" ;;   # 76 s, 2026-12-06 (the fill in chunks: 13 s)
    *) return 1 ;;
  esac
}
ALL="check check32 cp1-128k cp2-128k sdpa-128k cp1-512k cp2-512k sdpa-512k cp1fp8-1m cp2-1m cp2fp8-1m sdpa-1m"
ALL="$ALL cp1-512k-synth cp2-512k-synth sdpa-512k-synth cp1fp8-1m-synth cp1-1m-synth cp2-1m-synth sdpa-1m-synth"
ALL="$ALL mis1fp8-1m-synth mis1fp8-1m mis1-1m mis2-1m"
if [ $# -eq 0 ] || [ "$1" = list ]; then
  for r in $ALL; do IFS='|' read -r est how args <<<"$(row_spec $r)"; printf "%-16s ~%4ss  %s\n" "$r" "$est" "$args"; done
  exit 0
fi
for r in "$@"; do row_spec "$r" >/dev/null || { echo "unknown row $r: bash scripts/job_gpu.sh list" >&2; exit 2; }; done
say() { echo "[job_gpu +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

job_server_up() {   # any HTTP answer counts (401: the cluster has token auth on, which `cpattn submit` handles)
  $PY -c "import sys, urllib.request, urllib.error
try: urllib.request.urlopen(sys.argv[1] + '/api/version', timeout=3)
except urllib.error.HTTPError: pass" "$JOBS" 2>/dev/null
}

start_head() {   # once per machine; a head left by an earlier call is reused
  if job_server_up; then
    say "a Ray head with a job server already runs here: reusing it"; return 0; fi
  say "ray start --head --num-gpus=$GPUS"
  ray start --head --num-gpus="$GPUS" --disable-usage-stats --temp-dir="${RAY_TMP:-/tmp/ray_job_gpu}" \
    --port="$RAY_PORT" --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" >>"$LOG" 2>&1 \
    || { say "ray start failed (see the log)"; return 1; }
  for _ in $(seq 30); do
    job_server_up && return 0
    sleep 1
  done
  say "the Ray job server at $JOBS did not answer (is ray[default] staged?)"; return 1
}

submit() {   # submit <row> <entrypoint GPUs> <seconds left> <job args...>
  local row=$1 gpus=$2 left=$3; shift 3
  local json="$ROWS_DIR/$row.json" id="job-gpu-$row-$(date +%s)"
  rm -f "$json"
  local job=(python3 examples/long_context_job.py --max-new-tokens "$NEW" --no-progress --json-out "$json" "$@")
  [[ " $* " == *" --device cpu "* ]] || job+=(--device cuda --chunk-size 8192)
  [[ -n "$PREFILL" && " $* " != *" --attn sdpa "* ]] && job+=(--prefill-backend "$PREFILL")
  local gpu_flag=(); [ "$gpus" != 0 ] && gpu_flag=(--entrypoint-num-gpus "$gpus")
  if [ "$SUBMIT" = direct ]; then   # no job server: the job as a plain process with its own embedded Ray
    say "python3 examples/long_context_job.py ${job[*]:2} (direct, embedded Ray)"
    timeout -s INT "$left" env -u RAY_ADDRESS $PY "${job[@]:1}" >>"$LOG" 2>&1
    local rc=$?
  elif [ "$SUBMIT" = ray ]; then
    local auth=(); [ -f ~/.ray/auth_token ] && auth=(env RAY_AUTH_MODE=token)   # README: Ray's CLI needs it set
    say "${auth[*]} ray job submit --address $JOBS --submission-id $id ${gpu_flag[*]} --working-dir . -- ${job[*]}"
    timeout -s INT "$left" ${auth[@]+"${auth[@]}"} ray job submit --address "$JOBS" --submission-id "$id" \
      ${gpu_flag[@]+"${gpu_flag[@]}"} --working-dir . -- "${job[@]}" >>"$LOG" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && ${auth[@]+"${auth[@]}"} ray job stop --address "$JOBS" "$id" >>"$LOG" 2>&1
  else
    say "cpattn submit --address $JOBS --submission-id $id ${gpu_flag[*]} -- ${job[*]}"
    timeout -s INT "$left" $PY -m cpattn.launch.cli submit --address "$JOBS" --submission-id "$id" \
      ${gpu_flag[@]+"${gpu_flag[@]}"} -- "${job[@]}" >>"$LOG" 2>&1
    local rc=$?
  fi
  say "$row: rc=$rc"
  [ -f "$json" ] || echo "{\"status\": \"error\", \"rc\": $rc, \"row\": \"$row\"}" >"$json"
}

HEAD_UP=0
for row in "$@"; do
  IFS='|' read -r est how args <<<"$(row_spec "$row")"
  elapsed=$(( $(date +%s) - T0 )); left=$(( BUDGET_S - elapsed ))
  if [ "$est" -gt "$left" ]; then
    say "$row: skipped, its estimate ${est}s does not fit the ${left}s left of BUDGET_S=$BUDGET_S (run it in a call of its own)"
    echo "{\"status\": \"skipped\", \"row\": \"$row\", \"estimate_s\": $est}" >"$ROWS_DIR/$row.json"; continue
  fi
  if [[ "$how" != 0 && " $args " == *" --shards 2 "* && "$GPUS" -lt 2 ]]; then
    say "$row: skipped, needs 2 GPUs ($GPUS here)"; continue; fi
  rm -f "$ROWS_DIR/$row.json"   # a warm machine may hold an earlier call's
  case "$how" in
    pytest)
      say "pytest tests/gpu/test_long_context_job_gpu.py"
      timeout "$left" $PY -m pytest -q -p no:cacheprovider -o addopts= -rfEs tests/gpu/test_long_context_job_gpu.py \
        >>"$LOG" 2>&1
      rc=$?; say "check: rc=$rc"
      echo "{\"status\": \"pytest\", \"rc\": $rc, \"log\": \"job_gpu.log\"}" >"$ROWS_DIR/$row.json" ;;
    check)
      say "python3 examples/check_job_vs_sdpa.py --device cuda $args"
      timeout "$left" $PY examples/check_job_vs_sdpa.py --device cuda $args --json-out "$ROWS_DIR/$row.json" \
        >>"$LOG" 2>&1
      say "$row: rc=$?" ;;
    *)
      if [ $HEAD_UP -eq 0 ] && [ "$SUBMIT" != direct ]; then
        start_head || { say "no job server: running the rows as plain processes (SUBMIT=direct)"; SUBMIT=direct; }
        HEAD_UP=1
      fi
      left=$(( BUDGET_S - $(date +%s) + T0 ))
      # shellcheck disable=SC2086
      submit "$row" "$how" "$left" $args ;;
  esac
done
# One JSON and one markdown table for all rows (the device hands back at most 8 files).
$PY examples/job_rows.py "$ROWS_DIR" "$OUT/job_gpu_rows.json" "$@" | tee -a "$LOG"
say "done"
