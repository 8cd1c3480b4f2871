#!/usr/bin/env bash
# Create .venv with cpattn and its test tools. torch==2.13.0 goes first: on the CPU machines it is a
# local CPU build, and with it installed the project's `torch>=2.4` range pulls nothing more.
# The install is editable, so code changes need no reinstall: a later run returns at once unless
# pyproject.toml or this script changed (or the venv lost the package). pip's output is shown on failure.
# An install says one line per phase on stderr (a first install takes about a minute and ~1.5 GB of disk).
# `setup.sh tests` (scripts/test.sh) also installs two test tools aside (below).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
mode=${1:-}
say() { echo "setup: $*" >&2; }
# Two test tools the CPU machine's suite gets on Linux x86_64 with a CPU torch, each in a directory of its own under
# .venv that only its tests use, so the suite itself still sees the CPU machine a user has (no triton, no CUDA), and
# a CUDA torch's own triton pin is never touched (on CUDA machines the GPU tests run the kernels themselves):
# - triton for its interpreter: tests/interpreter_run.py runs the TRITON kernels' tests on the CPU with it. 3.9.0:
#   3.6's interpreter fails under numpy 2.4 ("only 0-dimensional arrays can be converted to Python scalars");
# - NVRTC: tests/test_cuda_decode_fp8.py compiles the CUDA fp8 kernel's source for sm_90 with it.
tools_for_tests() {
  [[ $mode == tests && "$(uname -s)-$(uname -m)" == Linux-x86_64 ]] || return 0
  .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null || return 0
  install_aside triton-interpret "triton==3.9.0" "triton 3.9.0 for the Triton interpreter tests" "~640 MB" "$1"
  install_aside nvrtc "nvidia-cuda-nvrtc-cu12==12.9.86" "NVRTC 12.9 for the CUDA kernel's compile tests" "~220 MB" "$1"
}
install_aside() {   # directory under .venv, requirement, what it is for, its size, pip's log
  [[ -d .venv/$1 ]] && return 0
  say "installing $3 (.venv/$1, $4)"
  rm -rf ".venv/$1.partial"   # installed aside, then moved: an interrupted install is never taken as one
  if ! .venv/bin/python -m pip install -q --target ".venv/$1.partial" "$2" >"$5" 2>&1; then
    cat "$5" >&2
    exit 1
  fi
  mv ".venv/$1.partial" ".venv/$1"
}
stamp=.venv/.cpattn-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $root"
if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]] && (cd / && "$root/.venv/bin/python" -c "import cpattn.config") 2>/dev/null; then
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  tools_for_tests "$log"
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
tools_for_tests "$log"
echo "$want" > "$stamp"
say "done: .venv is ready"
