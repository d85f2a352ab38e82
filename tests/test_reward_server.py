"""Reward server hardening, each against a real server on a loopback port: bad Content-Length,
stalled clients, bounded threads, decompression bombs, non-finite scores, deeply nested JSON,
error logging and the refusal to serve an open interface without a token."""
from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import math
import socket
import time
import urllib.error
import urllib.request

import pytest
import torch
from PIL import Image

from reward_models import load_reward
from reward_models.media import encode_media
from reward_models.server import RewardServer, ServerLimits, add_serve_reward_parser, \
    is_loopback, make_server, run_serve_reward, start_in_thread, token_from_args


class Odd:
    """Scores by prompt: 'inf', '-inf' and 'nan' give those values, others the pixel mean;
    'boom' raises."""

    def __call__(self, media, prompts, metadata):
        if "boom" in prompts:
            raise ValueError("the reward broke")
        special = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
        means = media.flatten(1).mean(1)
        return torch.tensor([special.get(p, float(m)) for p, m in zip(prompts, means)])


@pytest.fixture
def serve():
    """Start servers of ``Odd`` with given limits; all stopped after the test."""
    started = []

    def start(**limits) -> RewardServer:
        server = make_server(f"{__name__}:Odd", port=0, limits=ServerLimits(**limits))
        start_in_thread(server)
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def raw_exchange(server: RewardServer, data: bytes, wait: float = 5.0) -> tuple[int, str, float]:
    """Send raw bytes, keep the connection open, return (status, body, seconds to answer)."""
    with socket.create_connection(server.server_address[:2], timeout=wait) as sock:
        start = time.monotonic()
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        elapsed = time.monotonic() - start
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(), elapsed


def post(server: RewardServer, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(server.url + "/score", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def image_request(width: int = 4, height: int = 4, count: int = 1) -> bytes:
    media = torch.zeros(count, 3, height, width)
    return json.dumps({"media": encode_media(media), "prompts": ["a"] * count}).encode()


@pytest.mark.parametrize("header,status", [
    ("Content-Length: -1", 400),
    ("Content-Length: 12abc", 400),
    ("Content-Length: +5", 400),
    ("Content-Length: 5\r\nContent-Length: 6", 400),
    ("Transfer-Encoding: chunked", 411),
    ("X-Nothing: 1", 411),
])
def test_bad_content_length_is_refused_at_once_without_reading_to_eof(serve, header, status):
    server = serve(request_timeout=5)
    got, body, elapsed = raw_exchange(
        server, f"POST /score HTTP/1.1\r\nHost: x\r\n{header}\r\n\r\n".encode())
    assert got == status and elapsed < 1.0
    assert "Content-Length" in json.loads(body)["error"]


def test_body_size_limit_holds(serve):
    server = serve(max_request_bytes=1000)
    got, body, _ = raw_exchange(
        server, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n" + b"x" * 1001)
    assert got == 413 and "--max-request-mb" in json.loads(body)["error"]


def test_a_stalled_client_is_cut_off_while_others_are_served(serve):
    server = serve(request_timeout=0.5)
    with socket.create_connection(server.server_address[:2], timeout=5) as slow:
        slow.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                     + b"{" * 500)                       # half the body, then silence
        start = time.monotonic()
        assert post(server, image_request())[0] == 200  # served meanwhile
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
        assert time.monotonic() - start < 3
    assert answer.startswith(b"HTTP/1.1 408") and b"500 of 1000 bytes" in answer


def test_threads_are_bounded_and_extra_connections_get_503_at_once(serve):
    server = serve(max_concurrent=1, request_timeout=3)
    with socket.create_connection(server.server_address[:2], timeout=5):   # holds the slot
        for _ in range(50):        # until the server has accepted the holder
            start = time.monotonic()
            try:
                urllib.request.urlopen(server.url + "/health", timeout=5).close()
            except urllib.error.HTTPError as error:
                busy = error
                break
            time.sleep(0.02)
        else:
            pytest.fail("never answered 503")
        assert busy.code == 503 and time.monotonic() - start < 1.0
        assert "--max-concurrent" in json.loads(busy.read())["error"]
    for _ in range(50):                       # the slot comes back when the holder leaves
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
                assert response.status == 200
                break
        except urllib.error.HTTPError:
            time.sleep(0.05)
    else:
        pytest.fail("the slot was not released")


def _png(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_small_png_that_decodes_to_a_huge_image_gets_413(serve):
    server = serve(max_image_pixels=100_000)
    bomb = _png(2000, 2000)                  # ~12 KB on the wire, 4 Mpx decoded
    assert len(bomb) < 50_000
    status, answer = post(server, json.dumps({"media": [bomb], "prompts": ["a"]}).encode())
    assert status == 413
    assert "2000x2000 = 4000000 pixels" in answer["error"]
    assert "--max-image-pixels" in answer["error"]


def test_frame_and_request_pixel_limits(serve):
    server = serve(max_video_frames=3, max_request_pixels=40)
    frames = [_png(2, 2)] * 4
    status, answer = post(server, json.dumps({"media": [frames], "prompts": ["a"]}).encode())
    assert status == 413 and "--max-video-frames" in answer["error"]
    status, answer = post(server, image_request(4, 4, count=3))      # 48 pixels > 40
    assert status == 413 and "--max-request-pixels" in answer["error"]
    assert post(server, image_request(4, 4, count=2))[0] == 200


def test_videos_as_mp4_are_checked_frame_by_frame(serve):
    server = serve(max_video_frames=2)
    video = encode_media(torch.rand(1, 3, 3, 8, 8), "mp4")
    status, answer = post(server, json.dumps({"media": video, "prompts": ["a"]}).encode())
    assert status == 413 and "more than 2 frames" in answer["error"]


def test_non_finite_scores_travel_as_null_and_arrive_as_nan(serve):
    server = serve()
    status, answer = post(server, image_request(count=4)
                          .replace(b'["a", "a", "a", "a"]', b'["inf", "-inf", "nan", "a"]'))
    assert status == 200 and answer["rewards"][:3] == [None, None, None]
    client = load_reward({"name": "remote", "url": server.url})
    scores = client(torch.full((4, 3, 4, 4), 0.2), ["inf", "-inf", "nan", "a"])
    assert torch.isnan(scores[:3]).all() and abs(scores[3] - 0.2) < 0.01


def test_deeply_nested_json_is_a_400(serve):
    server = serve()
    status, answer = post(server, b"[" * 200_000 + b"]" * 200_000)
    assert status == 400 and "nested too deeply" in answer["error"]


def test_every_error_is_logged_with_method_path_status_and_reason(serve, caplog):
    server = serve()
    with caplog.at_level(logging.WARNING, logger="reward_models.server"):
        assert post(server, b"{not json")[0] == 400
        status, answer = post(server, image_request().replace(b'["a"]', b'["boom"]'))
        assert status == 500 and "the reward broke" in answer["error"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("POST /score -> 400: body is not valid JSON" in m for m in messages)
    assert any("POST /score -> 500: ValueError: the reward broke" in m for m in messages)


def test_no_token_on_an_open_interface_is_refused_unless_insecure(monkeypatch):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("")
    reward = load_reward(f"{__name__}:Odd")
    with pytest.raises(ValueError, match="refusing to serve on '0.0.0.0' without a token.*"
                                         "FLOWGRPO_REWARD_TOKEN.*--insecure-no-token"):
        RewardServer(reward, "0.0.0.0", 0)
    RewardServer(reward, "0.0.0.0", 0, token="t").server_close()
    RewardServer(reward, "0.0.0.0", 0, insecure_no_token=True).server_close()

    parser = argparse.ArgumentParser()
    add_serve_reward_parser(parser.add_subparsers(dest="command"))
    monkeypatch.delenv("FLOWGRPO_REWARD_TOKEN", raising=False)
    args = parser.parse_args(["serve-reward", "no-such-reward", "--host", "0.0.0.0"])
    with pytest.raises(ValueError, match="refusing to serve"):   # before loading the reward
        run_serve_reward(args)
    assert args.insecure_no_token is False
    monkeypatch.setenv("FLOWGRPO_REWARD_TOKEN", "from-env")
    assert token_from_args(args) == "from-env"
    assert token_from_args(parser.parse_args(["serve-reward", "x", "--token", "t"])) == "t"


def test_health_reports_the_limits(serve):
    server = serve(max_image_pixels=1234, max_video_frames=5)
    with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
        health = json.loads(response.read())
    assert health["max_image_pixels"] == 1234 and health["max_video_frames"] == 5


@pytest.mark.parametrize("field,value", [("request_timeout", 0), ("max_concurrent", 0),
                                         ("max_image_pixels", -1), ("max_batch", 1.5)])
def test_bad_limits_name_the_field_and_flag(field, value):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{field} \\({flag}\\) must be"):
        ServerLimits(**{field: value})
