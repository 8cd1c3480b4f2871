#!/usr/bin/env bash
# The GPU regression sweep within one device `run`: scripts/test_gpu.sh's parts one after another, each cut at
# what is left of BUDGET_S (and killed 10 s later: keep BUDGET_S 30 s under the call's limit), a part not started
# when its usual time no longer fits (it says so), each part's JUnit XML and JSON summary under $OUT, and one
# table at the end. Device time comes in 10-minute calls and failed starts eat it, so a sweep that stops cleanly
# where the budget ends, with what ran written down, is what lets the next call (or session) start from the
# first part not run.
#   source /tmp/site/env.sh && BUDGET_S=560 OUT=$OUT bash scripts/gpu_sweep.sh kernels features steady
# Parts: those of scripts/test_gpu.sh (default: all but flashinfer, in the order below). Extra pytest arguments
# after `--` go to every part (a -k there narrows each part's own filter). Exit status: 1 when a part failed, else
# 0 (parts skipped for time are listed).
# $OUT gets three files whatever the number of parts (a device call brings back at most 8): sweep_summary.md (the
# table), sweep.json (each part's counts and cases, failure messages included) and sweep_tails.log (each part's
# last lines: pytest's short summary of what failed and why). Each part's whole log, JUnit XML and case log stay
# in $SWEEP_RAW (default /tmp/gpu_sweep_raw).
# Cut parts: each case is logged as it ends (tests/case_log.py), so a part cut at the budget still reports its
# counts, each case's time and the case it was cut in. RESUME_FROM=an earlier sweep.json (one brought back from a
# device call, e.g. under benchmarks/results/) runs again only what did not pass there: how a part longer than one
# call gets done call by call (FlashInfer's on a fresh H100 on 2026-12-07: two calls of 550 s, both cut).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu_sweep}
raw=${SWEEP_RAW:-/tmp/gpu_sweep_raw}
mkdir -p "$out" "$raw"
rm -f "$out/sweep.json" "$out/sweep_tails.log"   # this sweep's parts only (a warm machine keeps $SWEEP_RAW too)
budget=${BUDGET_S:-560}
py=${PYTHON:-python3}
# Seconds each part took on nvidia-h200 (sessions 17-25; flashinfer with its JIT on a fresh machine).
declare -A usual=([kernels]=240 [variants]=240 [service]=200 [steady]=150 [dataplane]=120 [usergraph]=90
                  [features]=200 [prefill]=200 [flashinfer]=420)
parts=() extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  [ -n "${usual[$1]:-}" ] || { echo "gpu_sweep: unknown part '$1' (one of: ${!usual[*]})" >&2; exit 2; }
  parts+=("$1"); shift
done
[ ${#parts[@]} -gt 0 ] || parts=(kernels features service steady dataplane usergraph prefill variants)
t0=$(date +%s)
failed=0
table="| part | passed | failed | errors | skipped | seconds | note |\n|---|---|---|---|---|---|---|\n"
for part in "${parts[@]}"; do
  left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt "${usual[$part]}" ]; then
    echo "gpu_sweep: $part not started: ${left} s left, it usually takes ${usual[$part]} s"
    table+="| $part | | | | | | not started (${left} s left) |\n"
    continue
  fi
  start=$(date +%s)
  cases="$raw/sweep_$part.cases.jsonl"
  # a part cut before its report must not read an old one
  rm -f "$raw/sweep_$part.xml" "$raw/sweep_$part.json" "$cases"
  done_before=()
  [ -n "${RESUME_FROM:-}" ] && mapfile -t done_before < <("$py" - "$RESUME_FROM" "$part" <<'EOF'
import json, sys
part = json.load(open(sys.argv[1])).get(sys.argv[2], {})
print("\n".join(f"--deselect={c['name']}" for c in part.get("cases", []) if c["outcome"] == "passed"
                and "::" in c["name"] and "/" in c["name"]))   # node ids (a case log's), not JUnit's class names
EOF
)
  # -k: Ray's driver turns SIGTERM into SystemExit, which a main thread blocked in a CUDA or Ray call never
  # raises (session 29: a prefill part ran on past its cut to the device call's limit, taking the sweep's report).
  CPATTN_CASE_LOG="$cases" timeout -k 10 "$left" bash scripts/test_gpu.sh "$part" --junitxml="$raw/sweep_$part.xml" \
    ${done_before[@]+"${done_before[@]}"} "${extra[@]}" > "$raw/sweep_$part.log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  "$py" benchmarks/junit_json.py "$raw/sweep_$part.xml" "$raw/sweep_$part.json" "$cases"
  { echo "== $part (rc $rc, ${took} s)"; tail -n 30 "$raw/sweep_$part.log"; } >> "$out/sweep_tails.log"
  row=$("$py" - "$raw/sweep_$part.json" "$out/sweep.json" "$part" "${RESUME_FROM:-}" <<'EOF'
import json, os, sys
s = json.load(open(sys.argv[1]))
combined = json.load(open(sys.argv[2])) if os.path.exists(sys.argv[2]) else {}
if sys.argv[4] and "cases" in s:   # what passed before stays listed (marked), so a third call resumes from this one
    ran = {c["name"] for c in s["cases"]}
    before = json.load(open(sys.argv[4])).get(sys.argv[3], {}).get("cases", [])
    s["cases"] += [dict(c, earlier=True) for c in before
                   if c["outcome"] == "passed" and "/" in c["name"] and c["name"] not in ran]
combined[sys.argv[3]] = s
json.dump(combined, open(sys.argv[2], "w"), indent=1)
if "error" in s:
    print("| | | | |")
else:
    passed = s["tests"] - s["failures"] - s["errors"] - s["skipped"]
    print(f"{passed} | {s['failures']} | {s['errors']} | {s['skipped']} |")
EOF
)
  note="rc $rc"
  [ "$rc" = 124 ] && note="cut at the budget in $("$py" -c 'import json, sys
print(", ".join(json.load(open(sys.argv[1])).get("cut_in", [])) or "no case")' "$raw/sweep_$part.json")"
  [ "$rc" = 5 ] && note="nothing ran (no CUDA, or -k chose none): $(tail -1 "$raw/sweep_$part.log")"
  [ ${#done_before[@]} -gt 0 ] && note+="; ${#done_before[@]} cases passed before (RESUME_FROM), not run again"
  { [ "$rc" != 0 ] && [ "$rc" != 5 ]; } && failed=1   # 5: pytest collected nothing (filtered out)
  table+="| $part | $row $took | $note |\n"
  echo "gpu_sweep: $part rc=$rc in ${took} s"; tail -1 "$raw/sweep_$part.log"
done
printf "%b" "$table" | tee "$out/sweep_summary.md"
exit $failed
