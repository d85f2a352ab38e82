#!/usr/bin/env bash
# README command 1: install (once) and align the embedded toy model on CPU.
# Extra arguments are config overrides, e.g. run.max_iterations=10.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec .venv/bin/flowgrpo train configs/toy_geneval.yaml "$@"
