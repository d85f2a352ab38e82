"""Serve a reward over HTTP + JSON, so a reward with conflicting dependencies or its own GPU runs
in another process or machine. Never pickle: media travel as base64 PNG/MP4.

Protocol
- ``GET /health`` -> 200 ``{"status": "ok", "reward": name, "video_native": bool,
  "max_batch": int, "max_request_bytes": int}`` (no token needed: it reveals no data).
- ``POST /score`` with ``{"media": [...], "prompts": [...], "metadata": [...]}`` where media items
  are base64 PNG (images), base64 MP4 or lists of base64 PNG frames (videos); ``metadata`` is
  optional. -> 200 ``{"rewards": [...], "components": {key: [...]}}``, NaN sent as ``null``.
- Errors: 401 missing/wrong ``Authorization: Bearer <token>`` (when a token is configured),
  411 no Content-Length, 413 body over ``max_request_bytes``, 400 malformed request (the JSON
  ``{"error": ...}`` says what), 404 other paths, 500 the reward raised.

Concurrency: requests are parsed and decoded in parallel threads; scoring is serialised by a lock
(one model, one device), in chunks of at most ``max_batch`` samples. Concurrent requests are not
merged into one batch. Bind to 127.0.0.1 (default) unless the network is trusted; use a token
otherwise.

CLI (wired into ``flowgrpo serve-reward`` by ``add_serve_reward_parser``)::

    flowgrpo serve-reward ocr --port 8123 --token-file ~/.reward_token
    flowgrpo serve-reward '{"name": "pickscore", "normalise": true}' --device cuda --port 8124
"""
from __future__ import annotations

import argparse
import hmac
import json
import math
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from .loading import load_reward
from .media import decode_media

DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_REQUEST_BYTES = 256 * 1024 * 1024
DRAIN_LIMIT = 64 * 1024 * 1024   # unread bodies up to this size are discarded before an error reply


def nan_to_none(values) -> list:
    """Floats with NaN -> JSON-safe list (NaN -> None)."""
    return [None if math.isnan(v) else float(v) for v in torch.as_tensor(values).tolist()]


class _HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class RewardServer(ThreadingHTTPServer):
    """An HTTP server scoring with one loaded reward. ``url`` is where it listens."""

    daemon_threads = True

    def __init__(self, reward, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1 (got {max_request_bytes})")
        if token is not None and not token:
            raise ValueError("token must be a non-empty string or None")
        self.reward = reward
        self.token = token
        self.max_batch = int(max_batch)
        self.max_request_bytes = int(max_request_bytes)
        self.score_lock = threading.Lock()
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def score(self, request: dict) -> dict:
        """Score one decoded JSON request; returns the JSON response dict."""
        if not isinstance(request, dict):
            raise _HttpError(400, "request body must be a JSON object")
        prompts = request.get("prompts")
        metadata = request.get("metadata")
        try:
            media = decode_media(request.get("media"))
        except ValueError as error:
            raise _HttpError(400, str(error)) from None
        batch = media.shape[0]
        if not isinstance(prompts, list) or len(prompts) != batch \
                or not all(isinstance(p, str) for p in prompts):
            raise _HttpError(400, f"prompts must be a list of {batch} strings, one per media item")
        if metadata is None:
            metadata = [{} for _ in range(batch)]
        if not isinstance(metadata, list) or len(metadata) != batch \
                or not all(isinstance(m, dict) for m in metadata):
            raise _HttpError(400, f"metadata must be a list of {batch} objects or absent")
        mains, parts = [], []
        with self.score_lock:
            for start in range(0, batch, self.max_batch):
                stop = start + self.max_batch
                main, comps = self.reward.score_and_components(
                    media[start:stop], prompts[start:stop], metadata[start:stop])
                mains.append(main)
                parts.append(comps)
        return {"rewards": nan_to_none(torch.cat(mains)),
                "components": {k: nan_to_none(torch.cat([p[k] for p in parts]))
                               for k in parts[0]}}


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet by default; errors are in the responses
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.rstrip("/") != "/health":
            return self._send(404, {"error": f"no such path {self.path!r}; use GET /health or "
                                             f"POST /score"})
        reward = self.server.reward
        self._send(200, {"status": "ok", "reward": reward.name,
                         "video_native": bool(getattr(reward, "video_native", False)),
                         "max_batch": self.server.max_batch,
                         "max_request_bytes": self.server.max_request_bytes})

    def do_POST(self):
        self._body_read = False
        try:
            if self.path.rstrip("/") != "/score":
                raise _HttpError(404, f"no such path {self.path!r}; use POST /score")
            self._check_token()
            request = self._read_json()
            self._send(200, self.server.score(request))
        except _HttpError as error:
            self._drain_body()
            self._send(error.status, {"error": str(error)})
        except Exception as error:  # the reward's own failure: report it, keep serving
            self._send(500, {"error": f"{type(error).__name__}: {error}"})

    def _check_token(self) -> None:
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        expected = f"Bearer {token}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise _HttpError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    def _drain_body(self) -> None:
        """Read and discard an unread body (up to DRAIN_LIMIT bytes) before an error reply, so
        that closing the socket does not reset the connection under the client's feet."""
        if self._body_read:
            return
        self._body_read = True
        try:
            remaining = min(int(self.headers.get("Content-Length") or 0), DRAIN_LIMIT)
        except ValueError:
            return
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                break
            remaining -= len(chunk)

    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None:
            raise _HttpError(411, "Content-Length header required")
        try:
            size = int(length)
        except ValueError:
            raise _HttpError(400, f"bad Content-Length {length!r}") from None
        if size > self.server.max_request_bytes:
            raise _HttpError(413, f"request of {size} bytes is over the server's limit of "
                                  f"{self.server.max_request_bytes} bytes; send fewer or smaller "
                                  f"media per request")
        body = self.rfile.read(size)
        self._body_read = True
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _HttpError(400, f"body is not valid JSON: {error}") from None


def make_server(spec: str | dict, host: str = "127.0.0.1", port: int = 0,
                token: str | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, *,
                device: str | torch.device = "cpu",
                dtype: torch.dtype | str = torch.float32) -> RewardServer:
    """Load the reward and bind the server (port 0 = any free port); not yet serving. Call
    ``serve_forever()`` (blocking) or ``start_in_thread()``; ``shutdown()`` then
    ``server_close()`` to stop."""
    reward = load_reward(spec, device=device, dtype=dtype)
    return RewardServer(reward, host, port, token, max_batch, max_request_bytes)


def start_in_thread(server: RewardServer) -> threading.Thread:
    """Serve in a daemon thread; returns the thread."""
    thread = threading.Thread(target=server.serve_forever, name=f"reward-server-{server.url}",
                              daemon=True)
    thread.start()
    return thread


def serve(spec: str | dict, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
          max_batch: int = DEFAULT_MAX_BATCH, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          *, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32) -> None:
    """Load ``spec`` and serve it until interrupted (blocking)."""
    server = make_server(spec, host, port, token, max_batch, max_request_bytes,
                         device=device, dtype=dtype)
    print(f"serving reward {server.reward.name!r} at {server.url} "
          f"(token {'required' if token else 'not required'})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# ---- command line ----

def parse_spec(text: str) -> str | dict:
    """A CLI reward spec: a JSON object, a .json/.yaml file holding one, or a name/path."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"reward spec is not valid JSON: {error}") from None
    if text.endswith((".json", ".yaml", ".yml")) and os.path.isfile(text):
        with open(text) as handle:
            if text.endswith(".json"):
                return json.load(handle)
            import yaml

            return yaml.safe_load(handle)
    return text


def add_serve_reward_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve-reward`` to an argparse subparsers object; sets ``func=run_serve_reward``."""
    parser = subparsers.add_parser(
        "serve-reward", help="serve a reward over HTTP+JSON for the 'remote' reward",
        description="Serve one reward at POST /score (see reward_models/server.py).")
    parser.add_argument("spec", help="reward name, 'module:Class', a JSON object "
                                     "'{\"name\": ..., ...}' or a .json/.yaml file holding one")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any)")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", default=None,
                       help="require 'Authorization: Bearer TOKEN' (visible in ps; prefer "
                            "--token-file or the FLOWGRPO_REWARD_TOKEN environment variable)")
    token.add_argument("--token-file", default=None, help="read the bearer token from this file")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                        help=f"most samples scored per model call (default {DEFAULT_MAX_BATCH})")
    parser.add_argument("--max-request-mb", type=float,
                        default=DEFAULT_MAX_REQUEST_BYTES / 2**20,
                        help="largest accepted request body in MiB (default 256)")
    parser.add_argument("--device", default="cpu", help="device for the reward (default cpu)")
    parser.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16")
    parser.set_defaults(func=run_serve_reward)
    return parser


def run_serve_reward(args: argparse.Namespace) -> int:
    """Handler of ``flowgrpo serve-reward``."""
    token = args.token
    if args.token_file:
        with open(os.path.expanduser(args.token_file)) as handle:
            token = handle.read().strip()
    token = token or os.environ.get("FLOWGRPO_REWARD_TOKEN") or None
    serve(parse_spec(args.spec), args.host, args.port, token, args.max_batch,
          int(args.max_request_mb * 2**20), device=args.device, dtype=args.dtype)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m reward_models.server SPEC [--host H] [--port N] [--token T] ...``."""
    parser = argparse.ArgumentParser(prog="flowgrpo")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_reward_parser(subparsers)
    import sys

    args = parser.parse_args(["serve-reward", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
