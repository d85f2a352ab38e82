"""Fetch the anchors' prompt sets into assets/prompts/fetched/<name>/ (flowgrpo/prompt_sets.py).

The same as ``flowgrpo fetch-prompts``, runnable from a clone that is not installed::

    python scripts/fetch_prompts.py --list
    python scripts/fetch_prompts.py flow_grpo_ocr flow_grpo_pickscore
    python scripts/fetch_prompts.py mixgrpo_hpdv2 --accept-license
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flowgrpo.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["fetch-prompts", *sys.argv[1:]]))
