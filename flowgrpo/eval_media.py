"""The evaluation's samples as files and as tracker media.

``save_eval_media`` writes ``samples/eval_<iteration>.png``: the first 64 images, 8 a row; for
videos a strip of frames (a row per video, up to 8 videos, 8 evenly spaced frames each) and
``eval_<iteration>.gif`` with the first 8 videos tiled and playing. ``log_eval_media`` sends those
files to the run's tracker through accelerate's tracker API (``accelerator.get_tracker``):
TensorBoard gets the PNG as an image (its video summaries need moviepy, which flowgrpo does not
install), Weights & Biases the PNG as ``wandb.Image`` and the GIF as ``wandb.Video`` (a GIF file
needs no encoder).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flowgrpo.pixels import to_uint8

# The tracker's name for the evaluation grid and videos (outside eval/, where metrics live).
IMAGE_TAG = "samples/eval"
VIDEO_TAG = "samples/eval_video"
GRID_COLUMNS = 8
STRIP_VIDEOS = 8
STRIP_FRAMES = 8
GIF_VIDEOS = 8
GIF_COLUMNS = 4
GIF_FPS = 8.0


def eval_media_paths(out_dir: Path, iteration: int) -> tuple[Path, Path]:
    """(PNG, GIF) paths of an evaluation's samples."""
    stem = f"eval_{iteration:05d}"
    return out_dir / f"{stem}.png", out_dir / f"{stem}.gif"


def evenly_spaced(count: int, picks: int) -> list[int]:
    """``picks`` evenly spaced indices of ``count`` (first and last included; all when fewer)."""
    if picks >= count:
        return list(range(count))
    if picks == 1:
        return [(count - 1) // 2]
    return [round(i * (count - 1) / (picks - 1)) for i in range(picks)]


def video_strip(videos: Tensor, max_videos: int = STRIP_VIDEOS,
                max_frames: int = STRIP_FRAMES) -> tuple[Tensor, int]:
    """(N, F, 3, H, W) -> ((rows * columns), 3, H, W) frames, row-major (a row per video, up to
    ``max_videos``; ``max_frames`` evenly spaced frames per row), and the number of columns."""
    frames = evenly_spaced(videos.shape[1], max_frames)
    picked = videos[:max_videos, frames]
    return picked.flatten(0, 1), len(frames)


def save_eval_media(media: Tensor, out_dir: Path, iteration: int) -> list[Path]:
    """Write an evaluation's samples (images (N, 3, H, W) or videos (N, F, 3, H, W) in [0, 1])
    under ``out_dir``; returns the files written (the PNG, and the GIF for videos)."""
    from torchvision.utils import make_grid, save_image   # torchvision takes seconds to import

    png, gif = eval_media_paths(out_dir, iteration)
    out_dir.mkdir(parents=True, exist_ok=True)
    media = media.detach().float().cpu()
    if media.dim() == 4:
        save_image(media[:64], png, nrow=GRID_COLUMNS)
        return [png]
    frames, columns = video_strip(media)
    save_image(frames, png, nrow=columns)
    shown = media[:GIF_VIDEOS]
    tiles = [make_grid(shown[:, f], nrow=GIF_COLUMNS) for f in range(shown.shape[1])]
    pictures = [Image.fromarray(frame) for frame in to_uint8(torch.stack(tiles))]
    pictures[0].save(gif, save_all=True, append_images=pictures[1:], loop=0,
                     duration=int(round(1000 / GIF_FPS)))
    return [png, gif]


def log_eval_media(accelerator, tracker: str, out_dir: Path, iteration: int) -> list[str]:
    """Send the files ``save_eval_media`` wrote for ``iteration`` to ``tracker`` (tensorboard /
    wandb) at step ``iteration``; call on the main process after ``init_trackers``. Returns the
    tags logged (none when the files or the tracker are missing)."""
    png, gif = eval_media_paths(out_dir, iteration)
    if tracker == "none" or not png.is_file():
        return []
    if tracker == "tensorboard":
        writer = accelerator.get_tracker("tensorboard", unwrap=True)
        if not hasattr(writer, "add_image"):
            return []      # a blank tracker: not the main process
        with Image.open(png) as image:
            pixels = np.asarray(image.convert("RGB"))
        writer.add_image(IMAGE_TAG, pixels, global_step=iteration, dataformats="HWC")
        writer.flush()
        return [IMAGE_TAG]
    if tracker == "wandb":
        run = accelerator.get_tracker("wandb", unwrap=True)
        if not hasattr(run, "log"):
            return []
        import wandb   # optional: installed by whoever logs to it

        payload = {IMAGE_TAG: wandb.Image(str(png))}
        if gif.is_file():
            payload[VIDEO_TAG] = wandb.Video(str(gif), format="gif")
        run.log(payload, step=iteration)
        return list(payload)
    return []
