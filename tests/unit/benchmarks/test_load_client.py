"""benchmarks/load_client.py: a pass spread over client processes sends every request once and merges exactly, and
the instant server replays a recorded answer and stream."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx

from backends.serving.managed_process import free_port
from benchmarks import load_client
from benchmarks.inference_vllm import median_pass
from benchmarks.instant_server import events
from benchmarks.load_client import Load, closed_loop, default_processes
from tests.paths import REPO

TOKENS = 4


def _recorded(tmp_path):
    choice = {"index": 0, "text": "abcd", "token_ids": list(range(TOKENS)), "finish_reason": "length"}
    answer = tmp_path / "answer.json"
    answer.write_text(json.dumps({"choices": [choice], "usage": {"completion_tokens": TOKENS}}))
    chunks = [{"choices": [{"index": 0, "text": "x", "token_ids": [t]}]} for t in range(TOKENS)]
    chunks.append({"choices": [], "usage": {"completion_tokens": TOKENS}})
    stream = tmp_path / "stream.sse"
    stream.write_text("".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n")
    return answer, stream


def _serve(tmp_path):
    answer, stream = _recorded(tmp_path)
    port = free_port("127.0.0.1")
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.instant_server", "--port", str(port), "--answer",
                               str(answer), "--stream", str(stream)], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.05)


def test_passes_in_one_and_in_several_processes_count_every_request_once(tmp_path):
    server, url = _serve(tmp_path)
    try:
        load = Load("t", 6, 20, 8, TOKENS)
        for processes in (1, 3):
            for stream in (False, True):
                latencies, ttfts, tokens, wall = asyncio.run(closed_loop(url, load, "p", 20, 100, True, stream,
                                                                         processes))
                assert len(latencies) == 20 and tokens == 20 * TOKENS and wall > 0
                assert len(ttfts) == (20 if stream else 0)
                assert max(latencies) <= wall + 0.5
    finally:
        server.terminate()
        server.wait(10)


def test_a_failing_client_process_fails_the_pass(tmp_path):
    load = Load("t", 4, 4, 8, TOKENS)
    try:
        asyncio.run(closed_loop(f"http://127.0.0.1:{free_port('127.0.0.1')}", load, "p", 4, 100, True, False, 2))
    except RuntimeError as e:
        assert "client processes failed" in str(e)
    else:
        raise AssertionError("a pass against no server succeeded")


def test_default_processes_and_the_median_pass():
    assert [default_processes(c) for c in (1, 8, 16, 17, 64, 256, 1024)] == [1, 1, 1, 2, 4, 8, 8]
    assert load_client.MAX_PROCESSES == 8
    passes = [{"v": 3}, {"v": 1}, {"v": 2}, {"v": 5}]
    assert median_pass(passes, lambda p: p["v"]) == {"v": 2}
    assert median_pass(passes[:3], lambda p: p["v"]) == {"v": 2}


def test_recorded_stream_splits_into_events():
    sse = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    assert events(sse) == [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]


def test_measure_repeats_passes_and_reports_the_median_one(tmp_path):
    from benchmarks.inference_vllm import Passes, measure

    server, url = _serve(tmp_path)
    rows = []
    try:
        asyncio.run(measure("instant", url, [Load("t", 4, 8, 8, TOKENS)], 100, True, rows.append, Passes(3, 2)))
    finally:
        server.terminate()
        server.wait(10)
    (row,) = rows
    assert "error" not in row and row["client_processes"] == 2
    assert len(row["passes"]) == 3 and len(row["stream_passes"]) == 3
    assert row["tokens_per_s"] == sorted(p["tokens_per_s"] for p in row["passes"])[1]
    assert row["ttft_s"] == sorted((p["ttft_s"] for p in row["stream_passes"]), key=lambda t: t["p50"])[1]
    assert row["output_tokens"] == 8 * TOKENS and row["stream_requests"] == 4


def test_an_unknown_load_name_is_refused():
    import pytest

    from benchmarks.inference_vllm import main

    with pytest.raises(SystemExit):
        main(["--smoke", "--loads", "c64"])  # the smoke loads are c1, c4, grpo
