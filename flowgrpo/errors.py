"""The error types of bad input. Their own module, so that every module can raise them without
importing the config (whose validation imports the registries those modules define)."""
from __future__ import annotations


class InputError(ValueError):
    """Something the user gave is wrong (a config value, a prompt file, a run folder, a
    ``--resume`` target): the message says what and how to fix it. ``flowgrpo train`` prints
    these as one line; any other exception keeps its traceback, because it is a bug or a failure
    of the machine rather than of the input."""


class ConfigError(InputError):
    """A configuration value is wrong; the message names the field and the fix."""


class RunStopped(RuntimeError):
    """A run stopped before its end for a reason it states: a signal (``interrupts.Preempted``),
    too many non-finite gradients, no finite reward for too long. ``flowgrpo train`` prints the
    message as one line and exits with ``exit_code``; the run's checkpoints are kept."""

    exit_code = 1
    quiet = False   # True on processes other than the main one: the main one says it
