#!/usr/bin/env bash
# Create .venv with cpattn and its test tools. torch==2.13.0 goes first: on the CPU machines it is a
# local CPU build, and with it installed the project's `torch>=2.4` range pulls nothing more.
# The install is editable, so code changes need no reinstall: a later run returns at once unless
# pyproject.toml or this script changed (or the venv lost the package). pip's output is shown on failure.
# An install says one line per phase on stderr (a first install takes about a minute and ~1.5 GB of disk).
# `setup.sh tests` (scripts/test.sh) also installs triton for its interpreter tests (below).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mode=${1:-}
say() { echo "setup: $*" >&2; }
# Triton for its interpreter (tests/interpreter_run.py runs the TRITON kernels' tests on the CPU with it), in a
# directory of its own that only that run puts on its path: the suite itself sees the CPU machine a user has (no
# triton), and a CUDA torch's own triton pin is never touched (on CUDA machines the GPU tests run the kernels).
# 3.9.0: 3.6's interpreter fails under numpy 2.4 ("only 0-dimensional arrays can be converted to Python scalars").
triton_for_tests() {
  [[ $mode == tests && "$(uname -s)-$(uname -m)" == Linux-x86_64 && ! -d .venv/triton-interpret/triton ]] || return 0
  .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null || return 0
  say "installing triton 3.9.0 for the Triton interpreter tests (.venv/triton-interpret, ~640 MB)"
  rm -rf .venv/triton-interpret.partial   # installed aside, then moved: an interrupted install is never taken as one
  if ! .venv/bin/python -m pip install -q --target .venv/triton-interpret.partial "triton==3.9.0" >"$1" 2>&1; then
    cat "$1" >&2
    exit 1
  fi
  mv .venv/triton-interpret.partial .venv/triton-interpret
}
stamp=.venv/.cpattn-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $root"
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]] && (cd / && "$root/.venv/bin/python" -c "import cpattn.config") 2>/dev/null; then
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  triton_for_tests "$log"
  exit 0
fi
if [[ ! -x .venv/bin/python ]]; then
  say "creating .venv (a first install takes about a minute and ~1.5 GB of disk)"
  python3 -m venv .venv
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
pip_install() {
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
  fi
}
say "upgrading pip"
pip_install --upgrade pip || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  say "installing torch 2.13.0 (CPU build where available)"
  pip_install "torch==2.13.0"
fi
say "installing cpattn and its test tools (ray, transformers, pytest)"
pip_install -e ".[test]"
# The checkout as a sys.path entry: then a directory named `cpattn` holding the checkout cannot shadow the
# installed package for scripts run from its parent (the editable install's import hook comes after it).
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$root" > "$site/_cpattn_checkout.pth"
triton_for_tests "$log"
echo "$want" > "$stamp"
say "done: .venv is ready"
