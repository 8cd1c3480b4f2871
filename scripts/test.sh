#!/usr/bin/env bash
# The test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh tests
# One process: two pytest-xdist workers with lanes (tests/suite_lanes.py; add
# `-n 2 --dist loadfile --no-loadscope-reorder`) reached 66% in 16 minutes on CI's kind of box (2026-11-30), slower
# than this serial run (~20 min then; ~11 min on 2026-12-01, the background scenarios beside it), and were never
# shown green twice.
exec .venv/bin/python -m pytest -q "$@"
