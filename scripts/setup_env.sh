#!/usr/bin/env bash
# Create .venv in the repository and install flowgrpo with its test extra, once.
# Re-runs only when pyproject.toml changed. Used by the README's commands and by CI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
stamp=".venv/.flowgrpo-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x .venv/bin/python ]]; then
  "$python" -m venv .venv
fi
echo "flowgrpo: installing into .venv (first run takes a few minutes)..." >&2
.venv/bin/python -m pip install --quiet --upgrade pip >&2
.venv/bin/python -m pip install --quiet -e ".[test]" >&2
echo "$want" > "$stamp"
