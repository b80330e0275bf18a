"""The judge once against the real embedded inference server on tiny-random: the plumbing, not the scores.

The embedded engine rejects ``response_format`` (400), so this also exercises the plain-text fallback.
A random model writes nonsense, so the judge is expected to fail to parse and, with ``on_failure="keep"``,
to keep the agent's rewards and mark the group; what is tested is that the request reaches a real
server through the real client and the whole path ends cleanly.
"""

import pytest

from agents.judge import JudgeConfig, judge_group
from tests.fixtures_judge import make_group

server_mod = pytest.importorskip("backends.serving.app", reason="backends.serving.app (embedded inference server) not available")


@pytest.fixture
def embedded_server(tiny_model_path):
    if not hasattr(server_mod, "start_server"):
        pytest.skip("backends.serving.app has no start_server yet")
    handle = server_mod.start_server(model="tiny-random", port=0)
    try:
        yield handle
    finally:
        handle.stop()


async def test_judge_against_embedded_tiny_random_server_keeps_rewards_on_nonsense(embedded_server):
    base_url = getattr(embedded_server, "base_url", None) or embedded_server.url
    if not base_url.rstrip("/").endswith("/v1"):
        base_url = base_url.rstrip("/") + "/v1"
    config = JudgeConfig(model="tiny-random", base_url=base_url, max_tokens=24, temperature=1.0,
                         max_attempts=2, backoff_s=0.0, timeout_s=120, on_failure="keep")
    group = make_group(["4", "5"], rewards=[1.0, 0.0])
    scored = await judge_group(group, config)
    assert len(scored.trajectories) == 2
    assert scored.metrics["judge_requests"] >= 1 and scored.metrics["judge_prompt_tokens"] > 0  # a real model read it
    assert [t.metrics["independent_reward"] for t in scored.trajectories] == [1.0, 0.0]
    if scored.metrics["judge_failed"]:
        assert scored.rewards == [1.0, 0.0]
        assert "failed to score group sum-1" in scored.logs[-1]
    else:  # a random model that happened to write valid JSON: the scores are still validated
        assert all(0.0 <= r <= 1.0 for r in scored.rewards)
