"""`serve` as a command: a real process on tiny-random, answered through openai, stopped cleanly by SIGTERM."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import openai

from tests.paths import REPO

RUN_SERVE = ("import argparse, sys; from backends.serving.cli import register; p = argparse.ArgumentParser(); "
             "register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")


def test_register_parses_the_documented_flags():
    from backends.serving.cli import register, serve

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "smollm2-135m", "--port", "0", "--api-key", "k", "--device",
                              "cuda", "--max-loras", "2"])
    assert (args.model, args.host, args.port, args.api_key, args.device, args.max_loras) == (
        "smollm2-135m", "127.0.0.1", 0, "k", "cuda", 2)
    assert args.func is serve


def test_importing_the_cli_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, backends.serving.cli; print('torch' in sys.modules)"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_serve_answers_openai_and_stops_on_sigterm(tiny_model_path):
    proc = subprocess.Popen([sys.executable, "-c", RUN_SERVE, "serve", "--model", "tiny-random", "--port", "0",
                             "--api-key", "cli-key"], cwd=REPO, env=dict(os.environ), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    try:
        url, lines = None, []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            m = re.search(r"at (http://\S+/v1)", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        client = openai.OpenAI(base_url=url, api_key="cli-key", max_retries=0)
        for _ in range(100):  # the socket is bound before uvicorn starts accepting
            try:
                reply = client.chat.completions.create(model="tiny-random", max_tokens=4, logprobs=True,
                                                       messages=[{"role": "user", "content": "hi"}])
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        assert reply.choices[0].token_ids and len(reply.choices[0].logprobs.content) == len(reply.choices[0].token_ids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "trajflow serve: stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
