#!/usr/bin/env bash
# README command 1: install (once) and align the embedded toy model on CPU.
# Extra arguments are config overrides, e.g. run.max_iterations=10, or --resume latest.
# A demo: running it again starts afresh (--overwrite replaces runs/toy_geneval) unless the
# arguments resume the previous run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
fresh=(--overwrite)
for argument in "$@"; do
  case "$argument" in --resume|--resume=*) fresh=() ;; esac
done
exec .venv/bin/flowgrpo train configs/toy_geneval.yaml "${fresh[@]}" "$@"
