#!/usr/bin/env bash
# Stage ray[default] (the job server behind `ray job submit` and `cpattn submit`, the dashboard) for the GPU
# machine, which has no package index. ../shared/device/stage-wheels.sh stages plain `ray`, which has no job
# server, so issue 23's rows ran with SUBMIT=direct; this script adds what ray[default] pulls in.
#
# Usage, from the project root, AFTER ../shared/device/stage-wheels.sh SET... (it empties .stage):
#   bash scripts/stage_ray_default.sh
# It re-chunks .stage with ray[default]'s wheels added (the other sets' wheels kept) and prints the run calls
# (carry=[".stage/N"], `bash .stage/N/unstage.sh`), made back to back as stage-wheels.sh says.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
unstage=../shared/device/unstage.sh
[[ -f .stage/1/total ]] || { echo "run ../shared/device/stage-wheels.sh SET... first" >&2; exit 2; }
rm -rf .stage/wheels && mkdir -p .stage/wheels
cat .stage/[0-9]*/part.* | tar -xf - -C .stage/wheels
# ray[default] with its dependencies, for the machine's Python 3.12; numpy stays the machine's own.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .stage/wheels 'ray[default]==2.60.0' 2>&1 | grep -v '^WARNING: Location' || true
rm -f .stage/wheels/numpy-*.whl
rm -rf .stage/[0-9]*
tar -cf - -C .stage/wheels . | split -b 56m -d -a 2 - .stage/part.
rm -rf .stage/wheels
n=0
for p in .stage/part.*; do
  n=$((n + 1))
  mkdir -p ".stage/$n"
  mv "$p" ".stage/$n/"
  cp "$unstage" ".stage/$n/"
done
for i in $(seq 1 "$n"); do echo "$n" >".stage/$i/total"; done
echo "Staged $(du -sh .stage | cut -f1) in $n chunk(s) (ray[default] included). Run calls, back to back:"
for i in $(seq 1 "$n"); do echo "  run  carry=[\".stage/$i\"]  command: bash .stage/$i/unstage.sh"; done
