"""The field checks every config section uses (``config_sections.py``, ``plans.PlanConfig``):
each raises a ``ConfigError`` that names the field and what it must be."""
from __future__ import annotations

from typing import Any, Sequence

from flowgrpo.errors import ConfigError


def choice(value: Any, choices: Sequence[str], name: str) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)} (got {value!r})")


def positive(value: float, name: str, allow_zero: bool = False) -> None:
    # "not value > 0" rather than "value <= 0": NaN fails every comparison and must not pass.
    if not (value > 0 or (allow_zero and value == 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be {bound} (got {value})")


def in_range(value: float, low: float, high: float, name: str, *, low_open: bool = False,
             high_open: bool = False, meaning: str = "") -> None:
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be in {interval}{meaning} (got {value})")


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_at_least(value: object, minimum: int, name: str) -> None:
    """For fields that Python code may set directly (no YAML coercion): the type too."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum} (got {value!r})")
