#!/usr/bin/env bash
# README command 2: install (once) and run the test suite (slow tests excluded; add -m slow for them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec .venv/bin/python -m pytest -q "$@"
