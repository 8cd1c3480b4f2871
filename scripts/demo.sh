#!/usr/bin/env bash
# The main job: an embedded 4-shard cpattn service on CPU running a long-context workload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/cpattn demo "$@"
