"""Reward server and remote client on loopback: parity with local scoring, NaN/components over
JSON, token and size checks, and clear errors for dead or silent servers."""
from __future__ import annotations

import argparse
import json
import math
import socket
import time
import urllib.request

import pytest
import torch

from reward_models import MultiReward, load_reward
from reward_models.media import decode_media, encode_media
from reward_models.remote import RemoteRewardError
from reward_models.server import add_serve_reward_parser, make_server, parse_spec, \
    start_in_thread

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
    server = make_server(f"{__name__}:Contrast", port=0, token=TOKEN, max_batch=3,
                         max_request_bytes=2_000_000)
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
    with pytest.raises(RemoteRewardError, match="HTTP 401"):
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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_dead_server_gives_a_clear_error_within_the_timeout():
    url = f"http://127.0.0.1:{_free_port()}"
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
