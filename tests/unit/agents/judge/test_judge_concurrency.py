"""The scoring task judges a step's groups concurrently, bounded, in order, and caches each verdict as it lands."""

import asyncio
import re
import threading
import time
from types import SimpleNamespace

import pytest

from agents.judge import JudgeError
from storage.store import RunStore
from tasks.run_config import load_config
from tasks.scoring import _judge_all
from tests.fixtures_judge import Reply, make_group, scores_json


class InFlight:
    """A judge reply that holds each request a moment and records how many overlap."""

    def __init__(self, fail_scenario: str | None = None):
        self.lock, self.now, self.peak, self.fail_scenario = threading.Lock(), 0, 0, fail_scenario

    def __call__(self, body):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            time.sleep(0.2)
            prompt = body["messages"][-1]["content"]
            if self.fail_scenario and f"scenario {self.fail_scenario}" in prompt:
                return Reply(500, {"error": {"message": "judge overloaded"}})
            ids = re.findall(r'<trajectory id="(t\d+)">', prompt)
            answer = re.search(r"\[assistant\] (\d+)", prompt).group(1)  # each group's first answer tags it
            return scores_json({t: (int(answer) + (k == 0)) / 100 for k, t in enumerate(ids)})
        finally:
            with self.lock:
                self.now -= 1


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


def test_groups_are_judged_concurrently_within_the_bound_and_kept_in_order(tmp_path, judge_server):
    reply = InFlight()
    judge_server.script(*[reply] * 6)
    rt = _runtime(tmp_path, judge_server, max_concurrency=2)
    groups = _groups(5)
    groups[3].trajectories[1].error = "sandbox died"
    groups[3].trajectories[2].error = "sandbox died"  # one healthy trajectory: nothing to rank, no request
    judged = asyncio.run(_judge_all(rt, groups))
    assert reply.peak == 2 and len(judge_server.chat_requests) == 4
    assert [g.scenario_id for g in judged] == ["g0", "g1", "g2", "g3", "g4"]
    for k in (0, 1, 2, 4):
        assert [t.reward for t in judged[k].trajectories] == pytest.approx([(11 + k) / 100, (10 + k) / 100,
                                                                            (10 + k) / 100])
    assert judged[3] is groups[3]


def test_a_failing_group_fails_the_task_but_the_others_verdicts_are_kept(tmp_path, judge_server):
    judge_server.script(*[InFlight(fail_scenario="g1")] * 4)  # exactly what the first try asks
    rt = _runtime(tmp_path, judge_server, max_concurrency=4, on_failure="fail", max_attempts=2)
    with pytest.raises(JudgeError, match="group g1 .*judge overloaded"):
        asyncio.run(_judge_all(rt, _groups(3)))
    asked = len(judge_server.chat_requests)
    assert asked == 4  # g0 and g2 once each, g1 twice
    judge_server.script(*[InFlight()] * 3)
    judged = asyncio.run(_judge_all(rt, _groups(3)))  # the task's retry
    assert len(judge_server.chat_requests) == asked + 1  # only g1 is asked again
    assert [g.trajectories[0].metrics["judge_cache_hit"] for g in judged] == [1, 0, 1]
