"""Media helpers shared by the rewards: input checks, uint8 conversion, frame sampling and the
lossless/lossy encodings used on the wire (PNG per image, MP4 or PNG frames per video).

``media`` is always float in [0, 1]: images (B, 3, H, W) or videos (B, F, 3, H, W).
"""
from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flowgrpo.pixels import from_uint8, to_uint8


def check_media(media: Tensor, prompts: list[str], metadata: list[dict] | None,
                reward_name: str) -> list[dict]:
    """Validate one reward call's inputs; returns ``metadata`` ([{}] * B when None).

    Raises TypeError/ValueError naming the reward and the argument at fault."""
    if not isinstance(media, Tensor):
        raise TypeError(f"reward {reward_name!r}: media must be a torch.Tensor "
                        f"(got {type(media).__name__})")
    if media.ndim not in (4, 5) or media.shape[-3] != 3:
        raise ValueError(f"reward {reward_name!r}: media must be images (B, 3, H, W) or videos "
                         f"(B, F, 3, H, W) (got shape {tuple(media.shape)})")
    if not media.is_floating_point():
        raise TypeError(f"reward {reward_name!r}: media must be float in [0, 1] "
                        f"(got dtype {media.dtype}); divide uint8 images by 255")
    batch = media.shape[0]
    if isinstance(prompts, str) or len(prompts) != batch:
        raise ValueError(f"reward {reward_name!r}: prompts must be a list of {batch} strings, one "
                         f"per sample (got {type(prompts).__name__} of length {len(prompts)})")
    if metadata is None:
        return [{} for _ in range(batch)]
    if len(metadata) != batch:
        raise ValueError(f"reward {reward_name!r}: metadata must have one dict per sample "
                         f"({batch}) (got {len(metadata)})")
    return list(metadata)


def frame_indices(num_frames: int, frames: int | None) -> Tensor:
    """Indices (n,) of ``frames`` evenly spaced frames among ``num_frames`` (first and last
    included), or all frames when ``frames`` is None or >= num_frames."""
    if frames is None or frames >= num_frames:
        return torch.arange(num_frames)
    if frames < 1:
        raise ValueError(f"frames must be >= 1 or None for all frames (got {frames})")
    if frames == 1:
        return torch.tensor([(num_frames - 1) // 2])
    return torch.linspace(0, num_frames - 1, frames).round().long()


# ---- wire encodings (JSON-safe base64; never pickle) ----

def encode_png(image: np.ndarray) -> str:
    """(H, W, 3) uint8 -> base64 PNG string (lossless)."""
    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_png(data: bytes) -> np.ndarray:
    """PNG bytes -> (H, W, 3) uint8."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


SOURCE_IMAGE_KEY, SOURCE_IMAGE_WIRE_KEY = "source_image", "source_image_png"


def encode_source_images(metadata: list[dict]) -> list[dict]:
    """Editing rows: metadata["source_image"] (a (3, H, W) float tensor in [0, 1]) sent as
    metadata["source_image_png"] (base64 PNG, lossless at 8 bits) so that the metadata is JSON;
    other rows unchanged. The reward server decodes it back (``server._decode_source_images``,
    size-checked like the media)."""
    from flowgrpo.pixels import to_uint8

    out = []
    for row in metadata:
        image = row.get(SOURCE_IMAGE_KEY) if isinstance(row, dict) else None
        if isinstance(image, torch.Tensor):
            row = {k: v for k, v in row.items() if k != SOURCE_IMAGE_KEY}
            row[SOURCE_IMAGE_WIRE_KEY] = encode_png(to_uint8(image))
        out.append(row)
    return out


def encode_mp4(frames: np.ndarray, fps: int = 8) -> str:
    """(F, H, W, 3) uint8 -> base64 MP4 (H.264, yuv444p, crf 0: near-lossless, odd sizes kept;
    pixel values may move by about 1/255 from the colour conversion)."""
    import imageio.v3 as iio

    data = iio.imwrite("<bytes>", frames, extension=".mp4", plugin="FFMPEG", fps=fps,
                       codec="libx264", macro_block_size=1, pixelformat="yuv444p",
                       ffmpeg_params=["-crf", "0"], ffmpeg_log_level="error")
    return base64.b64encode(data).decode("ascii")


def decode_mp4(data: bytes) -> np.ndarray:
    """MP4 bytes -> (F, H, W, 3) uint8."""
    import imageio.v3 as iio

    return np.asarray(iio.imread(data, extension=".mp4", plugin="FFMPEG", index=None))


def encode_media(media: Tensor, video_encoding: str = "mp4") -> list:
    """Media float [0, 1] -> JSON list: one base64 PNG per image; per video one base64 MP4
    (``video_encoding="mp4"``) or a list of base64 PNG frames (``"png"``, lossless)."""
    if media.ndim == 4:
        return [encode_png(image) for image in to_uint8(media)]
    if video_encoding not in ("mp4", "png"):
        raise ValueError(f"video_encoding must be 'mp4' or 'png' (got {video_encoding!r})")
    items = []
    for video in media:
        frames = to_uint8(video)
        items.append(encode_mp4(frames) if video_encoding == "mp4"
                     else [encode_png(frame) for frame in frames])
    return items


def decode_media(items: list) -> Tensor:
    """Inverse of ``encode_media``: a JSON list -> images (B, 3, H, W) or videos (B, F, 3, H, W)
    float32 in [0, 1]. Every item must decode to the same shape. Raises ValueError on bad input."""
    if not isinstance(items, list) or not items:
        raise ValueError("media must be a non-empty list of base64 strings")
    decoded = []
    for index, item in enumerate(items):
        try:
            if isinstance(item, list):
                decoded.append(np.stack([decode_png(base64.b64decode(f, validate=True))
                                         for f in item]))
                continue
            if not isinstance(item, str):
                raise ValueError(f"expected a base64 string or a list of them "
                                 f"(got {type(item).__name__})")
            data = base64.b64decode(item, validate=True)
            if data[:8] == b"\x89PNG\r\n\x1a\n":
                decoded.append(decode_png(data))
            elif data[4:8] == b"ftyp":
                decoded.append(decode_mp4(data))
            else:
                raise ValueError("neither PNG nor MP4")
        except ValueError as error:
            raise ValueError(f"media[{index}]: {error}") from None
        except Exception as error:  # PIL/ffmpeg decoding errors have many types
            raise ValueError(f"media[{index}] could not be decoded: {error}") from None
    shapes = {array.shape for array in decoded}
    if len(shapes) != 1:
        raise ValueError(f"all media items must have the same shape (got {sorted(shapes)})")
    return from_uint8(np.stack(decoded))
