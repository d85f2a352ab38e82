"""Weights from the Hugging Face hub: one clear error when they cannot be had.

A hub id that cannot be read (no network or ``HF_HUB_OFFLINE`` without a cached copy, a gated
repository whose license the account has not accepted, a wrong or private id, a bad token) would
otherwise surface as a library traceback deep inside ``from_pretrained`` ("... does not appear to
have a file named config.json"), which names neither the cause nor the fix. ``require_hub_file``
resolves one small file of the repository first (from the cache when offline) and turns each
failure into a ``HubAccessError`` (an ``InputError``: the CLI prints it as one line) naming the
id, the likely cause and the fix.
"""
from __future__ import annotations

import os

from huggingface_hub import constants, errors, hf_hub_download

from flowgrpo.errors import InputError

_TRUE = ("1", "true", "yes", "on")


class HubAccessError(InputError):
    """A hub repository's files cannot be read; the message names the id, the cause and the fix."""


def hub_offline() -> bool:
    """Whether hub look-ups are switched off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    if any(os.environ.get(name, "").strip().lower() in _TRUE
           for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    return bool(constants.is_offline_mode())


def _cache_dir() -> str:
    return str(getattr(constants, "HF_HUB_CACHE", "~/.cache/huggingface/hub"))


def _local_alternative(field: str, repo_id: str) -> str:
    return (f"or set {field} to a local folder that holds it (`huggingface-cli download {repo_id} "
            f"--local-dir DIR` where the hub is reachable)")


def access_error(repo_id: str, filename: str, error: BaseException, what: str,
                 field: str) -> HubAccessError:
    """The ``HubAccessError`` for ``error``, raised while reading ``filename`` of hub repository
    ``repo_id`` (``what`` says what it is, ``field`` the config field that names it)."""
    page = f"https://huggingface.co/{repo_id}"
    unreachable = (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)
    if isinstance(error, errors.GatedRepoError):
        cause = ("is a gated repository: this account has not accepted its license, or no "
                 "token is set")
        fix = (f"accept the license at {page} while logged in, then log in here "
               f"(`huggingface-cli login`, or set HF_TOKEN); {_local_alternative(field, repo_id)}")
    elif isinstance(error, errors.RepositoryNotFoundError):
        cause = "was not found on the hub (a wrong id, or a private repository without a token)"
        fix = (f"check the id's spelling ({page}); for a private repository log in "
               f"(`huggingface-cli login` or HF_TOKEN); {_local_alternative(field, repo_id)}")
    elif isinstance(error, errors.HFValidationError):
        cause = f"is neither an existing local folder nor a valid hub id ({error})"
        fix = f"give an existing folder or an 'owner/name' hub id in {field}"
    elif isinstance(error, errors.EntryNotFoundError) and not isinstance(error, unreachable):
        cause = f"has no {filename}, so it is not {what}"
        fix = f"set {field} to the id or folder of {what}"
    elif isinstance(error, errors.HfHubHTTPError) and getattr(
            getattr(error, "response", None), "status_code", None) == 401:
        cause = "refused the token (invalid or expired)"
        fix = f"log in again (`huggingface-cli login`, or set HF_TOKEN); {_local_alternative(field, repo_id)}"
    elif isinstance(error, (*unreachable, OSError, ConnectionError, TimeoutError)):
        why = ("hub access is switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)"
               if hub_offline() else "the hub cannot be reached from this machine")
        cause = f"is not in the local cache ({_cache_dir()}) and {why}"
        fix = (f"download it once where the hub is reachable (`huggingface-cli download "
               f"{repo_id}`, with HF_HOME pointing at a cache this machine reads), "
               f"{_local_alternative(field, repo_id)}; unset HF_HUB_OFFLINE when this machine has "
               f"network")
    else:
        cause = f"cannot be read ({type(error).__name__}: {error})"
        fix = f"check {page} and the network, {_local_alternative(field, repo_id)}"
    return HubAccessError(f"{field}: {what} {repo_id!r} {cause}: {fix}")


def require_hub_file(repo_id: str, filename: str, *, what: str, field: str,
                     subfolder: str | None = None) -> str:
    """The local path of ``filename`` of hub repository ``repo_id`` (downloaded, or from the
    cache when offline); raises ``HubAccessError`` naming the id, the cause and the fix."""
    try:
        return hf_hub_download(repo_id, filename, subfolder=subfolder,
                               local_files_only=hub_offline())
    except Exception as error:    # every failure of the look-up becomes one message
        raise access_error(repo_id, filename, error, what, field) from error
