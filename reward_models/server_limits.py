"""What one request may cost a reward server (``ServerLimits``) and the decoding of a request's
media within those limits: the size of a PNG is read from its header and an MP4 is decoded
frame by frame, so a small file that expands to a huge image is refused (413) before it fills
memory. ``reward_models/server.py`` serves rewards with them."""
from __future__ import annotations

import base64
import dataclasses
import io
import math
import os
import tempfile

import numpy as np
from PIL import Image
from torch import Tensor

from flowgrpo.pixels import from_uint8

from .media import SOURCE_IMAGE_KEY, SOURCE_IMAGE_WIRE_KEY, decode_png

DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_REQUEST_BYTES = 256 * 1024 * 1024
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may cost the server. Each limit has a CLI flag of the same name
    (``max_batch`` -> ``--max-batch``); the error a client gets names the flag to raise.

    - ``max_batch``: most samples per model call (larger requests are scored in chunks).
    - ``max_request_bytes``: largest accepted body (413 beyond).
    - ``request_timeout``: seconds the server waits for the next bytes of a request (headers or
      body) before answering 408 and closing, so a stalled client frees its thread.
    - ``max_concurrent``: connections handled at once; more get 503 at once (the remote client
      retries 503), so threads and memory stay bounded.
    - ``max_image_pixels``: height * width of one image or video frame (413 beyond): a PNG of a
      few KiB can decode to gigabytes.
    - ``max_video_frames``: frames of one video (413 beyond).
    - ``max_request_pixels``: pixels of all decoded media of one request together (413 beyond;
      the client's ``batch_size`` option sends smaller requests). As float32 RGB a pixel takes
      12 bytes: the default 2**28 is about 3 GiB.
    """

    max_batch: int = DEFAULT_MAX_BATCH
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    request_timeout: float = 30.0
    max_concurrent: int = 16
    max_image_pixels: int = 4096 * 4096
    max_video_frames: int = 1024
    max_request_pixels: int = 2 ** 28

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            flag = "--" + field.name.replace("_", "-")
            if field.name == "request_timeout":
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    raise ValueError(f"request_timeout ({flag}) must be a number of seconds > 0 "
                                     f"(got {value!r})")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field.name} ({flag}) must be an int >= 1 (got {value!r})")


class HttpError(Exception):
    """A request the server refuses: the HTTP status and the message the client gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status



def _png_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the PNG header, without decoding the pixels."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Image.DecompressionBombError as error:
        raise HttpError(413, f"{where}: {error}") from None
    except Exception as error:  # PIL raises many types for broken headers
        raise HttpError(400, f"{where} could not be decoded: {error}") from None


class _PixelBudget:
    """Counts decoded pixels of one request against the limits; raises 413 naming the flag."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.used = 0

    def image(self, width: int, height: int, where: str) -> None:
        pixels = width * height
        if pixels > self.limits.max_image_pixels:
            raise HttpError(413, f"{where} is {width}x{height} = {pixels} pixels, over the "
                                  f"server's limit of {self.limits.max_image_pixels} pixels per "
                                  f"image or frame (--max-image-pixels); send smaller images")
        self.used += pixels
        if self.used > self.limits.max_request_pixels:
            raise HttpError(413, f"the media of this request decode to more than "
                                  f"{self.limits.max_request_pixels} pixels (--max-request-pixels)"
                                  f"; send fewer samples per request (the remote reward's "
                                  f"batch_size option)")

    def frames(self, count: int, where: str) -> None:
        if count > self.limits.max_video_frames:
            raise HttpError(413, f"{where} has more than {self.limits.max_video_frames} frames "
                                  f"(--max-video-frames); send fewer frames per video")


def _decode_png_bounded(data: bytes, budget: _PixelBudget, where: str) -> np.ndarray:
    if data[:8] != PNG_SIGNATURE:
        raise HttpError(400, f"{where}: not a PNG")
    width, height = _png_size(data, where)
    budget.image(width, height, where)
    try:
        return decode_png(data)
    except Exception as error:
        raise HttpError(400, f"{where} could not be decoded: {error}") from None


def _decode_mp4_bounded(data: bytes, budget: _PixelBudget, where: str) -> np.ndarray:
    """MP4 -> (F, H, W, 3) uint8, decoded frame by frame so that the limits stop ffmpeg before
    the frames fill memory (the container's frame count could lie)."""
    import imageio_ffmpeg

    with tempfile.TemporaryDirectory(prefix="reward-server-") as folder:
        path = os.path.join(folder, "video.mp4")
        with open(path, "wb") as handle:
            handle.write(data)
        frames_out = imageio_ffmpeg.read_frames(path, pix_fmt="rgb24")
        try:
            try:
                width, height = next(frames_out)["size"]
            except Exception as error:
                raise HttpError(400, f"{where} could not be decoded: {error}") from None
            frames = []
            for frame in frames_out:
                budget.frames(len(frames) + 1, where)
                budget.image(width, height, f"{where} frame {len(frames)}")
                frames.append(np.frombuffer(frame, dtype=np.uint8).reshape(height, width, 3))
        except HttpError:
            raise
        except Exception as error:
            raise HttpError(400, f"{where} could not be decoded: {error}") from None
        finally:
            frames_out.close()
    if not frames:
        raise HttpError(400, f"{where}: the video has no frames")
    return np.stack(frames)


def decode_source_images(metadata: list[dict], limits: ServerLimits) -> list[dict]:
    """Editing rows: metadata["source_image_png"] (the remote reward's ``encode_source_images``)
    back to metadata["source_image"], (3, H, W) float32 in [0, 1], each PNG's size checked
    against ``limits`` before it is decoded (as the media)."""
    budget = _PixelBudget(limits)
    out = []
    for index, row in enumerate(metadata):
        data = row.get(SOURCE_IMAGE_WIRE_KEY)
        if data is not None:
            where = f"metadata[{index}].{SOURCE_IMAGE_WIRE_KEY}"
            pixels = _decode_png_bounded(_b64(data, where), budget, where)
            row = {k: v for k, v in row.items() if k != SOURCE_IMAGE_WIRE_KEY}
            row[SOURCE_IMAGE_KEY] = from_uint8(pixels)
        out.append(row)
    return out


def decode_media_bounded(items, limits: ServerLimits) -> Tensor:
    """Like ``media.decode_media`` (images (B, 3, H, W) or videos (B, F, 3, H, W) float32 in
    [0, 1]) but every image's size is read from its header and checked against ``limits`` before
    its pixels are decoded; raises HttpError 400 (bad input) or 413 (over a limit)."""
    if not isinstance(items, list) or not items:
        raise HttpError(400, "media must be a non-empty list of base64 strings")
    budget = _PixelBudget(limits)
    decoded = []
    for index, item in enumerate(items):
        where = f"media[{index}]"
        if isinstance(item, list):
            budget.frames(len(item), where)
            if not item:
                raise HttpError(400, f"{where}: a video needs at least one frame")
            decoded.append(np.stack([_decode_png_bounded(_b64(frame, f"{where}[{i}]"), budget,
                                                         f"{where}[{i}]")
                                     for i, frame in enumerate(item)]))
            continue
        data = _b64(item, where)
        if data[:8] == PNG_SIGNATURE:
            decoded.append(_decode_png_bounded(data, budget, where))
        elif data[4:8] == b"ftyp":
            decoded.append(_decode_mp4_bounded(data, budget, where))
        else:
            raise HttpError(400, f"{where}: neither PNG nor MP4")
        if decoded[-1].shape != decoded[0].shape:
            break   # reported below, before decoding the rest
    shapes = {array.shape for array in decoded}
    if len(shapes) != 1:
        raise HttpError(400, f"all media items must have the same shape "
                              f"(got {sorted(shapes)})")
    return from_uint8(np.stack(decoded))


def _b64(item, where: str) -> bytes:
    if not isinstance(item, str):
        raise HttpError(400, f"{where}: expected a base64 string or a list of them "
                              f"(got {type(item).__name__})")
    try:
        return base64.b64decode(item, validate=True)
    except ValueError as error:
        raise HttpError(400, f"{where}: not base64: {error}") from None
