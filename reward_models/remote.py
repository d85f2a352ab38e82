"""Client for a reward served by ``flowgrpo serve-reward`` (reward_models/server.py).

``{"name": "remote", "url": "http://127.0.0.1:8123", "token_env": "FLOWGRPO_REWARD_TOKEN"}``

Each call is one POST /score: images as base64 PNG (lossless after rounding to uint8), videos as
base64 MP4 (near-lossless H.264 4:4:4; ``video_encoding="png"`` sends PNG frames, exact) and JSON
back, NaN as null. Connection failures, timeouts and 5xx answers are retried with exponential
backoff (``backoff * 2**attempt`` seconds) while the total time stays within ``timeout``; then a
ConnectionError names the URL. 4xx answers (bad token, request too large, bad input) are not
retried: a RemoteRewardError carries the server's message.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
import urllib.error
import urllib.request

import torch
from torch import Tensor

from .base import register_reward
from .media import encode_media


class RemoteRewardError(RuntimeError):
    """The reward server answered with an error that retrying will not fix."""


def _from_json(values: list) -> Tensor:
    return torch.tensor([math.nan if v is None else float(v) for v in values],
                        dtype=torch.float32)


@register_reward("remote")
class RemoteReward:
    """A reward computed by a server. ``url`` is the server's base URL (``/score`` is appended
    unless already there); ``token`` or the environment variable named by ``token_env`` gives the
    bearer token; ``timeout`` (seconds) bounds a whole call including retries."""

    def __init__(self, url: str, token: str | None = None, token_env: str | None = None,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 0.5,
                 video_encoding: str = "mp4"):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https:// (got {url!r})")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds (got {timeout})")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0 (got {retries!r})")
        if backoff < 0:
            raise ValueError(f"backoff must be >= 0 seconds (got {backoff})")
        if video_encoding not in ("mp4", "png"):
            raise ValueError(f"video_encoding must be 'mp4' or 'png' (got {video_encoding!r})")
        if token is None and token_env is not None:
            token = os.environ.get(token_env)
            if not token:
                raise ValueError(f"token_env: environment variable {token_env!r} is not set")
        base = url.rstrip("/")
        self.url = base if base.endswith("/score") else base + "/score"
        self.token = token
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.video_encoding = video_encoding

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return self.score_and_components(media, prompts, metadata)[0]

    def components(self, media: Tensor, prompts: list[str],
                   metadata: list[dict]) -> dict[str, Tensor]:
        """The served reward's components ({} when it has none)."""
        return self.score_and_components(media, prompts, metadata)[1]

    def score_and_components(self, media: Tensor, prompts: list[str], metadata: list[dict]
                             ) -> tuple[Tensor, dict[str, Tensor]]:
        try:
            body = json.dumps({"media": encode_media(media, self.video_encoding),
                               "prompts": list(prompts), "metadata": list(metadata)},
                              allow_nan=False).encode()
        except (TypeError, ValueError) as error:
            raise TypeError(f"remote reward: metadata must be JSON-serialisable (plain numbers, "
                            f"strings, lists, dicts; no NaN) to be sent to {self.url}: "
                            f"{error}") from None
        answer = self._post(body)
        try:
            rewards = _from_json(answer["rewards"])
            parts = {k: _from_json(v) for k, v in answer.get("components", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise RemoteRewardError(f"reward server at {self.url} sent a malformed answer: "
                                    f"{error}") from None
        return rewards, parts

    def _post(self, body: bytes) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        start = time.monotonic()
        deadline = start + self.timeout
        last_error = "no attempt made"
        attempts = 0
        for attempt in range(self.retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=remaining) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as error:
                message = _error_message(error)
                if error.code < 500:
                    raise RemoteRewardError(f"reward server at {self.url} refused the request "
                                            f"(HTTP {error.code}): {message}") from None
                last_error = f"HTTP {error.code}: {message}"
            except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as error:
                last_error = str(getattr(error, "reason", error))
            sleep = min(self.backoff * 2 ** attempt, deadline - time.monotonic())
            if attempt < self.retries and sleep > 0:
                time.sleep(sleep)
        raise ConnectionError(
            f"reward server at {self.url} unreachable: {attempts} attempt(s) in "
            f"{time.monotonic() - start:.1f}s (timeout {self.timeout:g}s), last error: "
            f"{last_error}. Is `flowgrpo serve-reward` running there?")


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        return json.loads(error.read()).get("error", "")
    except Exception:
        return error.reason or ""
