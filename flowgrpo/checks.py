"""What every config section is made of (``config_sections.py``, ``config_algorithms.py``,
``plans.PlanConfig``): fields with a help text (``config_field``), a base that checks a section
when it is built (``Section``), and the field checks, each raising a ``ConfigError`` that names
the field and what it must be."""
from __future__ import annotations

import math
from dataclasses import field
from typing import Any, Sequence

from flowgrpo.errors import ConfigError


def config_field(text: str, **kw: Any) -> Any:
    """A dataclass field with a help text (printed by ``flowgrpo train --help-config``) and a
    default (``default=`` or ``default_factory=``): a config file may leave any field out."""
    if "default" not in kw and "default_factory" not in kw:
        raise TypeError("every config field needs a default")
    return field(metadata={"help": text}, **kw)


class Section:
    """A config section: it checks its own values when it is built (``__post_init__``, as TRL's
    configs do), so ``TrainingConfig(lr=-1.0)`` fails at once, naming the field. Rules that read
    several sections are ``flowgrpo.config.validate``'s; a value changed after construction is
    checked there too (it calls every section's ``validate`` again)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field whose value is not allowed."""


def choice(value: Any, choices: Sequence[str], name: str) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)} (got {value!r})")


def finite(value: Any, name: str) -> None:
    """A float field must not be NaN or +-inf (a bound check would name the bound instead)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number (got {value}); see "
                          f"flowgrpo train --help-config for its default")


def positive(value: float, name: str, allow_zero: bool = False) -> None:
    finite(value, name)
    # "not value > 0" rather than "value <= 0": NaN fails every comparison and must not pass.
    if not (value > 0 or (allow_zero and value == 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be {bound} (got {value})")


def in_range(value: float, low: float, high: float, name: str, *, low_open: bool = False,
             high_open: bool = False, meaning: str = "") -> None:
    finite(value, name)
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
