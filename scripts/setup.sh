#!/usr/bin/env bash
# Create .venv with cpattn and its test tools. torch==2.13.0 goes first: on the CPU machines it is a
# local CPU build, and with it installed the project's `torch>=2.4` range pulls nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
