"""Reward server and remote client on loopback: parity with local scoring, NaN/components over
JSON, token and size checks, clear errors for dead or silent servers, batches spread over several
servers (skipping dead ones) and retries only of failures that may pass."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from reward_models import MultiReward, load_reward
from reward_models.media import decode_media, encode_media
from reward_models.remote import RemoteRewardError
from reward_models.server import ServerLimits, add_serve_reward_parser, make_server, \
    parse_spec, start_in_thread
from tests.helpers import free_port

TOKEN = "s3cret-token"


class Contrast:
    """Per-sample pixel std, NaN for the prompt 'skip'; components 'std' (main) and 'mean'."""

    main_component = "std"

    def components(self, media, prompts, metadata):
        dims = tuple(range(1, media.ndim))
        std = media.std(dim=dims)
        skip = torch.tensor([p == "skip" for p in prompts])
        return {"std": torch.where(skip, torch.full_like(std, math.nan), std),
                "mean": media.mean(dim=dims)}

    def __call__(self, media, prompts, metadata):
        return self.components(media, prompts, metadata)["std"]


def quantised(shape, seed=0) -> torch.Tensor:
    """Random media already on the uint8 grid, so PNG transport is exact."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=generator).float() / 255


@pytest.fixture(scope="module")
def server():
    server = make_server(f"{__name__}:Contrast", port=0, token=TOKEN,
                         limits=ServerLimits(max_batch=3, max_request_bytes=2_000_000))
    start_in_thread(server)
    yield server
    server.shutdown()
    server.server_close()


def remote(server, **options):
    return load_reward({"name": "remote", "url": server.url, "token": TOKEN, "timeout": 20,
                        **options})


def test_round_trip_equals_local_scoring(server):
    media = quantised((7, 3, 12, 10))               # 7 > max_batch: the server chunks
    prompts = [f"p{i}" for i in range(6)] + ["skip"]
    local = load_reward(f"{__name__}:Contrast")
    expected_main, expected_parts = local.score_and_components(media, prompts)
    client = remote(server)
    main, parts = client.score_and_components(media, prompts)
    assert torch.allclose(main[:6], expected_main[:6], atol=1e-6)
    assert math.isnan(main[6]) and math.isnan(expected_main[6])   # NaN survives JSON (null)
    assert set(parts) == {"std", "mean"}
    assert torch.allclose(parts["mean"], expected_parts["mean"], atol=1e-6)


def test_remote_reward_inside_multi_reward_logs_server_components(server):
    multi = MultiReward([{"name": "remote", "url": server.url, "token": TOKEN,
                          "label": "contrast", "weight": 2.0}])
    media = quantised((2, 3, 8, 8), seed=1)
    out = multi(media, ["a", "b"])
    assert set(out) == {"contrast", "contrast.std", "contrast.mean", "total"}
    assert torch.allclose(out["total"], 2 * media.std(dim=(1, 2, 3)), atol=1e-6)


@pytest.mark.parametrize("video_encoding,atol", [("png", 1e-6), ("mp4", 3e-3)])
def test_videos_travel_as_mp4_or_png_frames(server, video_encoding, atol):
    videos = quantised((2, 3, 3, 9, 11), seed=2)       # odd sizes on purpose
    local = load_reward(f"{__name__}:Contrast")(videos, ["a", "b"])
    scores = remote(server, video_encoding=video_encoding)(videos, ["a", "b"])
    assert torch.allclose(scores, local, atol=atol)


def test_media_encoding_round_trip_is_exact_for_png():
    images = quantised((2, 3, 5, 6), seed=3)
    assert torch.equal(decode_media(encode_media(images)), images)
    with pytest.raises(ValueError, match="media\\[0\\]"):
        decode_media(["bm90IGFuIGltYWdl"])


def _post(url: str, body: bytes, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url + "/score", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_wrong_or_missing_token_is_refused(server):
    body = json.dumps({"media": encode_media(quantised((1, 3, 4, 4))), "prompts": ["a"]}).encode()
    assert _post(server.url, body, None)[0] == 401
    assert _post(server.url, body, "wrong")[0] == 401
    status, answer = _post(server.url, body, TOKEN)
    assert status == 200 and len(answer["rewards"]) == 1
    with pytest.raises(RemoteRewardError, match="answered 401: missing or wrong bearer"):
        load_reward({"name": "remote", "url": server.url, "token": "wrong"})(
            quantised((1, 3, 4, 4)), ["a"])


def test_oversized_and_malformed_requests_are_rejected(server):
    big = json.dumps({"media": ["A" * 2_100_000], "prompts": ["a"]}).encode()
    status, answer = _post(server.url, big, TOKEN)
    assert status == 413 and "2000000 bytes" in answer["error"]
    status, answer = _post(server.url, b"{not json", TOKEN)
    assert status == 400 and "not valid JSON" in answer["error"]
    body = json.dumps({"media": encode_media(quantised((2, 3, 4, 4))), "prompts": ["a"]})
    status, answer = _post(server.url, body.encode(), TOKEN)
    assert status == 400 and "prompts must be a list of 2" in answer["error"]


def test_health_reports_the_reward(server):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        health = json.loads(response.read())
    assert health["status"] == "ok" and health["reward"] == "Contrast"
    assert health["max_batch"] == 3


def test_dead_server_gives_a_clear_error_within_the_timeout():
    url = f"http://127.0.0.1:{free_port()}"
    reward = load_reward({"name": "remote", "url": url, "timeout": 1.5, "retries": 5,
                          "backoff": 0.1})
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"reward server at {url}/score unreachable"):
        reward(quantised((1, 3, 4, 4)), ["a"])
    assert time.monotonic() - start < 2.5


def test_silent_server_times_out_within_the_timeout():
    with socket.socket() as listener:      # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        reward = load_reward({"name": "remote", "url": url, "timeout": 1.0, "retries": 2})
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="unreachable"):
            reward(quantised((1, 3, 4, 4)), ["a"])
        assert time.monotonic() - start < 2.0


def test_cli_parser_and_spec_parsing(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_reward_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve-reward", '{"name": "ocr"}', "--port", "9001",
                              "--token", "t", "--max-batch", "4"])
    assert (args.host, args.port, args.token, args.max_batch) == ("127.0.0.1", 9001, "t", 4)
    assert args.func.__name__ == "run_serve_reward"
    assert parse_spec(args.spec) == {"name": "ocr"}
    assert parse_spec("jpeg_compressibility") == "jpeg_compressibility"
    spec_file = tmp_path / "reward.yaml"
    spec_file.write_text("name: pickscore\nnormalise: true\n")
    assert parse_spec(str(spec_file)) == {"name": "pickscore", "normalise": True}


def test_metadata_that_json_cannot_carry_is_a_clear_error(server):
    with pytest.raises(TypeError, match="metadata must be JSON-serialisable"):
        remote(server)(quantised((1, 3, 4, 4)), ["a"], [{"boxes": torch.zeros(2)}])


# ---- several servers ----

class Recorder(Contrast):
    """Contrast that records the prompts it scored, to see which server got which chunk."""

    def __init__(self):
        self.seen: list[str] = []

    def components(self, media, prompts, metadata):
        self.seen.extend(prompts)
        return super().components(media, prompts, metadata)


@pytest.fixture
def servers():
    """Three servers of the same reward (no token, loopback)."""
    started = [make_server(f"{__name__}:Recorder", port=0) for _ in range(3)]
    for server in started:
        start_in_thread(server)
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def _seen(server) -> list[str]:
    return server.reward.inner.seen


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_several_urls_split_the_batch_in_contiguous_chunks_and_keep_the_order(servers):
    media = quantised((10, 3, 6, 5), seed=4)
    prompts = [f"p{i}" for i in range(9)] + ["skip"]
    one_main, one_parts = load_reward({"name": "remote", "url": servers[0].url}) \
        .score_and_components(media, prompts)
    _seen(servers[0]).clear()
    spread = load_reward({"name": "remote", "urls": [s.url for s in servers]})
    main, parts = spread.score_and_components(media, prompts)
    assert torch.equal(main[:9], one_main[:9]) and math.isnan(main[9])
    assert torch.equal(parts["mean"], one_parts["mean"])
    assert [_seen(s) for s in servers] == [prompts[0:4], prompts[4:7], prompts[7:10]]


def test_a_dead_url_is_skipped_with_a_warning_and_the_batch_still_scored(servers):
    dead = dead_url()
    spread = load_reward({"name": "remote", "urls": [servers[0].url, dead, servers[1].url],
                          "timeout": 10})
    media = quantised((5, 3, 4, 4), seed=5)
    with pytest.warns(RuntimeWarning, match=re.escape(dead)):
        scores = spread(media, list("abcde"))
    assert torch.allclose(scores, media.std(dim=(1, 2, 3)), atol=1e-6)
    assert [_seen(s) for s in servers] == [list("abc"), list("de"), []]


def test_a_server_failing_during_the_call_hands_its_chunk_to_the_others(servers):
    with scripted_server([(None, None)]) as flaky:   # answers /health, drops POST /score
        spread = load_reward({"name": "remote", "urls": [flaky.url, servers[0].url],
                              "timeout": 10, "backoff": 0.01})
        media = quantised((4, 3, 4, 4), seed=6)
        with pytest.warns(RuntimeWarning, match=f"{re.escape(flaky.url)}/score failed"):
            scores = spread(media, list("abcd"))
        assert flaky.hits == 1                    # not retried: another server could take it
    assert torch.allclose(scores, media.std(dim=(1, 2, 3)), atol=1e-6)
    assert _seen(servers[0]) == list("cdab")      # its own chunk, then the failed one


def test_all_urls_dead_is_a_clear_error_naming_them():
    urls = [dead_url(), dead_url()]
    reward = load_reward({"name": "remote", "urls": urls, "timeout": 2, "retries": 1,
                          "backoff": 0.05})
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="no reward server reachable among 2") as error:
        reward(quantised((2, 3, 4, 4)), ["a", "b"])
    assert all(url in str(error.value) for url in urls)
    assert time.monotonic() - start < 2.5


@pytest.mark.parametrize("options,message", [
    ({"url": "http://a:1", "urls": ["http://b:1"]}, "give url .* or urls .*, not both"),
    ({"urls": "http://a:1"}, "urls must be a non-empty list"),
    ({"urls": []}, "urls must be a non-empty list"),
    ({"urls": ["http://a:1", "ftp://b"]}, r"urls\[1\] must start with http://"),
    ({"urls": ["http://a:1", "http://a:1/score"]}, "lists http://a:1/score more than once"),
    ({"url": "http://a:1", "token": "t", "token_env": "X"}, "give token or token_env, not both"),
    ({"url": "http://a:1", "health_timeout": 0}, "health_timeout must be > 0"),
])
def test_bad_options_name_the_option_and_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        load_reward({"name": "remote", **options})


def test_token_comes_from_the_environment_variable_named_by_token_env(server, monkeypatch):
    monkeypatch.setenv("FLOWGRPO_REWARD_TOKEN", TOKEN)
    reward = load_reward({"name": "remote", "url": server.url,
                          "token_env": "FLOWGRPO_REWARD_TOKEN"})
    assert reward(quantised((1, 3, 4, 4)), ["a"]).shape == (1,)
    monkeypatch.delenv("FLOWGRPO_REWARD_TOKEN")
    with pytest.raises(ValueError, match="token_env: environment variable "
                                         "'FLOWGRPO_REWARD_TOKEN' is not set; export it"):
        load_reward({"name": "remote", "url": server.url, "token_env": "FLOWGRPO_REWARD_TOKEN"})


# ---- retries: only what may pass ----

class _Scripted(BaseHTTPRequestHandler):
    """Answers GET /health with 200 and each POST with the next (status, body) of its script
    (the last one repeats); status None drops the connection without an answer."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        pass

    def do_GET(self):
        self._answer(200, b'{"status": "ok"}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.hits += 1
        script = self.server.script
        status, body = script.pop(0) if len(script) > 1 else script[0]
        if status is None:
            self.close_connection = True
            return
        self._answer(status, body if isinstance(body, bytes) else json.dumps(body).encode())

    def _answer(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def scripted_server(script: list):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.script, server.hits = list(script), 0
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _scripted_reward(url: str):
    return load_reward({"name": "remote", "url": url, "timeout": 5, "retries": 3,
                        "backoff": 0.01})


@pytest.mark.parametrize("status,body,message", [
    (400, {"error": "prompts must be a list"}, "answered 400: prompts must be a list"),
    (413, {"error": "too large"}, "answered 413: too large"),
    (500, {"error": "ValueError: the reward broke"}, "answered 500: ValueError: the reward"),
])
def test_deterministic_errors_are_not_retried_and_say_what_the_server_answered(
        status, body, message):
    with scripted_server([(status, body)]) as scripted:
        with pytest.raises(RemoteRewardError, match=f"at {re.escape(scripted.url)}/score "
                                                    f"{message}"):
            _scripted_reward(scripted.url)(quantised((1, 3, 4, 4)), ["a"])
        assert scripted.hits == 1


@pytest.mark.parametrize("first", [(503, {"error": "busy"}), (500, b"proxy page"),
                                   (None, None)])
def test_busy_server_proxy_errors_and_dropped_connections_are_retried(first):
    with scripted_server([first, (200, {"rewards": [0.25], "components": {}})]) as scripted:
        scores = _scripted_reward(scripted.url)(quantised((1, 3, 4, 4)), ["a"])
        assert scores.tolist() == [0.25] and scripted.hits == 2


def test_null_scores_and_wrong_lengths_in_answers():
    with scripted_server([(200, {"rewards": [None, 1.0], "components": {"c": [2.0, None]}})]) \
            as scripted:
        main, parts = _scripted_reward(scripted.url).score_and_components(
            quantised((2, 3, 4, 4)), ["a", "b"])
        assert math.isnan(main[0]) and main[1] == 1.0 and math.isnan(parts["c"][1])
    with scripted_server([(200, {"rewards": [1.0]})]) as scripted:
        with pytest.raises(RemoteRewardError, match="sent 1 rewards for 2 samples"):
            _scripted_reward(scripted.url)(quantised((2, 3, 4, 4)), ["a", "b"])
