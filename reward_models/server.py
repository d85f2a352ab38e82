"""Serve a reward over HTTP + JSON, so a reward with conflicting dependencies or its own GPU runs
in another process or machine. Never pickle: media travel as base64 PNG/MP4.

Protocol
- ``GET /health`` -> 200 ``{"status": "ok", "reward": name, "video_native": bool, "max_batch":
  int, "max_request_bytes": int, "max_image_pixels": int, "max_video_frames": int,
  "max_request_pixels": int}`` (no token needed: it reveals no data). The remote client probes it
  to skip dead servers.
- ``POST /score`` with ``{"media": [...], "prompts": [...], "metadata": [...]}`` where media items
  are base64 PNG (images), base64 MP4 or lists of base64 PNG frames (videos); ``metadata`` is
  optional. -> 200 ``{"rewards": [...], "components": {key: [...]}}``; a score that is not finite
  (NaN, +-inf) is sent as ``null`` (JSON has no NaN), which the client reads back as NaN.
- Errors, always a JSON ``{"error": ...}`` saying what and how to fix it, and logged (method, path,
  status, reason) on the ``reward_models.server`` logger:
  400 malformed request (bad JSON, JSON nested too deeply, bad Content-Length, bad media),
  401 missing/wrong ``Authorization: Bearer <token>`` (when a token is configured),
  404 other paths, 408 the body did not arrive within ``request_timeout``,
  411 no Content-Length (chunked bodies are not accepted),
  413 body over ``max_request_bytes`` or media decoding to more than the pixel/frame limits,
  500 the reward raised, 503 ``max_concurrent`` requests already in progress (retry later).

Robustness: every connection gets a socket timeout (``request_timeout``) so a client that stalls
cannot hold a thread; at most ``max_concurrent`` connections are handled at once (others get 503
at once); the decoded size of the media is checked from the PNG header / while the MP4 is decoded
frame by frame, so a small file that expands to a huge image is refused before it fills memory.

Concurrency: requests are parsed and decoded in parallel threads; scoring is serialised by a lock
(one model, one device), in chunks of at most ``max_batch`` samples. Concurrent requests are not
merged into one batch. The server refuses to bind an address other than loopback without a token
unless ``insecure_no_token`` (``--insecure-no-token``) says the network is trusted.

CLI (wired into ``flowgrpo serve-reward`` by ``add_serve_reward_parser``); the token is best given
through the environment variable FLOWGRPO_REWARD_TOKEN (or ``--token-file``), which ``ps`` does
not show::

    FLOWGRPO_REWARD_TOKEN=... flowgrpo serve-reward ocr --host 0.0.0.0 --port 8123
    flowgrpo serve-reward '{"name": "pickscore", "normalise": true}' --device cuda --port 8124
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torch import Tensor

from .loading import load_reward
from .server_limits import HttpError, ServerLimits, decode_media_bounded, decode_source_images

logger = logging.getLogger(__name__)

TOKEN_ENV = "FLOWGRPO_REWARD_TOKEN"
DRAIN_LIMIT = 64 * 1024 * 1024   # unread bodies up to this size are discarded before an error reply
_DIGITS = re.compile(r"[0-9]{1,20}")


def nan_to_none(values) -> list:
    """Scores -> JSON-safe list: every non-finite value (NaN, +-inf) becomes None (null).

    JSON has no NaN or infinity; ``json.dumps(allow_nan=False)`` would raise on them and turn a
    reward's odd score into an HTTP 500 for the whole batch. The client reads null as NaN, which
    the trainer masks like any sample without a score."""
    return [float(v) if math.isfinite(v) else None
            for v in torch.as_tensor(values, dtype=torch.float64).flatten().tolist()]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a literal address or a name) only reaches this machine.

    Names are resolved: every address must be loopback. "" and "0.0.0.0" mean every interface."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                               for info in infos)


def check_bind_allowed(host: str, token: str | None, insecure_no_token: bool) -> None:
    """Refuse a non-loopback address without a token (unless ``insecure_no_token``): anyone who
    can reach the port could then use the reward and the GPU behind it."""
    if token is None and not insecure_no_token and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host!r} without a token: anyone who can reach it could use "
            f"the reward. Set the environment variable {TOKEN_ENV} (or --token-file), bind "
            f"127.0.0.1, or pass --insecure-no-token (insecure_no_token=True) on a trusted "
            f"network")


class RewardServer(ThreadingHTTPServer):
    """An HTTP server scoring with one loaded reward. ``url`` is where it listens.

    ``limits`` bounds what a request may cost (see ServerLimits). Without a token it binds only a
    loopback address, unless ``insecure_no_token``: a reward server on an open port without a
    token lets anyone on the network use the GPU and read the reward."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, reward, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 limits: ServerLimits | None = None, *, insecure_no_token: bool = False):
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty string or None")
        check_bind_allowed(host, token, insecure_no_token)
        self.reward = reward
        self.token = token
        self.limits = limits if limits is not None else ServerLimits()
        self.score_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.limits.max_concurrent)
        if ":" in host.strip("[]"):
            self.address_family = socket.AF_INET6
        super().__init__((host.strip("[]"), port), _Handler)

    # backwards-compatible views of the limits
    @property
    def max_batch(self) -> int:
        return self.limits.max_batch

    @property
    def max_request_bytes(self) -> int:
        return self.limits.max_request_bytes

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    # ---- bounded concurrency ----
    def process_request(self, request, client_address):
        """Start a handler thread only while fewer than ``max_concurrent`` run; else 503."""
        if not self._slots.acquire(blocking=False):
            self._refuse_busy(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse_busy(self, request: socket.socket, client_address) -> None:
        """Answer 503 from the accepting thread, spending at most ~0.4 s: read what the client
        has sent (so that closing does not reset the connection before it reads the answer),
        send the answer, then wait briefly for the client to close."""
        message = (f"server busy: {self.limits.max_concurrent} requests in progress "
                   f"(--max-concurrent); retry later")
        logger.warning("%s: 503 before reading the request: %s", client_address[0], message)
        body = json.dumps({"error": message}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
        try:
            request.settimeout(0.2)
            try:
                request.recv(65536)
            except (socket.timeout, OSError):
                pass
            request.sendall(head.encode() + body)
            request.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline and request.recv(65536):
                pass
        except (socket.timeout, OSError):
            pass
        finally:
            request.close()

    def handle_error(self, request, client_address):
        logger.exception("unexpected error while serving %s", client_address[0])

    # ---- scoring ----
    def score(self, request: dict) -> dict:
        """Score one decoded JSON request; returns the JSON response dict."""
        if not isinstance(request, dict):
            raise HttpError(400, "request body must be a JSON object")
        prompts = request.get("prompts")
        metadata = request.get("metadata")
        media = decode_media_bounded(request.get("media"), self.limits)
        batch = media.shape[0]
        if not isinstance(prompts, list) or len(prompts) != batch \
                or not all(isinstance(p, str) for p in prompts):
            raise HttpError(400, f"prompts must be a list of {batch} strings, one per media item")
        if metadata is None:
            metadata = [{} for _ in range(batch)]
        if not isinstance(metadata, list) or len(metadata) != batch \
                or not all(isinstance(m, dict) for m in metadata):
            raise HttpError(400, f"metadata must be a list of {batch} objects or absent")
        metadata = decode_source_images(metadata, self.limits)   # editing rows
        mains, parts = [], []
        step = self.limits.max_batch
        with self.score_lock:
            for start in range(0, batch, step):
                stop = min(start + step, batch)
                main, comps = self.reward.score_and_components(
                    media[start:stop], prompts[start:stop], metadata[start:stop])
                mains.append(_check_scores(main, stop - start, "the reward's scores"))
                parts.append({k: _check_scores(v, stop - start, f"component {k!r}")
                              for k, v in comps.items()})
        return {"rewards": nan_to_none(torch.cat(mains)),
                "components": {k: nan_to_none(torch.cat([p[k] for p in parts]))
                               for k in parts[0]}}


def _check_scores(values, expected: int, what: str) -> Tensor:
    scores = torch.as_tensor(values).detach().float().cpu().flatten()
    if scores.numel() != expected:
        raise RuntimeError(f"{what} have {scores.numel()} values for {expected} samples")
    return scores


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"

    def setup(self):
        # StreamRequestHandler.setup applies self.timeout to the socket: every read and write
        # then fails after request_timeout seconds without progress instead of blocking forever.
        self.timeout = self.server.limits.request_timeout
        super().setup()

    def log_message(self, format, *args):  # access log: debug only
        logger.debug("%s %s", self.client_address[0], format % args)

    def log_error(self, format, *args):    # http.server's own errors (timeouts, bad request line)
        logger.warning("%s %s %s: %s", self.client_address[0], getattr(self, "command", None),
                       getattr(self, "path", None), format % args)

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        if status >= 400:
            level = logging.ERROR if status >= 500 else logging.WARNING
            logger.log(level, "%s %s %s -> %d: %s", self.client_address[0], self.command,
                       self.path, status, body.get("error"))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        # One request per connection: an idle keep-alive connection would hold one of the
        # max_concurrent slots for request_timeout seconds.
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError as error:   # the client left or stopped reading (timeout)
            logger.warning("%s %s %s: could not send the %d answer: %s", self.client_address[0],
                           self.command, self.path, status, error)

    def do_GET(self):
        if self.path.rstrip("/") != "/health":
            return self._send(404, {"error": f"no such path {self.path!r}; use GET /health or "
                                             f"POST /score"})
        reward = self.server.reward
        limits = self.server.limits
        self._send(200, {"status": "ok", "reward": reward.name,
                         "video_native": bool(getattr(reward, "video_native", False)),
                         "max_batch": limits.max_batch,
                         "max_request_bytes": limits.max_request_bytes,
                         "max_image_pixels": limits.max_image_pixels,
                         "max_video_frames": limits.max_video_frames,
                         "max_request_pixels": limits.max_request_pixels})

    def do_POST(self):
        self._body_read = False
        try:
            if self.path.rstrip("/") != "/score":
                raise HttpError(404, f"no such path {self.path!r}; use POST /score")
            self._check_token()
            request = self._read_json()
            self._send(200, self.server.score(request))
        except HttpError as error:
            self._drain_body()
            self._send(error.status, {"error": str(error)})
        except Exception as error:  # the reward's own failure: report it, keep serving
            logger.exception("%s %s %s: the reward raised", self.client_address[0],
                             self.command, self.path)
            self._send(500, {"error": f"{type(error).__name__}: {error}"})

    def _check_token(self) -> None:
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        expected = f"Bearer {token}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    def _content_length(self) -> int:
        """The announced body size: one non-negative decimal Content-Length, no chunking, at
        most max_request_bytes. Anything else is refused before a byte of the body is read (a
        negative length would otherwise read until the client closes the connection)."""
        self._body_read = True   # until the length is known to be sane, nothing is drained
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "Transfer-Encoding is not supported; send the body with a "
                                  "Content-Length header")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise HttpError(411, "Content-Length header required")
        if len(set(v.strip() for v in values)) != 1 or not _DIGITS.fullmatch(values[0].strip()):
            raise HttpError(400, f"bad Content-Length {', '.join(values)!r}: expected one "
                                  f"non-negative integer")
        size = int(values[0])
        self._body_read = False
        if size > self.server.limits.max_request_bytes:
            raise HttpError(413, f"request of {size} bytes is over the server's limit of "
                                  f"{self.server.limits.max_request_bytes} bytes "
                                  f"(--max-request-mb); send fewer or smaller media per request "
                                  f"(the remote reward's batch_size option)")
        return size

    def _drain_body(self) -> None:
        """Read and discard an unread body (up to DRAIN_LIMIT bytes) before an error reply, so
        that closing the socket does not reset the connection under the client's feet."""
        if self._body_read:
            return
        self._body_read = True
        try:
            remaining = min(int(self.headers.get("Content-Length") or 0), DRAIN_LIMIT)
            while remaining > 0:
                chunk = self.rfile.read1(min(remaining, 1 << 20))
                if not chunk:
                    break
                remaining -= len(chunk)
        except (ValueError, OSError):   # OSError includes the socket timeout
            pass

    def _read_json(self) -> dict:
        size = self._content_length()
        chunks, received = [], 0
        try:
            while received < size:
                chunk = self.rfile.read1(min(size - received, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                received += len(chunk)
        except (socket.timeout, TimeoutError):
            self._body_read = True   # the client stalled: do not wait for the rest again
            raise HttpError(408, f"request body incomplete: {received} of {size} bytes "
                                  f"arrived, then nothing for "
                                  f"{self.server.limits.request_timeout:g}s "
                                  f"(--request-timeout)") from None
        self._body_read = True
        if received < size:
            raise HttpError(400, f"request body incomplete: the connection closed after "
                                  f"{received} of {size} bytes")
        try:
            return json.loads(b"".join(chunks))
        except RecursionError:
            raise HttpError(400, "body is JSON nested too deeply; send a flat "
                                  "{\"media\", \"prompts\", \"metadata\"} object") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise HttpError(400, f"body is not valid JSON: {error}") from None


def make_server(spec: str | dict, host: str = "127.0.0.1", port: int = 0,
                token: str | None = None, limits: ServerLimits | None = None, *,
                insecure_no_token: bool = False, device: str | torch.device = "cpu",
                dtype: torch.dtype | str = torch.float32) -> RewardServer:
    """Load the reward and bind the server (port 0 = any free port); not yet serving. Call
    ``serve_forever()`` (blocking) or ``start_in_thread()``; ``shutdown()`` then
    ``server_close()`` to stop. The host is checked before the (possibly slow) reward loads."""
    check_bind_allowed(host, token, insecure_no_token)
    reward = load_reward(spec, device=device, dtype=dtype)
    return RewardServer(reward, host, port, token, limits, insecure_no_token=insecure_no_token)


def start_in_thread(server: RewardServer, poll_interval: float = 0.1) -> threading.Thread:
    """Serve in a daemon thread; returns the thread. ``shutdown()`` takes up to
    ``poll_interval`` seconds."""
    thread = threading.Thread(target=server.serve_forever, args=(poll_interval,),
                              name=f"reward-server-{server.url}", daemon=True)
    thread.start()
    return thread


def serve(spec: str | dict, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
          limits: ServerLimits | None = None, *, insecure_no_token: bool = False,
          device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32) -> None:
    """Load ``spec`` and serve it until interrupted (blocking)."""
    server = make_server(spec, host, port, token, limits, insecure_no_token=insecure_no_token,
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
    defaults = ServerLimits()
    parser = subparsers.add_parser(
        "serve-reward", help="serve a reward over HTTP+JSON for the 'remote' reward",
        description=f"Serve one reward at POST /score (see reward_models/server.py and "
                    f"docs/remote_rewards.md). Give the token in the environment variable "
                    f"{TOKEN_ENV} (or --token-file): --token shows in ps.")
    parser.add_argument("spec", help="reward name, 'module:Class', a JSON object "
                                     "'{\"name\": ..., ...}' or a .json/.yaml file holding one")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only); any other "
                             "needs a token or --insecure-no-token")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any)")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", default=None,
                       help=f"require 'Authorization: Bearer TOKEN' (visible in ps; prefer the "
                            f"environment variable named by --token-env or --token-file)")
    token.add_argument("--token-file", default=None, help="read the bearer token from this file")
    parser.add_argument("--token-env", default=TOKEN_ENV,
                        help=f"environment variable holding the token when neither --token nor "
                             f"--token-file is given (default {TOKEN_ENV})")
    parser.add_argument("--insecure-no-token", action="store_true",
                        help="allow binding a non-loopback address without a token (only on a "
                             "trusted network)")
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch,
                        help=f"most samples scored per model call (default {defaults.max_batch})")
    parser.add_argument("--max-request-mb", type=float,
                        default=defaults.max_request_bytes / 2**20,
                        help="largest accepted request body in MiB (default 256)")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout,
                        help=f"seconds to wait for the next bytes of a request before answering "
                             f"408 (default {defaults.request_timeout:g})")
    parser.add_argument("--max-concurrent", type=int, default=defaults.max_concurrent,
                        help=f"connections handled at once; more get 503 "
                             f"(default {defaults.max_concurrent})")
    parser.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels,
                        help=f"largest height*width of one image or frame "
                             f"(default {defaults.max_image_pixels})")
    parser.add_argument("--max-video-frames", type=int, default=defaults.max_video_frames,
                        help=f"most frames of one video (default {defaults.max_video_frames})")
    parser.add_argument("--max-request-pixels", type=int, default=defaults.max_request_pixels,
                        help=f"most decoded pixels of one request, all media together "
                             f"(default {defaults.max_request_pixels})")
    parser.add_argument("--device", default="cpu", help="device for the reward (default cpu)")
    parser.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16")
    parser.set_defaults(func=run_serve_reward)
    return parser


def token_from_args(args: argparse.Namespace) -> str | None:
    """The token from --token, else --token-file, else the environment variable --token-env."""
    if args.token:
        return args.token
    if args.token_file:
        with open(os.path.expanduser(args.token_file)) as handle:
            return handle.read().strip() or None
    return os.environ.get(getattr(args, "token_env", TOKEN_ENV) or TOKEN_ENV) or None


def run_serve_reward(args: argparse.Namespace) -> int:
    """Handler of ``flowgrpo serve-reward``."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    limits = ServerLimits(max_batch=args.max_batch,
                          max_request_bytes=int(args.max_request_mb * 2**20),
                          request_timeout=args.request_timeout,
                          max_concurrent=args.max_concurrent,
                          max_image_pixels=args.max_image_pixels,
                          max_video_frames=args.max_video_frames,
                          max_request_pixels=args.max_request_pixels)
    serve(parse_spec(args.spec), args.host, args.port, token_from_args(args), limits,
          insecure_no_token=args.insecure_no_token, device=args.device, dtype=args.dtype)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m reward_models.server SPEC [--host H] [--port N] ...``."""
    parser = argparse.ArgumentParser(prog="flowgrpo")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_reward_parser(subparsers)
    import sys

    args = parser.parse_args(["serve-reward", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
