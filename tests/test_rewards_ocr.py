"""OCR reward: target extraction and score maths on strings, and real RapidOCR (its ONNX models
ship in the package) on text rendered with Pillow's built-in font."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from reward_models import load_reward
from flowgrpo.pixels import from_uint8
from reward_models.ocr import extract_target_text, levenshtein, normalise_text, ocr_score


# ---- strings ----

@pytest.mark.parametrize("prompt,metadata,target", [
    ('A neon sign that says "Open Late" above a door', None, "Open Late"),
    ("A mug printed with 'coffee' on a desk", None, "coffee"),
    ("The dog's collar reads 'MAX'", None, "MAX"),                  # apostrophe is not a quote
    ("A poster with \u201cSALE 50%\u201d in red", None, "SALE 50%"),
    ('"first" and "second"', None, "first"),
    ("A cat on a mat", None, None),
    ("A cat on a mat", {"text": "mat"}, "mat"),
    ('A sign "ignored"', {"text": "from metadata"}, "from metadata"),
])
def test_extract_target_text(prompt, metadata, target):
    assert extract_target_text(prompt, metadata) == target


@pytest.mark.parametrize("a,b,distance", [
    ("", "", 0), ("abc", "", 3), ("kitten", "sitting", 3), ("flaw", "lawn", 2),
    ("hello", "hello", 0), ("garden", "rocket", 5),
])
def test_levenshtein(a, b, distance):
    assert levenshtein(a, b) == distance == levenshtein(b, a)


def test_ocr_score_follows_flow_grpo_definition():
    assert normalise_text(" Hello \n World ") == "helloworld"
    assert ocr_score("Hello World", "hello world") == 1.0
    assert ocr_score("hello", "xx hello yy") == 1.0                      # substring counts
    assert ocr_score("hello", "xx hello yy", substring_match=False) == pytest.approx(1 - 4 / 5)
    assert ocr_score("hello", "hallo") == pytest.approx(1 - 1 / 5)
    assert ocr_score("kitten", "sitting") == pytest.approx(1 - 3 / 6)
    assert ocr_score("ab", "completely different text") == 0.0           # clipped at 0
    assert ocr_score("hello", "") == 0.0                                   # nothing read
    assert math.isnan(ocr_score(None, "hello"))
    assert math.isnan(ocr_score("  ", "hello"))


# ---- real OCR on rendered text ----

def render(text: str, size: int, font_size: int) -> torch.Tensor:
    """(3, size, size) float image: black ``text`` with Pillow's built-in font on white."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), text,
              fill="black", font=font)
    return from_uint8(np.asarray(image))


@pytest.fixture(scope="module")
def ocr():
    return load_reward("ocr")


@pytest.mark.parametrize("size,font_size,word,other", [
    (64, 14, "hello", "rocket"), (128, 24, "rocket", "garden"),
    (256, 40, "garden", "window"), (512, 80, "Open Late", "hello"),
])
def test_ocr_scores_correct_text_high_and_a_different_word_low(ocr, size, font_size, word, other):
    image = render(word, size, font_size)
    scores = ocr(torch.stack([image, image]),
                 [f'A picture with the text "{word}" on it', f'A sign that says "{other}"'])
    assert scores[0].item() >= 0.9, scores
    assert scores[1].item() <= 0.4, scores


def test_ocr_scores_blank_and_noise_zero_and_untargeted_nan(ocr):
    generator = torch.Generator().manual_seed(0)
    blank = torch.ones(1, 3, 256, 256)
    noise = torch.rand(1, 3, 256, 256, generator=generator)
    text = render("hello", 128, 24)[None]
    media = torch.cat([blank, noise, torch.nn.functional.pad(text, (64, 64, 64, 64), value=1.0)])
    scores = ocr(media, ['A sign "hello"', 'A sign "hello"', "A sign with no quoted text"])
    assert scores[0].item() == 0.0
    assert scores[1].item() == 0.0
    assert math.isnan(scores[2].item())


def test_ocr_metadata_text_overrides_prompt(ocr):
    image = render("garden", 256, 40)[None]
    assert ocr(image, ['A sign "rocket"'], [{"text": "garden"}]).item() >= 0.9


def test_ocr_backend_errors_name_the_package():
    with pytest.raises(ValueError, match="backend must be one of"):
        load_reward({"name": "ocr", "backend": "easyocr"})
    try:
        import pytesseract  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pytesseract"):
            load_reward({"name": "ocr", "backend": "tesseract"})
