"""Text rewards for language-model policies (``policy: llm``).

A text reward maps completions to one float per sample; NaN means "no score"::

    reward(completions: list[str], prompts: list[str], metadata: list[dict]) -> (B,)

Any callable with that signature works: a class (built with its options) or a plain function,
named in a config by ``"package.module:Name"``. The built-ins below register by name:

- ``exact_match``: 1 when the completion's final answer equals ``metadata["answer"]``, else 0.
- ``regex_format``: 1 when the completion matches a regular expression, else 0.
- ``length``: -|length - target| / target, 0 at the target length.
- ``overlong``: DAPO's soft overlong punishment from ``metadata["completion_tokens"]``.

Image rewards take tensors; these take strings, so ``load_text_reward`` (not ``load_reward``,
whose media checks want images) builds them; ``reward_models.MultiReward(specs,
load=load_text_reward)`` combines them like image rewards.
"""
from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

import torch
from torch import Tensor

from .base import REGISTRY, as_score_vector, register_reward, score_with_components
from .loading import (MULTI_REWARD_OPTIONS, _constructor_parameters, _entry_points, _split_spec,
                      resolve_reward_class)

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
MARKED = re.compile(r"(?:####|answer\s*[:=]|answer is)\s*(.+)", re.IGNORECASE)
EXTRACT_MODES = ("final", "full")
LENGTH_UNITS = ("chars", "words")


def check_texts(completions: list[str], prompts: list[str], metadata: list[dict] | None,
                reward_name: str) -> list[dict]:
    """Validate one text reward call; returns ``metadata`` ([{}] * B when None)."""
    if isinstance(completions, str) or not all(isinstance(c, str) for c in completions):
        raise TypeError(f"reward {reward_name!r}: completions must be a list of strings")
    batch = len(completions)
    if isinstance(prompts, str) or len(prompts) != batch:
        raise ValueError(f"reward {reward_name!r}: prompts must be a list of {batch} strings, one "
                         f"per completion (got {type(prompts).__name__} of length {len(prompts)})")
    if metadata is None:
        return [{} for _ in range(batch)]
    if len(metadata) != batch:
        raise ValueError(f"reward {reward_name!r}: metadata must have one dict per completion "
                         f"({batch}) (got {len(metadata)})")
    return list(metadata)


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None when it states none.

    In order: the content of the last ``\\boxed{...}``; else the last number after the last
    ``####`` / ``answer:`` / ``answer is`` marker (the marked text itself if it holds no number);
    else the last number of the text. ``"12+7=19"`` -> ``"19"``, ``"#### 1,234."`` -> ``"1,234"``.
    """
    boxed = BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    marked = MARKED.findall(text)
    if marked:
        numbers = NUMBER.findall(marked[-1])
        return numbers[-1] if numbers else marked[-1].strip().rstrip(".") or None
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: object) -> str:
    """Canonical form for comparison: numbers by value (``"1,234.0"`` -> ``"1234"``, ``7`` ->
    ``"7"``), anything else stripped and lower-cased."""
    text = str(answer).strip()
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return text.lower()
    if not value.is_finite():
        return text.lower()
    return format(value.normalize(), "f")


@register_reward("exact_match")
class ExactMatchReward:
    """1.0 when the completion's answer equals ``metadata[answer_key]`` (compared by
    ``normalize_answer``), 0.0 otherwise, NaN when the sample has no reference answer.

    Args:
        answer_key: the metadata field holding the reference answer.
        extract: ``"final"`` compares ``extract_answer(completion)`` (a completion with no answer
            scores 0); ``"full"`` compares the whole stripped completion.
    """

    name = "exact_match"

    def __init__(self, answer_key: str = "answer", extract: str = "final") -> None:
        if extract not in EXTRACT_MODES:
            raise ValueError(f"exact_match: extract must be one of {EXTRACT_MODES} (got {extract!r})")
        self.answer_key = answer_key
        self.extract = extract

    def __call__(self, completions: list[str], prompts: list[str],
                 metadata: list[dict] | None = None) -> Tensor:
        metadata = check_texts(completions, prompts, metadata, self.name)
        scores = []
        for completion, meta in zip(completions, metadata):
            if meta.get(self.answer_key) is None:
                scores.append(math.nan)
                continue
            found = extract_answer(completion) if self.extract == "final" else completion.strip()
            scores.append(float(found is not None and
                                normalize_answer(found) == normalize_answer(meta[self.answer_key])))
        return torch.tensor(scores, dtype=torch.float32)


@register_reward("regex_format")
class RegexFormatReward:
    """1.0 when the completion matches ``pattern``, else 0.0.

    Args:
        pattern: a Python regular expression (default: a bare integer).
        full_match: the whole completion must match (``re.fullmatch``); False searches for the
            pattern anywhere (``re.search``).
        strip: strip surrounding whitespace before matching.
    """

    name = "regex_format"

    def __init__(self, pattern: str = r"-?\d+", full_match: bool = True, strip: bool = True) -> None:
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ValueError(f"regex_format: pattern {pattern!r} is not a valid regular "
                             f"expression ({err})") from None
        self.full_match = full_match
        self.strip = strip

    def __call__(self, completions: list[str], prompts: list[str],
                 metadata: list[dict] | None = None) -> Tensor:
        check_texts(completions, prompts, metadata, self.name)
        match = self.pattern.fullmatch if self.full_match else self.pattern.search
        return torch.tensor([float(match(c.strip() if self.strip else c) is not None)
                             for c in completions], dtype=torch.float32)


@register_reward("length")
class LengthReward:
    """-|length - target| / target: 0 at ``target``, -1 for an empty completion, falling
    linearly beyond the target.

    Args:
        target: the preferred length, >= 1.
        unit: ``"chars"`` (characters of the completion) or ``"words"`` (whitespace-split words).
    """

    name = "length"

    def __init__(self, target: int = 16, unit: str = "chars") -> None:
        if not isinstance(target, int) or target < 1:
            raise ValueError(f"length: target must be an integer >= 1 (got {target!r})")
        if unit not in LENGTH_UNITS:
            raise ValueError(f"length: unit must be one of {LENGTH_UNITS} (got {unit!r})")
        self.target = target
        self.unit = unit

    def __call__(self, completions: list[str], prompts: list[str],
                 metadata: list[dict] | None = None) -> Tensor:
        check_texts(completions, prompts, metadata, self.name)
        lengths = torch.tensor([len(c) if self.unit == "chars" else len(c.split())
                                for c in completions], dtype=torch.float32)
        return -(lengths - self.target).abs() / self.target


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment, (B,) float32 <= 0.

    With L_exp = max_new_tokens - buffer: 0 for length <= L_exp, then falling linearly to
    -penalty at length = max_new_tokens, -penalty beyond. ``buffer = 0`` disables it (zeros).

    Args:
        lengths: (B,) completion lengths in tokens.
    """
    if buffer < 0 or buffer > max_new_tokens:
        raise ValueError(f"buffer must be in [0, max_new_tokens={max_new_tokens}] (got {buffer})")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0 (got {penalty})")
    lengths = lengths.float()
    if buffer == 0:
        return torch.zeros_like(lengths)
    expected = max_new_tokens - buffer
    return (-(lengths - expected).clamp(min=0) / buffer).clamp(min=-1) * penalty


@register_reward("overlong")
class OverlongReward:
    """``overlong_penalty`` of each completion's length in tokens, read from
    ``metadata["completion_tokens"]`` (the LM policy adds it; a string has no token count)."""

    name = "overlong"

    def __init__(self, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> None:
        overlong_penalty(torch.zeros(1), max_new_tokens, buffer, penalty)   # checks the values
        self.max_new_tokens, self.buffer, self.penalty = max_new_tokens, buffer, penalty

    def __call__(self, completions: list[str], prompts: list[str],
                 metadata: list[dict] | None = None) -> Tensor:
        metadata = check_texts(completions, prompts, metadata, self.name)
        if any("completion_tokens" not in m for m in metadata):
            raise ValueError("reward 'overlong' needs metadata['completion_tokens'] (the length "
                             "of each completion in tokens)")
        lengths = torch.tensor([m["completion_tokens"] for m in metadata])
        return overlong_penalty(lengths, self.max_new_tokens, self.buffer, self.penalty)


class LoadedTextReward:
    """A text reward as ``MultiReward`` holds it: a ``name``, scores (B,) float32 CPU with
    +-inf as NaN (``as_score_vector``), and its named components when it has any."""

    def __init__(self, inner, name: str) -> None:
        self.inner = inner
        self.name = name

    def score_and_components(self, completions: list[str], prompts: list[str],
                             metadata: list[dict] | None = None
                             ) -> tuple[Tensor, dict[str, Tensor]]:
        main, parts = score_with_components(self.inner, completions, prompts, metadata)
        batch = len(completions)
        return (as_score_vector(main, batch, self.name),
                {k: as_score_vector(v, batch, f"{self.name}.{k}") for k, v in parts.items()})

    def __call__(self, completions: list[str], prompts: list[str],
                 metadata: list[dict] | None = None) -> Tensor:
        return self.score_and_components(completions, prompts, metadata)[0]


def text_reward_names() -> list[str]:
    """The names a plain (not ``module:Class``) text reward spec may use: the text rewards of
    this module and installed packages' entry points."""
    return sorted({name for name, path in REGISTRY.items() if path.startswith(f"{__name__}:")}
                  | set(_entry_points()))


def load_text_reward(spec: str | dict) -> LoadedTextReward:
    """A text reward from a spec: a registered name (the built-ins above), or
    ``"package.module:Name"`` of a class (built with the spec's options, checked against its
    signature) or of a function ``(completions, prompts, metadata) -> (B,)`` (no options).
    Its name: the instance's ``name`` attribute, else the ``Name`` after the colon."""
    name, options = _split_spec(spec)
    for key in MULTI_REWARD_OPTIONS:
        options.pop(key, None)
    target = resolve_reward_class(name)
    if isinstance(target, type):
        params, takes_any = _constructor_parameters(target)
        unknown = sorted(set(options) - set(params))
        if unknown and not takes_any:
            raise ValueError(f"reward {name!r} has no option {unknown[0]!r}; valid options: "
                             f"{', '.join(params) or 'none'}")
        reward = target(**options)
    elif callable(target):
        if options:
            raise ValueError(f"reward {name!r} is a function and takes no options (got "
                             f"{sorted(options)}); make it a class to configure it")
        reward = target
    else:
        raise TypeError(f"reward {name!r} resolved to {type(target).__name__}, which is not "
                        f"callable")
    return LoadedTextReward(reward, getattr(reward, "name", None) or name.rsplit(":", 1)[-1])
