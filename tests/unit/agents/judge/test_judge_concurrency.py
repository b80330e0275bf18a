"""The scoring task judges a step's groups concurrently, bounded, in order, and caches each verdict as it lands."""

import asyncio
import re
import threading
from types import SimpleNamespace

import pytest

from agents.judge import JudgeError
from storage.store import RunStore
from tasks.run_config import load_config
from tasks.scoring import _judge_all
from tests.fixtures_judge import Reply, make_group, scores_json

WAIT_S = 30  # only ever reached when the code under test is wrong


class InFlight:
    """A judge reply that records how many requests overlap, and holds requests on events, never on time.

    ``together``: the first that many requests are each held until all of them are in flight at once
    (a barrier), so overlap is proven rather than hoped for. ``fail_scenario``: that group's requests get
    a 500; with ``last_failure_after`` its final attempt is answered only once that event is set.
    """

    def __init__(self, together: int = 0, fail_scenario: str | None = None, last_failure_after=None,
                 failures: int = 0):
        self.lock, self.now, self.peak, self.seen = threading.Lock(), 0, 0, 0
        self.barrier = threading.Barrier(together, timeout=WAIT_S) if together else None
        self.fail_scenario, self.last_failure_after, self.failures_left = fail_scenario, last_failure_after, failures

    def __call__(self, body):
        with self.lock:
            self.now += 1
            self.seen += 1
            self.peak = max(self.peak, self.now)
            held = self.barrier is not None and self.seen <= self.barrier.parties
        try:
            if held:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    return Reply(500, {"error": {"message": f"never {self.barrier.parties} requests in flight"}})
            prompt = body["messages"][-1]["content"]
            if self.fail_scenario and f"scenario {self.fail_scenario}" in prompt:
                with self.lock:
                    self.failures_left -= 1
                    last = self.failures_left == 0
                if last and self.last_failure_after is not None and not self.last_failure_after.wait(WAIT_S):
                    return Reply(500, {"error": {"message": "the other groups' verdicts never landed"}})
                return Reply(500, {"error": {"message": "judge overloaded"}})
            ids = re.findall(r'<trajectory id="(t\d+)">', prompt)
            answer = re.search(r"\[assistant\] (\d+)", prompt).group(1)  # each group's first answer tags it
            return scores_json({t: (int(answer) + (k == 0)) / 100 for k, t in enumerate(ids)})
        finally:
            with self.lock:
                self.now -= 1


def _count_judge_calls(monkeypatch) -> dict[str, int]:
    """Count the judge_group calls in progress on the client side (the scoring task's bound applies there)."""
    import agents.judge

    calls = {"now": 0, "peak": 0}
    real = agents.judge.judge_group

    async def counted(*args, **kwargs):
        calls["now"] += 1
        calls["peak"] = max(calls["peak"], calls["now"])
        try:
            return await real(*args, **kwargs)
        finally:
            calls["now"] -= 1

    monkeypatch.setattr(agents.judge, "judge_group", counted)
    return calls


def _cached_verdicts(monkeypatch, count: int) -> threading.Event:
    """An event set once ``count`` verdicts are stored in the judge cache."""
    import tasks.scoring
    from storage.judge_cache import StoreJudgeCache

    stored, done, lock = [], threading.Event(), threading.Lock()

    class Counting(StoreJudgeCache):
        def put(self, key, value):
            super().put(key, value)
            with lock:
                stored.append(key)
                if len(stored) >= count:
                    done.set()

    monkeypatch.setattr(tasks.scoring, "StoreJudgeCache", Counting)
    return done


def _runtime(tmp_path, judge_server, **judge):
    overrides = [f"storage={tmp_path}", "judge.model=judge-model", f"judge.base_url={judge_server.base_url}",
                 "judge.use_json_schema=false", "judge.backoff_s=0"] + [f"judge.{k}={v}" for k, v in judge.items()]
    config = load_config("configs/tiny.yaml", overrides)
    return SimpleNamespace(config=config, store=RunStore(config.storage, config.project, config.run), agent=None)


def _groups(n):
    groups = [make_group([str(10 + k), "7", "8"], scenario_id=f"g{k}") for k in range(n)]
    for g in groups:  # the prompt names the scenario only through its content: tag it in the system prompt
        for t in g.trajectories:
            t.messages_and_choices[0] = {"role": "system", "content": f"scenario {g.scenario_id}"}
    return groups


def test_groups_are_judged_concurrently_within_the_bound_and_kept_in_order(tmp_path, judge_server, monkeypatch):
    reply = InFlight(together=2)  # the first two requests are answered only once both are in flight
    judge_server.script(*[reply] * 6)
    calls = _count_judge_calls(monkeypatch)
    rt = _runtime(tmp_path, judge_server, max_concurrency=2)
    groups = _groups(5)
    groups[3].trajectories[1].error = "sandbox died"
    groups[3].trajectories[2].error = "sandbox died"  # one healthy trajectory: nothing to rank, no request
    judged = asyncio.run(_judge_all(rt, groups))
    assert reply.peak == 2 and calls["peak"] == 2 and len(judge_server.chat_requests) == 4
    assert [g.scenario_id for g in judged] == ["g0", "g1", "g2", "g3", "g4"]
    for k in (0, 1, 2, 4):
        assert [t.reward for t in judged[k].trajectories] == pytest.approx([(11 + k) / 100, (10 + k) / 100,
                                                                            (10 + k) / 100])
    assert judged[3] is groups[3]


def test_a_failing_group_fails_the_task_but_the_others_verdicts_are_kept(tmp_path, judge_server, monkeypatch):
    others_cached = _cached_verdicts(monkeypatch, 2)
    # g1 fails twice; its last failure is answered only after g0's and g2's verdicts are stored
    judge_server.script(*[InFlight(fail_scenario="g1", last_failure_after=others_cached, failures=2)] * 4)
    rt = _runtime(tmp_path, judge_server, max_concurrency=4, on_failure="fail", max_attempts=2)
    with pytest.raises(JudgeError, match="group g1 .*judge overloaded"):
        asyncio.run(_judge_all(rt, _groups(3)))
    asked = len(judge_server.chat_requests)
    assert asked == 4  # g0 and g2 once each, g1 twice
    judge_server.script(*[InFlight()] * 3)
    judged = asyncio.run(_judge_all(rt, _groups(3)))  # the task's retry
    assert len(judge_server.chat_requests) == asked + 1  # only g1 is asked again
    assert [g.trajectories[0].metrics["judge_cache_hit"] for g in judged] == [1, 0, 1]
