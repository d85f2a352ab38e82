"""Text-rendering reward: does the image show the prompt's quoted text?

Target: ``metadata["text"]`` when given, else the first double-quoted span of the prompt
(``"..."`` or curly quotes), else the first single-quoted span (``'...'`` not inside a word, so
apostrophes are not quotes). No target -> NaN (the sample is not scored).

Reward (Flow-GRPO's definition): recognised text = every OCR line joined; target and recognised
text lowercased with all whitespace removed; 1.0 when the target occurs in the recognised text,
else ``1 - min(d, len(target)) / max(len(target), 1)`` with d the Levenshtein distance (so in
[0, 1]); an image with no text found scores 0.

Backends: ``"rapidocr"`` (default; rapidocr_onnxruntime, whose ONNX models ship in the package, so
it runs offline on CPU), ``"paddleocr"`` (what Flow-GRPO uses; pip install paddleocr paddlepaddle)
and ``"tesseract"`` (pip install pytesseract, plus the tesseract binary).
"""
from __future__ import annotations

import math
import re
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from .base import register_reward
from flowgrpo.pixels import to_uint8

_DOUBLE_QUOTED = re.compile(r'"([^"]*)"|\u201c([^\u201d]*)\u201d')
_SINGLE_QUOTED = re.compile(r"(?<!\w)'([^']*)'(?!\w)|\u2018([^\u2019]*)\u2019")
BACKENDS = ("rapidocr", "paddleocr", "tesseract")


def extract_target_text(prompt: str, metadata: dict | None = None) -> str | None:
    """The text an image should show: ``metadata["text"]``, else the prompt's first quoted span
    (double quotes before single quotes); None when there is none."""
    if metadata and metadata.get("text") is not None:
        return str(metadata["text"])
    for pattern in (_DOUBLE_QUOTED, _SINGLE_QUOTED):
        match = pattern.search(prompt)
        if match:
            return next(group for group in match.groups() if group is not None)
    return None


def normalise_text(text: str) -> str:
    """Lowercase, every whitespace character removed."""
    return "".join(text.split()).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def ocr_score(target: str | None, recognised: str, substring_match: bool = True) -> float:
    """Score of recognised text against the target (both raw): NaN without a target (or an empty
    one), 1.0 on a (normalised) substring match, else 1 - min(d, len) / max(len, 1)."""
    if target is None:
        return math.nan
    target_n, recognised_n = normalise_text(target), normalise_text(recognised)
    if not target_n:
        return math.nan
    if not recognised_n:
        return 0.0
    if substring_match and target_n in recognised_n:
        return 1.0
    distance = min(levenshtein(recognised_n, target_n), len(target_n))
    return 1.0 - distance / max(len(target_n), 1)


def _rapidocr_reader() -> Callable[[np.ndarray], str]:
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as error:
        raise ImportError("OCR backend 'rapidocr' needs rapidocr_onnxruntime: "
                          "pip install rapidocr_onnxruntime") from error
    engine = RapidOCR()

    def read(image: np.ndarray) -> str:
        lines, _ = engine(np.ascontiguousarray(image[..., ::-1]))  # it expects BGR arrays
        return "".join(line[1] for line in lines or [])

    return read


def _paddleocr_reader() -> Callable[[np.ndarray], str]:
    try:
        from paddleocr import PaddleOCR
    except ImportError as error:
        raise ImportError("OCR backend 'paddleocr' needs paddleocr: "
                          "pip install paddleocr paddlepaddle") from error
    try:  # paddleocr 2.x
        engine = PaddleOCR(use_angle_cls=False, lang="en", show_log=False)
    except (TypeError, ValueError):  # 3.x dropped show_log/use_angle_cls
        engine = PaddleOCR(lang="en", use_textline_orientation=False)

    def read(image: np.ndarray) -> str:
        if hasattr(engine, "predict"):
            results = engine.predict(image[..., ::-1].copy())
            return "".join("".join(r.get("rec_texts", [])) for r in results or [])
        result = engine.ocr(image, cls=False)
        return "".join(line[1][0] for line in (result[0] or []) if line[1][1] > 0)

    return read


def _tesseract_reader() -> Callable[[np.ndarray], str]:
    try:
        import pytesseract
    except ImportError as error:
        raise ImportError("OCR backend 'tesseract' needs pytesseract and the tesseract binary: "
                          "pip install pytesseract") from error
    from PIL import Image

    return lambda image: pytesseract.image_to_string(Image.fromarray(image))


_READERS = {"rapidocr": _rapidocr_reader, "paddleocr": _paddleocr_reader,
            "tesseract": _tesseract_reader}


@register_reward("ocr")
class OcrReward:
    """1 - normalised edit distance between the quoted target text and the OCR'd text."""

    def __init__(self, backend: str = "rapidocr", substring_match: bool = True):
        if backend not in BACKENDS:
            raise ValueError(f"ocr backend must be one of {BACKENDS} (got {backend!r})")
        self.backend = backend
        self.substring_match = bool(substring_match)
        self.read_text = _READERS[backend]()

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        images = to_uint8(media)
        scores = []
        for image, prompt, meta in zip(images, prompts, metadata):
            target = extract_target_text(prompt, meta)
            if target is None or not normalise_text(target):
                scores.append(math.nan)
                continue
            scores.append(ocr_score(target, self.read_text(image), self.substring_match))
        return torch.tensor(scores, dtype=torch.float32)
