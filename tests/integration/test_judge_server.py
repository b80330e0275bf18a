"""The judge once against the real embedded inference server on tiny-random: the plumbing, not the scores.

The embedded engine rejects ``response_format`` (400), so this also exercises the plain-text fallback.
Greedy decoding of a random model writes the same nonsense on every run: the judge fails to parse it on
each attempt and, with ``on_failure="keep"``, keeps the agent's rewards and marks the group. What is
tested is that the request reaches a real server through the real client and the whole path ends
cleanly, on one known path (the success path is tested against scripted servers).
"""

import pytest

from agents.judge import JudgeConfig, judge_group
from backends.serving.app import start_server
from tests.fixtures_judge import make_group


@pytest.fixture
def embedded_server(tiny_model_path):
    handle = start_server(model="tiny-random", port=0)
    try:
        yield handle
    finally:
        handle.stop()


async def test_judge_against_embedded_tiny_random_server_keeps_rewards_on_nonsense(embedded_server):
    config = JudgeConfig(model="tiny-random", base_url=embedded_server.base_url, max_tokens=24, temperature=0.0,
                         max_attempts=2, backoff_s=0.0, timeout_s=120, on_failure="keep")
    group = make_group(["4", "5"], rewards=[1.0, 0.0])
    scored = await judge_group(group, config)
    assert len(scored.trajectories) == 2
    # one request refused for its response_format (400), then two plain-text attempts, each unparseable
    assert scored.metrics["judge_requests"] == 3 and scored.metrics["judge_prompt_tokens"] > 0  # a real model read it
    assert scored.metrics["judge_failed"] == 1
    assert scored.rewards == [1.0, 0.0]
    assert [t.metrics["independent_reward"] for t in scored.trajectories] == [1.0, 0.0]
    assert all(t.metrics["judge_failed"] == 1 and "judge_score" not in t.metrics for t in scored.trajectories)
    assert "failed to score group sum-1" in scored.logs[-1]
    assert "rejected response_format json_schema" in " ".join(scored.logs)
