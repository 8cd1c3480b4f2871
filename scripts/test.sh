#!/usr/bin/env bash
# The test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (CI has 2 cores); tests/suite_lanes.py keeps tests with time bounds from sharing the machine.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
