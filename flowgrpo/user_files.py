"""The files a user points ``flowgrpo train`` at: reading a text file (a config, a prompt file)
and finding where a run folder cannot be made, each with a one-line ``InputError`` that names
the file and the fix. Their own module, so that the config, the prompt loader and the run
folder share one wording without importing each other."""
from __future__ import annotations

import os
from pathlib import Path

from flowgrpo.errors import InputError


def line_and_column(data: str | bytes, offset: int) -> tuple[int, int]:
    """The 1-based line and column of ``offset`` in ``data`` (text or bytes)."""
    newline = b"\n" if isinstance(data, bytes) else "\n"
    line = data.count(newline, 0, offset) + 1
    column = offset - (data.rfind(newline, 0, offset) + 1) + 1
    return line, column


def read_text_file(path: str | os.PathLike, what: str, expected: str,
                   error: type[InputError] = InputError) -> str:
    """The UTF-8 text of ``path``, or ``error`` (an InputError) saying why not: missing, a
    folder or another non-regular file, unreadable, or not UTF-8 (with the line and column of
    the first bad byte, since a binary file given by mistake and a text file in another
    encoding both land here). ``what`` names the file in the message ("config file");
    ``expected`` is the fix ("give a YAML config file")."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} {path} is a folder, not a file: {expected}")
    if not path.exists():
        raise error(f"{what} {path} does not exist: {expected}")
    if not path.is_file():   # a device or a pipe: reading could block or never end
        raise error(f"{what} {path} is not a regular file: {expected}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise error(f"{what} {path} cannot be read ({err.strerror or err}): {expected}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, column = line_and_column(data, err.start)
        raise error(f"{what} {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at line "
                    f"{line}, column {column}): {expected}") from None


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` if it exists, else its closest ancestor that does: where a ``mkdir -p`` of
    ``path`` would start writing."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def folder_blocker(folder: str | os.PathLike) -> Path | None:
    """The file that stands where ``folder`` or one of its ancestors should be a folder (so
    ``mkdir -p folder`` fails), or None."""
    existing = nearest_existing(folder)
    return None if existing.is_dir() else existing


def unwritable_folder(folder: str | os.PathLike) -> Path | None:
    """The existing folder (``folder`` itself or the ancestor a ``mkdir -p`` starts from) that
    this process cannot create files in, or None. ``os.access`` answers for this process's
    user and for read-only mounts; root passes every permission check but a read-only mount."""
    existing = nearest_existing(folder)
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        return existing
    return None
