"""Client for a reward served by ``flowgrpo serve-reward`` (reward_models/server.py).

``{"name": "remote", "url": "http://127.0.0.1:8123", "token_env": "FLOWGRPO_REWARD_TOKEN"}``
``{"name": "remote", "urls": ["http://a:8000", "http://b:8000"], "token_env": ...}``

Each call is one POST /score per server: images as base64 PNG (lossless after rounding to uint8),
videos as base64 MP4 (near-lossless H.264 4:4:4; ``video_encoding="png"`` sends PNG frames,
exact) and JSON back, null (a NaN or infinite score) read as NaN, which the trainer masks.

Several servers (``urls``): the batch is cut into contiguous chunks, one per healthy server
(sizes differ by at most one), sent concurrently from threads and put back in order, so the
scores equal one server's. Health is probed with GET /health (cached ``health_interval``
seconds); a server that does not answer is skipped with a warning naming it and its share goes to
the others; a server failing during a call is skipped the same way and its chunk re-split over
the rest. With no server reachable a ConnectionError names every URL.

Retries: only failures that may pass are retried, with exponential backoff (``backoff *
2**attempt`` seconds) while the whole call stays within ``timeout``: connection failures,
timeouts, 503 (server busy) and 502/504 (a proxy lost the server), and a 500 without the server's
JSON error. Deterministic answers, 4xx (bad token, request too large, bad input) and a 500
carrying the reward's error, are not retried: a RemoteRewardError says "reward server at URL
answered STATUS: message".

The token: ``token_env`` names an environment variable holding it (preferred: the secret stays
out of configs and ``ps``); ``token`` gives it literally.
"""
from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from .base import register_reward
from .media import encode_media, encode_source_images

RETRY_STATUSES = (502, 503, 504)


class RemoteRewardError(RuntimeError):
    """The reward server answered with an error that retrying will not fix."""


class _Unreachable(Exception):
    """One server failed in a way another attempt (or another server) may not: connection,
    timeout, busy. Carries the reason and the number of attempts made."""

    def __init__(self, reason: str, attempts: int):
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts


def _from_json(values: list) -> Tensor:
    return torch.tensor([math.nan if v is None else float(v) for v in values],
                        dtype=torch.float32)


def _check_url(url, option: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{option} must start with http:// or https:// (got {url!r}); e.g. "
                         f"http://127.0.0.1:8000")
    return url


class _Server:
    """One reward server: its URLs and what the last health probe or request said."""

    def __init__(self, url: str):
        base = url.rstrip("/").removesuffix("/score")
        self.score_url = base + "/score"
        self.health_url = base + "/health"
        self.alive: bool | None = None      # None: never probed
        self.checked_at = -math.inf
        self.last_error = ""


def _split(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) cut into min(parts, stop - start) contiguous ranges, sizes differing by at
    most one (the first ones larger)."""
    size = stop - start
    parts = max(1, min(parts, size))
    base, extra = divmod(size, parts)
    ranges, at = [], start
    for index in range(parts):
        step = base + (1 if index < extra else 0)
        ranges.append((at, at + step))
        at += step
    return ranges


@register_reward("remote")
class RemoteReward:
    """A reward computed by one or several servers.

    ``url`` (one server) or ``urls`` (a list: batches are spread over them) is the server's base
    URL (``/score`` is appended unless already there). ``token_env`` names the environment
    variable holding the bearer token (preferred), or ``token`` gives it. ``timeout`` (seconds)
    bounds a whole call including retries and fail-over; ``retries`` and ``backoff`` shape the
    retries of failures that may pass. ``health_timeout`` bounds one GET /health probe and
    ``health_interval`` is how long (seconds) a probe's answer is trusted before the next."""

    def __init__(self, url: str | None = None, urls: list[str] | None = None,
                 token: str | None = None, token_env: str | None = None,
                 timeout: float = 120.0, retries: int = 3, backoff: float = 0.5,
                 video_encoding: str = "mp4", health_timeout: float = 5.0,
                 health_interval: float = 30.0):
        if url is not None and urls is not None:
            raise ValueError("give url (one server) or urls (a list of servers), not both; "
                             "put every server in urls")
        if url is None and urls is None:
            raise ValueError("reward 'remote' requires option 'url' (one server, e.g. "
                             "http://127.0.0.1:8000) or 'urls' (a list of servers)")
        if urls is not None:
            if isinstance(urls, str) or not isinstance(urls, (list, tuple)) or not urls:
                raise ValueError(f"urls must be a non-empty list of server URLs (got {urls!r});"
                                 f" for one server use url: ... or urls: [...]")
            urls = [_check_url(u, f"urls[{i}]") for i, u in enumerate(urls)]
            normalised = [_Server(u).score_url for u in urls]
            duplicates = sorted({u for u in normalised if normalised.count(u) > 1})
            if duplicates:
                raise ValueError(f"urls lists {duplicates[0]} more than once; list each server "
                                 f"once (to weight one, run more servers)")
        else:
            urls = [_check_url(url, "url")]
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be > 0 seconds (got {timeout!r})")
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ValueError(f"retries must be an int >= 0 (got {retries!r})")
        if not (isinstance(backoff, (int, float)) and backoff >= 0):
            raise ValueError(f"backoff must be >= 0 seconds (got {backoff!r})")
        if video_encoding not in ("mp4", "png"):
            raise ValueError(f"video_encoding must be 'mp4' or 'png' (got {video_encoding!r})")
        if not (isinstance(health_timeout, (int, float)) and health_timeout > 0):
            raise ValueError(f"health_timeout must be > 0 seconds (got {health_timeout!r})")
        if not (isinstance(health_interval, (int, float)) and health_interval >= 0):
            raise ValueError(f"health_interval must be >= 0 seconds (got {health_interval!r}); "
                             f"0 probes before every call")
        if token is not None and token_env is not None:
            raise ValueError("give token or token_env, not both (token_env is preferred: the "
                             "token then stays out of the config)")
        if token_env is not None:
            token = os.environ.get(token_env)
            if not token:
                raise ValueError(f"token_env: environment variable {token_env!r} is not set; "
                                 f"export it with the server's token (or drop token_env if the "
                                 f"server needs none)")
        self.servers = [_Server(u) for u in urls]
        self.url = self.servers[0].score_url        # the one server, or the first
        self.token = token
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.video_encoding = video_encoding
        self.health_timeout = float(health_timeout)
        self.health_interval = float(health_interval)
        self._lock = threading.Lock()

    @property
    def urls(self) -> list[str]:
        """The servers' /score URLs."""
        return [server.score_url for server in self.servers]

    def __call__(self, media: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return self.score_and_components(media, prompts, metadata)[0]

    def components(self, media: Tensor, prompts: list[str],
                   metadata: list[dict]) -> dict[str, Tensor]:
        """The served reward's components ({} when it has none)."""
        return self.score_and_components(media, prompts, metadata)[1]

    def score_and_components(self, media: Tensor, prompts: list[str], metadata: list[dict]
                             ) -> tuple[Tensor, dict[str, Tensor]]:
        batch = media.shape[0]
        if batch == 0:
            return torch.empty(0), {}
        # Editing rows carry their source image as a tensor: sent as a PNG (the server decodes it).
        prompts, metadata = list(prompts), encode_source_images(list(metadata))
        try:   # checked once here, not in each thread, so the error names the cause once
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"remote reward: metadata must be JSON-serialisable (plain numbers, "
                            f"strings, lists, dicts; no NaN) to be sent to {self.url}: "
                            f"{error}") from None
        start_time = time.monotonic()
        deadline = start_time + self.timeout
        live, probes = self._live_servers(deadline)
        attempts = probes
        results: dict[int, tuple[int, Tensor, dict[str, Tensor]]] = {}
        pending = [(0, batch)]
        while pending:
            if not live:
                self._raise_unreachable(attempts, start_time)
            if time.monotonic() >= deadline:
                unscored = ", ".join(f"{lo}..{hi - 1}" for lo, hi in pending)
                raise ConnectionError(
                    f"remote reward: the call to {self.urls} ran out of its timeout of "
                    f"{self.timeout:g}s with samples {unscored} unscored; raise timeout or send "
                    f"smaller batches (batch_size)")
            jobs = [(server, chunk) for pending_range in pending
                    for server, chunk in zip(live, _split(*pending_range, len(live)))]
            can_fail_over = len(live) > 1
            outcomes = self._run(jobs, media, prompts, metadata, deadline, can_fail_over)
            pending = []
            for (server, (lo, hi)), outcome in zip(jobs, outcomes):
                if isinstance(outcome, _Unreachable) and outcome.attempts == 0:
                    pending.append((lo, hi))          # never tried: out of time, not dead
                elif isinstance(outcome, _Unreachable):
                    attempts += outcome.attempts
                    self._mark_dead(server, outcome.reason)
                    if server in live:
                        live.remove(server)
                    pending.append((lo, hi))
                    if live:
                        warnings.warn(f"reward server {server.score_url} failed "
                                      f"({outcome.reason}); its samples {lo}..{hi - 1} go to the "
                                      f"other {len(live)} server(s)", RuntimeWarning,
                                      stacklevel=2)
                else:
                    results[lo] = (hi, *outcome)
        return self._assemble(results, batch)

    # ---- internals ----
    def _run(self, jobs, media, prompts, metadata, deadline, can_fail_over) -> list:
        """Score every (server, (lo, hi)) job, concurrently when there are several; returns per
        job (rewards, components) or an _Unreachable. Deterministic errors propagate."""
        def one(job):
            server, (lo, hi) = job
            try:
                body = json.dumps({"media": encode_media(media[lo:hi], self.video_encoding),
                                   "prompts": prompts[lo:hi], "metadata": metadata[lo:hi]},
                                  allow_nan=False).encode()
                answer = self._post(server, body, deadline, can_fail_over)
                return self._parse(server, answer, hi - lo)
            except _Unreachable as error:
                return error

        if len(jobs) == 1:
            return [one(jobs[0])]
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="remote-reward") as pool:
            futures = [pool.submit(one, job) for job in jobs]
            return [future.result() for future in futures]

    def _parse(self, server: _Server, answer, size: int) -> tuple[Tensor, dict[str, Tensor]]:
        try:
            rewards = _from_json(answer["rewards"])
            parts = {str(k): _from_json(v) for k, v in answer.get("components", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise RemoteRewardError(f"reward server at {server.score_url} sent a malformed "
                                    f"answer: {error!r}") from None
        for key, values in [("rewards", rewards), *parts.items()]:
            if values.shape != (size,):
                raise RemoteRewardError(f"reward server at {server.score_url} sent "
                                        f"{values.numel()} {key} for {size} samples")
        return rewards, parts

    def _assemble(self, results, batch: int) -> tuple[Tensor, dict[str, Tensor]]:
        order = sorted(results)
        keys = set(results[order[0]][2])
        for lo in order:
            if set(results[lo][2]) != keys:
                raise RemoteRewardError(f"the reward servers {self.urls} disagree on the "
                                        f"components ({sorted(keys)} vs "
                                        f"{sorted(results[lo][2])}); serve the same reward "
                                        f"on every server")
        rewards = torch.cat([results[lo][1] for lo in order])
        assert rewards.shape == (batch,), "chunks must cover the batch exactly"
        return rewards, {k: torch.cat([results[lo][2][k] for lo in order]) for k in keys}

    def _mark_dead(self, server: _Server, reason: str) -> None:
        with self._lock:
            server.alive = False
            server.last_error = reason
            server.checked_at = time.monotonic()

    def _probe(self, server: _Server, deadline: float) -> bool:
        """GET /health: any HTTP answer (even 503 busy or 404) means the server is there.
        Returns whether the server has just gone from answering (or unknown) to silent."""
        timeout = min(self.health_timeout, deadline - time.monotonic())
        alive, reason = False, "no time left to probe"
        if timeout > 0:
            try:
                with urllib.request.urlopen(server.health_url, timeout=timeout) as response:
                    response.read()
                alive, reason = True, ""
            except urllib.error.HTTPError as error:
                error.close()
                alive, reason = True, ""
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                reason = _reason(error)
        with self._lock:
            was_alive = server.alive
            server.alive, server.last_error = alive, reason
            server.checked_at = time.monotonic()
        return not alive and was_alive is not False

    def _live_servers(self, deadline: float) -> tuple[list[_Server], int]:
        """The servers answering /health (probing those whose answer is older than
        ``health_interval``), waiting with backoff while none does; and the probes made."""
        probes = 0
        for attempt in range(self.retries + 1):
            now = time.monotonic()
            stale = [s for s in self.servers if attempt > 0 or s.alive is None
                     or now - s.checked_at >= self.health_interval]
            if len(stale) <= 1:
                went_silent = [self._probe(server, deadline) for server in stale]
            else:
                with ThreadPoolExecutor(max_workers=len(stale),
                                        thread_name_prefix="remote-reward-health") as pool:
                    went_silent = list(pool.map(lambda s: self._probe(s, deadline), stale))
            probes += 1
            live = [s for s in self.servers if s.alive]
            if live:   # warned here, in the caller's thread, where warning filters apply
                for server, silent in zip(stale, went_silent):
                    if silent:
                        warnings.warn(f"reward server {server.score_url} does not answer "
                                      f"{server.health_url} ({server.last_error}); it is "
                                      f"skipped and its share of each batch goes to the other "
                                      f"{len(live)} server(s) until it answers",
                                      RuntimeWarning, stacklevel=3)
            if live:
                return live, probes
            sleep = min(self.backoff * 2 ** attempt, deadline - time.monotonic())
            if attempt == self.retries or sleep < 0 or time.monotonic() >= deadline:
                break
            time.sleep(sleep)
        return [], probes

    def _raise_unreachable(self, attempts: int, start: float):
        elapsed = time.monotonic() - start
        if len(self.servers) == 1:
            server = self.servers[0]
            raise ConnectionError(
                f"reward server at {server.score_url} unreachable: {attempts} attempt(s) in "
                f"{elapsed:.1f}s (timeout {self.timeout:g}s), last error: {server.last_error}. "
                f"Is `flowgrpo serve-reward` running there?")
        listing = "; ".join(f"{s.score_url} ({s.last_error})" for s in self.servers)
        raise ConnectionError(
            f"no reward server reachable among {len(self.servers)} after {elapsed:.1f}s "
            f"(timeout {self.timeout:g}s): {listing}. Is `flowgrpo serve-reward` running there?")

    def _post(self, server: _Server, body: bytes, deadline: float, can_fail_over: bool) -> dict:
        """POST one chunk to one server. Retries what may pass (see the module docstring) while
        within ``deadline``; a connection failure is not retried when another server can take
        the chunk. Raises RemoteRewardError (deterministic) or _Unreachable."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last_error = "no time left"
        attempts = 0
        for attempt in range(self.retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempts += 1
            request = urllib.request.Request(server.score_url, data=body, headers=headers,
                                             method="POST")
            busy = False
            try:
                with urllib.request.urlopen(request, timeout=remaining) as response:
                    raw = response.read()
                try:
                    return json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
                    raise RemoteRewardError(f"reward server at {server.score_url} sent a "
                                            f"malformed answer: {error}") from None
            except urllib.error.HTTPError as error:
                message, from_server = _error_message(error)
                if error.code not in RETRY_STATUSES and not (error.code == 500
                                                             and not from_server):
                    raise RemoteRewardError(f"reward server at {server.score_url} answered "
                                            f"{error.code}: {message}") from None
                last_error = f"HTTP {error.code}: {message}"
                busy = error.code == 503
            except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
                last_error = _reason(error)
            if can_fail_over and not busy:
                break
            sleep = min(self.backoff * 2 ** attempt, deadline - time.monotonic())
            if attempt < self.retries and sleep > 0:
                time.sleep(sleep)
        raise _Unreachable(last_error, attempts)


def _reason(error: BaseException) -> str:
    reason = getattr(error, "reason", None) or error
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return f"timed out ({reason})" if str(reason) else "timed out"
    return str(reason) or type(reason).__name__


def _error_message(error: urllib.error.HTTPError) -> tuple[str, bool]:
    """The server's JSON ``error`` text and whether there was one (a reward server's own answer,
    as opposed to a proxy's page)."""
    try:
        message = json.loads(error.read()).get("error")
        if isinstance(message, str) and message:
            return message, True
    except Exception:
        pass
    finally:
        error.close()
    return str(error.reason or ""), False
