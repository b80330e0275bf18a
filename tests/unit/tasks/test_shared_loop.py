"""The process's shared event loop: coroutines run there in the caller's context, and the rollouts of successive steps
share one policy client, so a step reuses the connections of the step before."""

import asyncio
import contextvars
import os
import signal
import threading

import pytest

from tasks.support.shared_loop import on_shared_loop, run_on_shared_loop

WHO = contextvars.ContextVar("who", default="nobody")


def test_runs_in_the_callers_context_and_returns_or_raises_what_the_coroutine_does():
    async def report():
        return WHO.get(), on_shared_loop(), threading.current_thread().name

    async def fail():
        raise ValueError("from the loop")

    results = []

    def caller(name):
        WHO.set(name)
        results.append(run_on_shared_loop(report()))

    threads = [threading.Thread(target=caller, args=(f"task-{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r[0] for r in results) == ["task-0", "task-1", "task-2"]
    assert {r[1:] for r in results} == {(True, "trajflow-shared-loop")}  # one loop for every caller
    with pytest.raises(ValueError, match="from the loop"):
        run_on_shared_loop(fail())

    async def nested():
        inner = report()
        try:
            run_on_shared_loop(inner)
        except RuntimeError as exc:
            return str(exc)

    assert "await the coroutine instead" in run_on_shared_loop(nested())


def test_an_interrupted_caller_cancels_the_coroutine():
    cancelled = threading.Event()

    async def long_work():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    # Ctrl-C: a real SIGINT interrupts the main thread's wait (_thread.interrupt_main would not); Python's own
    # handler, since a server or flow started earlier in this process may have installed another one
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            run_on_shared_loop(long_work())
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert cancelled.wait(5)


def test_rollouts_of_successive_steps_reuse_the_policy_clients_connections(tmp_path, monkeypatch):
    from benchmarks.stub_policy import StubPolicyServer
    from tasks.run_config import load_config
    from tasks.rollouts import run_rollouts_fn
    from tasks.scenarios import sample_scenarios_fn
    from tasks.support.runtime import close_runtime

    stub = StubPolicyServer()
    config = load_config("configs/tiny.yaml", [f"storage={tmp_path / 'runs'}", "run=shared-loop", "inference.backend=url",
                                               f"inference.url={stub.base_url}", "groups_per_step=2", "group_size=4"])
    stub.adapters.update({config.policy(0), config.policy(1)})  # served already: no adapter to load from storage
    try:
        seen = []
        for step in (1, 2):
            result = run_rollouts_fn(config, step, sample_scenarios_fn(config, step))
            assert result["ran_groups"] == 2 and result["failed_rollouts"] == 0
            seen.append(set(stub.clients))
        assert stub.requests >= 16
        assert seen[1] == seen[0]  # step 2 opened no connection: it used step 1's
    finally:
        close_runtime(config)
        stub.stop()
