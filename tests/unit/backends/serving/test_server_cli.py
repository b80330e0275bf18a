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
import pytest

from tests.fixtures_server import assert_keeps_idle_connections
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


@pytest.mark.parametrize("value, engine_value", [(None, None), ("auto", None), ("on", True), ("off", False)])
def test_overlap_decode_reaches_the_engine_config(value, engine_value):
    from backends.serving.cli import _engine_config

    args = _parse(*(["--overlap-decode", value] if value else []))
    assert _engine_config(args).overlap_decode is engine_value


def test_engine_settings_reach_the_engine_config():
    from backends.serving.cli import _engine_config

    config = _engine_config(_parse("--engine", "compile_decode=on", "--engine", "merged-single-adapter=true",
                                   "--engine", "admission_wait_steps=8", "--engine", "prefill_token_budget=auto"))
    assert (config.compile_decode, config.merged_single_adapter, config.admission_wait_steps,
            config.prefill_token_budget) == (True, True, 8, None)


def test_overlap_decode_takes_only_its_three_values(capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--overlap-decode", "yes")
    assert e.value.code == 2 and "--overlap-decode: invalid choice: 'yes'" in capsys.readouterr().err


def _parse(*argv: str) -> argparse.Namespace:
    from backends.serving.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", "tiny-random", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--device", "banana"], "--device 'banana': expected cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "--device cuda:99: "),
    (["--port", "70000"], "--port 70000: a port is 0..65535"),
    (["--port", "-1"], "--port -1: a port is 0..65535"),
    (["--max-loras", "0"], "--max-loras 0: input should be greater than or equal to 1"),
    (["--max-batch-size", "0"], "--max-batch-size 0: input should be greater than or equal to 1"),
    (["--max-seq-len", "3"], "--max-seq-len 3: input should be greater than or equal to 16"),
    (["--max-body-mb", "0"], "--max-body-mb 0.0: must be positive"),
    (["--engine", "compile_decode"], "--engine 'compile_decode': expected FIELD=VALUE"),
    (["--engine", "warp_speed=on"], "no engine setting 'warp_speed'; known: "),
    (["--engine", "admission_wait_steps=-2"], "--engine admission_wait_steps=-2: input should be greater than or"),
    (["--engine", "compile_decode=maybe"], "--engine compile_decode=maybe: input should be a valid boolean"),
    (["--engine", "max_loras=2"], "max_loras has its own flag, --max-loras"),
    (["--engine", "compile_decode=on", "--engine", "compile-decode=off"], "compile_decode is set twice"),
    (["--host", "0.0.0.0"], "binding 0.0.0.0 needs an API key"),
    (["--adapter-root", "http://example.com/adapters"], "adapter root 'http://example.com/adapters'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_arguments_end_in_one_line_and_exit_code_2(tiny_model_path, monkeypatch, capsys, argv, message):
    from backends.serving import cli

    class NeverServe:  # a value that slipped through would otherwise start a server here
        def __init__(self, *a, **kw):
            raise AssertionError(f"{argv} reached serving")

    monkeypatch.setattr(cli, "_server_class", lambda: NeverServe)
    monkeypatch.delenv("TRAJFLOW_API_KEY", raising=False)
    assert cli.serve(_parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trajflow serve: ") and message in err, err


def test_a_bad_device_through_the_trajflow_command_is_one_line(tiny_model_path):
    out = subprocess.run([sys.executable, "-m", "flows.cli", "serve", "--model", "tiny-random", "--device", "banana"],
                         check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr == "trajflow serve: --device 'banana': expected cpu, cuda or cuda:N\n"


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
        assert_keeps_idle_connections(url.removesuffix("/v1"))
        # the socket listens before the address is printed: the connection waits in its backlog for uvicorn
        client = openai.OpenAI(base_url=url, api_key="cli-key", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny-random", max_tokens=4, logprobs=True,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].token_ids and len(reply.choices[0].logprobs.content) == len(reply.choices[0].token_ids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "trajflow serve: stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_server_whose_parent_is_killed_stops(tmp_path):
    """--parent-pid: the launcher is SIGKILLed (as a flow can be) and its server, in a session of its own, goes too."""
    import psutil

    launcher = ("import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-m', 'flows.cli', 'serve', "
                "'--model', 'tiny-random', '--port', '0', '--parent-pid', str(os.getpid())], start_new_session=True, "
                "stdout=subprocess.DEVNULL, stderr=open(sys.argv[1], 'w')); print(p.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", launcher, str(tmp_path / "serve.log")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    if not gone:
        child.kill()
    assert gone, "the server outlived the process that started it"
    assert f"the process that started it (pid {parent.pid}) is gone" in (tmp_path / "serve.log").read_text()
