"""Labelled comparison grids: images as one PNG, videos as one MP4 (+ GIF) with the same layout.

Rows are samples (a prompt and a seed), columns are models (the base and its checkpoints), and
each cell may carry a caption (its reward). Small images are upscaled by an integer factor with
nearest-neighbour so a 24 px toy image is legible and its pixels stay exact: the cell at
``layout.cell_box(r, c)`` holds ``upscale(to_uint8(images[r, c]), layout.scale)``, nothing else.

Everything here is pure: tensors and strings in, PIL images / uint8 arrays out. Writing files is
limited to ``save_video``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import imageio.v2 as imageio_v2
import imageio.v3 as imageio_v3
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from flowgrpo.passk import is_binary
from flowgrpo.pixels import to_uint8

BACKGROUND = (255, 255, 255)
TEXT_COLOR = (20, 20, 20)
ELLIPSIS = "..."


def upscale_factor(height: int, width: int, min_size: int = 96) -> int:
    """The smallest integer factor k >= 1 with k * min(height, width) >= min_size."""
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be >= 1 (got {height} x {width})")
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1 (got {min_size})")
    return max(1, math.ceil(min_size / min(height, width)))


def upscale(pixels: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour upscale of (..., H, W, 3) by an integer ``factor`` -> (..., kH, kW, 3):
    every pixel becomes a factor x factor block."""
    if factor < 1:
        raise ValueError(f"factor must be an int >= 1 (got {factor})")
    if factor == 1:
        return pixels
    return np.repeat(np.repeat(pixels, factor, axis=-3), factor, axis=-2)


def load_font(size: int) -> ImageFont.ImageFont:
    """PIL's built-in font at ``size`` px (the bitmap default where FreeType is missing)."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):
        return ImageFont.load_default()


def _text_width(font: ImageFont.ImageFont, text: str) -> float:
    return font.getlength(text) if hasattr(font, "getlength") else font.getbbox(text)[2]


def fit_line(text: str, font: ImageFont.ImageFont, max_width: int) -> str:
    """``text`` cut (with '...') to fit ``max_width`` px on one line."""
    if _text_width(font, text) <= max_width:
        return text
    while text and _text_width(font, text + ELLIPSIS) > max_width:
        text = text[:-1]
    return text + ELLIPSIS if text else ""


def wrap_text(text: str, font: ImageFont.ImageFont, max_width: int, max_lines: int) -> list[str]:
    """Greedy word wrap of ``text`` into at most ``max_lines`` lines of <= ``max_width`` px.
    Explicit newlines start a new line; words longer than a line are cut; what does not fit is
    dropped and the last line ends with '...'."""
    if max_lines < 1:
        return []
    lines: list[str] = []
    for paragraph in text.split("\n"):
        current = ""
        for word in paragraph.split():
            candidate = f"{current} {word}" if current else word
            if _text_width(font, candidate) <= max_width:
                current = candidate
                continue
            if current:
                lines.append(current)
            current = word
            while _text_width(font, current) > max_width and len(current) > 1:
                cut = len(current)
                while cut > 1 and _text_width(font, current[:cut]) > max_width:
                    cut -= 1
                lines.append(current[:cut])
                current = current[cut:]
        lines.append(current)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        # fit_line ends the line with '...' whenever it has to cut, so the appended marker either
        # fits or is re-added after the cut.
        lines[-1] = fit_line(lines[-1] + " " + ELLIPSIS, font, max_width)
    return [fit_line(line, font, max_width) for line in lines]


@dataclass
class GridLayout:
    """Pixel geometry of a grid of R x C cells (all sizes in pixels of the output image).

    ``scale`` is the integer upscale of every cell; a cell is ``cell_width`` x ``cell_height``
    (= scale x the input size). Above the cells is a ``header_height`` band of column labels, left
    of them a ``row_label_width`` band of row labels, under each cell a ``caption_height`` band
    for its caption. ``gap`` px separate everything. The canvas is ``width`` x ``height``,
    rounded up to a multiple of ``multiple_of`` (video encoders need even sizes).
    """

    num_rows: int
    num_cols: int
    scale: int
    cell_width: int
    cell_height: int
    header_height: int
    row_label_width: int
    caption_height: int
    line_height: int
    gap: int
    width: int
    height: int

    def cell_box(self, row: int, col: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of cell (row, col); right/bottom exclusive."""
        if not (0 <= row < self.num_rows and 0 <= col < self.num_cols):
            raise IndexError(f"cell ({row}, {col}) is outside a {self.num_rows} x {self.num_cols} grid")
        left = self.row_label_width + self.gap + col * (self.cell_width + self.gap)
        top = self.header_height + self.gap + row * (self.cell_height + self.caption_height + self.gap)
        return left, top, left + self.cell_width, top + self.cell_height


def grid_layout(num_rows: int, num_cols: int, height: int, width: int, *,
                row_labels: bool = False, col_label_lines: int = 0, caption_lines: int = 0,
                min_cell_size: int = 96, font_size: int = 14, row_label_width: int = 200,
                gap: int = 4, multiple_of: int = 1) -> GridLayout:
    """The geometry of an R x C grid of (height x width) images.

    ``row_labels``: reserve the left band (``row_label_width`` px); ``col_label_lines``: lines of
    column labels above the cells (0 = no header); ``caption_lines``: lines under each cell.
    """
    if num_rows < 1 or num_cols < 1:
        raise ValueError(f"a grid needs at least one row and one column (got {num_rows} x {num_cols})")
    if gap < 0:
        raise ValueError(f"gap must be >= 0 (got {gap})")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1 (got {multiple_of})")
    scale = upscale_factor(height, width, min_cell_size)
    line_height = font_size + max(2, font_size // 4)
    header = col_label_lines * line_height + (gap if col_label_lines else 0)
    caption = caption_lines * line_height + (2 if caption_lines else 0)
    left = row_label_width if row_labels else 0
    cell_w, cell_h = width * scale, height * scale
    canvas_w = left + gap + num_cols * (cell_w + gap)
    canvas_h = header + gap + num_rows * (cell_h + caption + gap)
    canvas_w = math.ceil(canvas_w / multiple_of) * multiple_of
    canvas_h = math.ceil(canvas_h / multiple_of) * multiple_of
    return GridLayout(num_rows=num_rows, num_cols=num_cols, scale=scale, cell_width=cell_w,
                      cell_height=cell_h, header_height=header, row_label_width=left,
                      caption_height=caption, line_height=line_height, gap=gap,
                      width=canvas_w, height=canvas_h)


def _check_labels(labels: Sequence | None, count: int, name: str) -> None:
    if labels is not None and len(labels) != count:
        raise ValueError(f"{name} must have {count} entries, one per {name.split('_')[0]} "
                         f"(got {len(labels)})")


def _labelled_canvas(num_rows: int, num_cols: int, height: int, width: int,
                     row_labels: Sequence[str] | None, col_labels: Sequence[str] | None,
                     cell_labels: Sequence[Sequence[str | None]] | None, *, min_cell_size: int,
                     font_size: int, row_label_width: int, max_label_lines: int,
                     multiple_of: int) -> tuple[Image.Image, GridLayout]:
    """A blank canvas with every label drawn, and its layout (cells left empty)."""
    _check_labels(row_labels, num_rows, "row_labels")
    _check_labels(col_labels, num_cols, "col_labels")
    _check_labels(cell_labels, num_rows, "cell_labels")
    if cell_labels is not None:
        for r, row in enumerate(cell_labels):
            if len(row) != num_cols:
                raise ValueError(f"cell_labels[{r}] must have {num_cols} entries, one per column "
                                 f"(got {len(row)})")
    font = load_font(font_size)
    scale = upscale_factor(height, width, min_cell_size)
    cell_w = width * scale
    col_lines = []
    if col_labels is not None:
        col_lines = [wrap_text(str(label), font, cell_w, max_label_lines) for label in col_labels]
    caption_lines = 0
    if cell_labels is not None:
        caption_lines = max((len(str(label).split("\n")) for row in cell_labels for label in row
                             if label), default=0)
    layout = grid_layout(num_rows, num_cols, height, width, row_labels=row_labels is not None,
                         col_label_lines=max((len(lines) for lines in col_lines), default=0),
                         caption_lines=caption_lines, min_cell_size=min_cell_size,
                         font_size=font_size, row_label_width=row_label_width,
                         multiple_of=multiple_of)
    canvas = Image.new("RGB", (layout.width, layout.height), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    gap, line = layout.gap, layout.line_height
    for c, lines in enumerate(col_lines):
        left = layout.cell_box(0, c)[0]
        for i, text in enumerate(lines):
            draw.text((left, gap // 2 + i * line), text, fill=TEXT_COLOR, font=font)
    for r in range(num_rows):
        top = layout.cell_box(r, 0)[1]
        if row_labels is not None:
            usable = layout.row_label_width - 2 * gap
            max_lines = max(1, (layout.cell_height + layout.caption_height) // line)
            for i, text in enumerate(wrap_text(str(row_labels[r]), font, usable, max_lines)):
                draw.text((gap, top + i * line), text, fill=TEXT_COLOR, font=font)
        if cell_labels is not None:
            for c in range(num_cols):
                label = cell_labels[r][c]
                if not label:
                    continue
                left, _, right, bottom = layout.cell_box(r, c)
                for i, text in enumerate(str(label).split("\n")):
                    draw.text((left, bottom + 1 + i * line), fit_line(text, font, right - left),
                              fill=TEXT_COLOR, font=font)
    return canvas, layout


def with_source_column(images: Tensor, sources: Sequence[Tensor]) -> Tensor:
    """Editing grids: images (R, C, 3, H, W) -> (R, C + 1, 3, H, W) with row r's source image
    (3, h, w) in [0, 1] as column 0, resized (bilinear) to H x W when its size differs."""
    if len(sources) != images.shape[0]:
        raise ValueError(f"sources ({len(sources)}) must give one image per row ({images.shape[0]})")
    size = tuple(images.shape[-2:])
    column = [s.float().cpu() if tuple(s.shape[-2:]) == size else
              F.interpolate(s.float().cpu()[None], size=size, mode="bilinear",
                            align_corners=False)[0].clamp(0, 1) for s in sources]
    return torch.cat([torch.stack(column).unsqueeze(1).to(images), images], dim=1)


def image_grid(images: Tensor, row_labels: Sequence[str] | None = None,
               col_labels: Sequence[str] | None = None,
               cell_labels: Sequence[Sequence[str | None]] | None = None, *,
               min_cell_size: int = 96, font_size: int = 14, row_label_width: int = 200,
               max_label_lines: int = 3) -> Image.Image:
    """A labelled grid of images (R, C, 3, H, W) floats in [0, 1] -> RGB PIL image.

    ``row_labels``: R strings (e.g. prompt and seed), wrapped in a left band; ``col_labels``: C
    strings (e.g. "base", checkpoint names) above the columns, wrapped to the cell width over at
    most ``max_label_lines`` lines; ``cell_labels``: R lists of C strings (None/"" = none; "\\n"
    separates lines) under each cell. Cells are upscaled by ``upscale_factor(H, W,
    min_cell_size)`` (nearest-neighbour). ``render_image_grid`` also returns the geometry.
    """
    return render_image_grid(images, row_labels, col_labels, cell_labels,
                             min_cell_size=min_cell_size, font_size=font_size,
                             row_label_width=row_label_width, max_label_lines=max_label_lines)[0]


def render_image_grid(images: Tensor, row_labels: Sequence[str] | None = None,
                      col_labels: Sequence[str] | None = None,
                      cell_labels: Sequence[Sequence[str | None]] | None = None, *,
                      min_cell_size: int = 96, font_size: int = 14, row_label_width: int = 200,
                      max_label_lines: int = 3) -> tuple[Image.Image, GridLayout]:
    """``image_grid`` and its ``GridLayout`` (where each cell is)."""
    if images.dim() != 5 or images.shape[2] != 3:
        raise ValueError(f"images must have shape (R, C, 3, H, W) (got {tuple(images.shape)})")
    rows, cols, _, height, width = images.shape
    canvas, layout = _labelled_canvas(rows, cols, height, width, row_labels, col_labels, cell_labels,
                                      min_cell_size=min_cell_size, font_size=font_size,
                                      row_label_width=row_label_width,
                                      max_label_lines=max_label_lines, multiple_of=1)
    pixels = np.array(canvas)
    cells = upscale(to_uint8(images), layout.scale)          # (R, C, kH, kW, 3)
    for r in range(rows):
        for c in range(cols):
            left, top, right, bottom = layout.cell_box(r, c)
            pixels[top:bottom, left:right] = cells[r, c]
    return Image.fromarray(pixels), layout


def video_grid(videos: Tensor, row_labels: Sequence[str] | None = None,
               col_labels: Sequence[str] | None = None,
               cell_labels: Sequence[Sequence[str | None]] | None = None, *,
               min_cell_size: int = 96, font_size: int = 14, row_label_width: int = 200,
               max_label_lines: int = 3, multiple_of: int = 16) -> np.ndarray:
    """The layout of ``image_grid`` for videos (R, C, F, 3, H, W) in [0, 1] -> frames
    (F, H', W', 3) uint8, every cell playing its video. H' and W' are rounded up to
    ``multiple_of`` (16 suits every video encoder) with background."""
    return render_video_grid(videos, row_labels, col_labels, cell_labels,
                             min_cell_size=min_cell_size, font_size=font_size,
                             row_label_width=row_label_width, max_label_lines=max_label_lines,
                             multiple_of=multiple_of)[0]


def render_video_grid(videos: Tensor, row_labels: Sequence[str] | None = None,
                      col_labels: Sequence[str] | None = None,
                      cell_labels: Sequence[Sequence[str | None]] | None = None, *,
                      min_cell_size: int = 96, font_size: int = 14, row_label_width: int = 200,
                      max_label_lines: int = 3, multiple_of: int = 16
                      ) -> tuple[np.ndarray, GridLayout]:
    """``video_grid`` and its ``GridLayout``."""
    if videos.dim() != 6 or videos.shape[3] != 3:
        raise ValueError(f"videos must have shape (R, C, F, 3, H, W) (got {tuple(videos.shape)})")
    rows, cols, num_frames, _, height, width = videos.shape
    canvas, layout = _labelled_canvas(rows, cols, height, width, row_labels, col_labels, cell_labels,
                                      min_cell_size=min_cell_size, font_size=font_size,
                                      row_label_width=row_label_width,
                                      max_label_lines=max_label_lines, multiple_of=multiple_of)
    frames = np.broadcast_to(np.array(canvas), (num_frames, layout.height, layout.width, 3)).copy()
    for r in range(rows):
        for c in range(cols):
            left, top, right, bottom = layout.cell_box(r, c)
            frames[:, top:bottom, left:right] = upscale(to_uint8(videos[r, c]), layout.scale)
    return frames, layout


def save_video(frames: np.ndarray, path_mp4: str | os.PathLike, fps: float = 8.0,
               gif: bool = True) -> list[Path]:
    """Write frames (F, H, W, 3) uint8 as an H.264 MP4 at ``path_mp4`` and, with ``gif``, a looping
    GIF next to it (same name, .gif). Odd H or W are padded by one background row/column (the
    encoder needs even sizes). Returns the paths written.

    GIF caveat: Pillow merges consecutive identical frames, so a GIF of a still video has fewer
    frames (same total duration)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (F, H, W, 3) (got {frames.dtype} {frames.shape})")
    if fps <= 0:
        raise ValueError(f"fps must be > 0 (got {fps})")
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), constant_values=255)
    path_mp4 = Path(path_mp4)
    writer = imageio_v2.get_writer(str(path_mp4), format="FFMPEG", fps=fps, codec="libx264",
                                   pixelformat="yuv420p", macro_block_size=1, quality=8)
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()
    written = [path_mp4]
    if gif:
        path_gif = path_mp4.with_suffix(".gif")
        imageio_v3.imwrite(path_gif, frames, extension=".gif", duration=1000.0 / fps, loop=0)
        written.append(path_gif)
    return written


def paginate(num_rows: int, max_rows: int) -> list[range]:
    """Split rows 0..num_rows-1 into ceil(num_rows / max_rows) consecutive pages of balanced size
    (sizes differ by at most one, none above ``max_rows``)."""
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1 (got {num_rows})")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 (got {max_rows})")
    pages = math.ceil(num_rows / max_rows)
    base, extra = divmod(num_rows, pages)
    out, start = [], 0
    for page in range(pages):
        size = base + (1 if page < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def page_paths(path: str | os.PathLike, num_pages: int) -> list[Path]:
    """``path`` itself for one page, else ``<stem>_001<suffix>``, ``<stem>_002<suffix>``, ..."""
    path = Path(path)
    if num_pages == 1:
        return [path]
    width = max(3, len(str(num_pages)))
    return [path.with_name(f"{path.stem}_{i:0{width}d}{path.suffix}") for i in range(1, num_pages + 1)]


# ----------------------------------------------------------------------------- cell captions
VERDICT_MARKS = ("PASS", "FAIL")   # plain ASCII: every font renders it


def verdict_keys(columns: list[dict[str, Tensor]], weights: dict[str, float]) -> set[str]:
    """The caption keys (the weighted rewards and "total") whose scores are verdicts: all 0 or 1
    over every column's samples (``flowgrpo.passk.is_binary``), e.g. ``geneval_toy`` with
    ``score: exact``."""
    keys = [*weights, "total"]
    return {key for key in keys if all(key in column for column in columns)
            and is_binary(torch.cat([column[key].flatten().double() for column in columns]))}


def cell_caption(scores: dict[str, Tensor], weights: dict[str, float], row: int,
                 max_lines: int = 4, verdict: set[str] | frozenset[str] = frozenset(),
                 extra: Sequence[str] = ()) -> str:
    """'0.512 total' (when several rewards are weighted) then '0.700 name' per reward: the value
    first, so a narrow cell cuts the name, not the number. A key in ``verdict`` (a 0/1 verifier,
    see ``verdict_keys``) reads 'PASS 1.000 name' or 'FAIL 0.000 name' (PASS when >= 0.5).
    ``extra``: more keys of ``scores`` after those (held-out metrics, not in the total)."""
    keys = list(weights)

    def line(key: str) -> str:
        value = float(scores[key][row])
        if key in verdict and not math.isnan(value):
            return f"{VERDICT_MARKS[0] if value >= 0.5 else VERDICT_MARKS[1]} {value:.3f} {key}"
        return f"{value:.3f} {key}"

    lines = []
    if len(keys) > 1:
        lines.append(line("total"))
    lines += [line(key) for key in [*keys, *extra]]
    return "\n".join(lines[:max_lines])
