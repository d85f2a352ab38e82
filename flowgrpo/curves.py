"""``runs/<name>/curves.png``: the training reward and every held-out metric against iteration.

The top panel is the training reward (``reward/total/mean`` of each iteration, raw and a trailing
moving average); below it one small panel per evaluated metric (``metric_keys``: each reward key
and component, its family mean where the prompts have families), with +-1 standard error as a
band, titled with its direction and whether the run trains on it.

Drawn with PIL (a core dependency, as the grids are) rather than matplotlib: lines, bands and a
few tick labels need no plotting stack on a training machine, and a redraw at every evaluation
takes milliseconds. Everything but ``write_curves`` is pure.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from flowgrpo.checkpoint import TMP_PREFIX
from flowgrpo.grids import fit_line, load_font
from flowgrpo.heldout import metric_higher_is_better, metric_reward_key

CURVES = "curves.png"
MOVING_AVERAGE = 10                     # iterations in the training reward's moving average
COLUMNS = 3
PANEL_WIDTH, PANEL_HEIGHT = 360, 210
TRAIN_HEIGHT = 260
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 34, 28   # plot area inside a panel
BACKGROUND = (255, 255, 255)
AXIS = (90, 90, 90)
GRID = (232, 232, 232)
TEXT = (20, 20, 20)
RAW = (170, 190, 225)                   # the raw training reward
LINE = (31, 90, 180)                    # moving average / a metric's mean
BAND = (205, 220, 242)                  # +-1 se
HELDOUT_LINE = (200, 90, 20)            # metrics the run does not train on
HELDOUT_BAND = (248, 222, 200)


@dataclass
class Series:
    """One panel: a title and points (x, y) with an optional standard error per point."""

    title: str
    xs: list[float]
    ys: list[float]
    se: list[float] | None = None
    heldout: bool = False


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean of the last ``window`` values at each position, NaN values left out (NaN
    where every value in the window is NaN). ``window`` >= 1."""
    if window < 1:
        raise ValueError(f"window must be >= 1 (got {window})")
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1):i + 1] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def metric_keys(records: list[dict]) -> list[str]:
    """The evaluation metrics with a panel, in first-seen order: ``eval/<key>`` for each reward
    key and component (no per-family statistics), replaced by ``eval/<key>/family_mean`` where
    the records have it (GenEval's overall score)."""
    seen: dict[str, None] = {}
    for record in records:
        for key in record:
            if key.startswith("eval/") and key.count("/") == 1:
                seen.setdefault(key, None)
    out = []
    for key in seen:
        family = f"{key}/family_mean"
        out.append(family if any(family in r for r in records) else key)
    return out


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else float("nan")


def curve_series(records: list[dict], directions: dict[str, bool], heldout=(),
                 window: int = MOVING_AVERAGE) -> tuple[Series, Series, list[Series]]:
    """(raw training reward, its moving average, one Series per evaluated metric) of a run's
    records (``metrics.jsonl``). ``directions``: reward key -> higher is better; ``heldout``:
    the reward keys of eval.rewards."""
    trains = [r for r in records if r.get("phase") == "train"]
    evals = [r for r in records if r.get("phase") == "eval"]
    xs = [float(r["iteration"]) for r in trains]
    raw = [_number(r.get("reward/total/mean")) for r in trains]
    train = Series("training reward (reward/total/mean per iteration)", xs, raw)
    average = Series(f"moving average ({window})", xs, moving_average(raw, window))
    panels = []
    heldout = set(heldout)
    drawn: set[tuple] = set()
    for key in metric_keys(evals):
        points = [r for r in evals if key in r]
        values = tuple((r["iteration"], r[key]) for r in points)
        if values in drawn:   # a component equal to its reward's main score (e.g. x.mean)
            continue
        drawn.add(values)
        name = key[len("eval/"):]
        own = metric_reward_key(key) in heldout
        direction = "higher" if metric_higher_is_better(key, directions) else "lower"
        tags = ["held-out" if own else "trained on", f"{direction} is better"]
        se_key = f"{key}/se"
        se = [_number(r.get(se_key)) for r in points] if any(se_key in r for r in points) else None
        panels.append(Series(f"{name} ({', '.join(tags)})", [float(r["iteration"]) for r in points],
                             [_number(r[key]) for r in points], se, own))
    return train, average, panels


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    """About ``count`` round tick values covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    ticks, value = [], first
    while value <= high + 1e-9 * step:
        ticks.append(0.0 if abs(value) < step * 1e-9 else value)
        value += step
    return ticks


def _segments(xs: list[float], ys: list[float]) -> list[list[tuple[float, float]]]:
    """Runs of consecutive finite points (a NaN breaks the line)."""
    runs, current = [], []
    for x, y in zip(xs, ys):
        if math.isfinite(y):
            current.append((x, y))
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def _draw_panel(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], lines: list[Series],
                font, small_font) -> None:
    """Axes, ticks and ``lines`` (the first one's se as a band) inside ``box`` (x0, y0, x1, y1);
    the title is the first series'."""
    x0, y0, x1, y1 = box
    left, top, right, bottom = x0 + LEFT, y0 + TOP, x1 - RIGHT, y1 - BOTTOM
    draw.text((x0 + 6, y0 + 8), fit_line(lines[0].title, font, x1 - x0 - 12), fill=TEXT, font=font)
    xs = [x for s in lines for x in s.xs]
    values = []
    for s in lines:
        for i, y in enumerate(s.ys):
            if math.isfinite(y):
                spread = s.se[i] if s.se and math.isfinite(s.se[i]) else 0.0
                values += [y - spread, y + spread]
    draw.rectangle((left, top, right, bottom), outline=AXIS)
    if not xs or not values:
        draw.text((left + 8, top + 8), "no values yet", fill=AXIS, font=small_font)
        return
    x_low, x_high = min(xs), max(xs)
    y_low, y_high = min(values), max(values)
    if y_high - y_low < 1e-12:
        pad = abs(y_high) * 0.05 or 0.5
        y_low, y_high = y_low - pad, y_high + pad
    else:
        pad = 0.06 * (y_high - y_low)
        y_low, y_high = y_low - pad, y_high + pad
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1

    def px(x: float) -> float:
        return left + (x - x_low) / (x_high - x_low) * (right - left)

    def py(y: float) -> float:
        return bottom - (y - y_low) / (y_high - y_low) * (bottom - top)

    for tick in _ticks(y_low, y_high):
        if y_low <= tick <= y_high:
            draw.line((left, py(tick), right, py(tick)), fill=GRID)
            label = f"{tick:.3g}"
            width = draw.textlength(label, font=small_font)
            draw.text((left - 4 - width, py(tick) - 6), label, fill=AXIS, font=small_font)
    for tick in _ticks(x_low, x_high):
        if x_low <= tick <= x_high:
            draw.line((px(tick), bottom, px(tick), bottom + 3), fill=AXIS)
            label = f"{tick:g}"
            width = draw.textlength(label, font=small_font)
            draw.text((px(tick) - width / 2, bottom + 5), label, fill=AXIS, font=small_font)
    draw.rectangle((left, top, right, bottom), outline=AXIS)
    for index, series in enumerate(lines):
        raw_training = len(lines) > 1 and index == 0
        color = RAW if raw_training else (HELDOUT_LINE if series.heldout else LINE)
        band = HELDOUT_BAND if series.heldout else BAND
        if series.se is not None:
            points = [(x, y, s) for x, y, s in zip(series.xs, series.ys, series.se)
                      if math.isfinite(y) and math.isfinite(s)]
            if len(points) > 1:
                upper = [(px(x), py(y + s)) for x, y, s in points]
                lower = [(px(x), py(y - s)) for x, y, s in reversed(points)]
                draw.polygon(upper + lower, fill=band)
            for x, y, s in points:
                draw.line((px(x), py(y - s), px(x), py(y + s)), fill=color)
        for run in _segments(series.xs, series.ys):
            if len(run) > 1:
                draw.line([(px(x), py(y)) for x, y in run], fill=color, width=2)
            if len(series.xs) <= 60:   # points of evaluations; a per-iteration line has too many
                for x, y in run:
                    draw.ellipse((px(x) - 2, py(y) - 2, px(x) + 2, py(y) + 2), fill=color)


def render_curves(records: list[dict], directions: dict[str, bool], heldout=(),
                  window: int = MOVING_AVERAGE) -> Image.Image:
    """The curves of a run's records as an RGB image (see the module docstring)."""
    train, average, panels = curve_series(records, directions, heldout, window)
    rows = math.ceil(len(panels) / COLUMNS)
    width = COLUMNS * PANEL_WIDTH
    image = Image.new("RGB", (width, TRAIN_HEIGHT + rows * PANEL_HEIGHT), BACKGROUND)
    draw = ImageDraw.Draw(image)
    font, small_font = load_font(13), load_font(11)
    _draw_panel(draw, (0, 0, width, TRAIN_HEIGHT), [train, average], font, small_font)
    legend = f"light: per iteration; dark: moving average of {window}"
    draw.text((width - RIGHT - draw.textlength(legend, font=small_font), 10), legend,
              fill=AXIS, font=small_font)
    for i, series in enumerate(panels):
        x0 = (i % COLUMNS) * PANEL_WIDTH
        y0 = TRAIN_HEIGHT + (i // COLUMNS) * PANEL_HEIGHT
        _draw_panel(draw, (x0, y0, x0 + PANEL_WIDTH, y0 + PANEL_HEIGHT), [series], font,
                    small_font)
    return image


def write_curves(records: list[dict], path: str | os.PathLike, directions: dict[str, bool],
                 heldout=(), window: int = MOVING_AVERAGE) -> Path:
    """Draw ``render_curves`` to ``path`` atomically (a reader sees the old file or the new)."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    render_curves(records, directions, heldout, window).save(tmp, format="PNG")
    os.replace(tmp, path)
    return path
