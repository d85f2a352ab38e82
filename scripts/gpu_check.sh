#!/usr/bin/env bash
# One-GPU check of training in bf16 and fp16 for every model family with an offline build (toy,
# tiny SD3/FLUX/Wan, an SD3.5-Medium-width SD3 stack at 512 px, then tiny Z-Image, FLUX.2-klein,
# Qwen-Image-Edit-Plus, Wan2.1 I2V, HunyuanVideo and LTX-2): one table row per run with peak GPU
# memory, seconds per iteration and the first-pass ratio deviation; under 10 minutes (runs the
# --time-budget leaves no time for are reported as skipped: give them --families).
#   bash scripts/gpu_check.sh                 # everything, 3 iterations per run
#   bash scripts/gpu_check.sh --families sd3_wide --precisions fp16
#   bash scripts/gpu_check.sh --families z_image,flux2,qwen_image_edit_plus,wan_i2v,hunyuan_video,ltx2
#   bash scripts/gpu_check.sh --cpu-smoke     # no GPU: checks the plumbing on the CPU
# Results: $OUT/gpu_check.json if OUT is set, else runs/gpu_check.json. Exits 2 without a CUDA
# device. Arguments go to scripts/gpu_check.py (--help lists them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# The project's own environment when there is one (scripts/setup_env.sh makes it); otherwise the
# python on PATH, e.g. a GPU machine's environment with a CUDA build of torch.
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$python" scripts/gpu_check.py "$@"
