"""benchmarks/rollout_client_cpu.py's parts on a few rollouts: both clients measure, a profile splits into areas."""

import sys

from benchmarks import rollout_client_cpu as bench
from benchmarks.stub_policy import StubPolicyServer


def test_both_clients_measure_and_a_profile_splits_into_areas(tmp_path):
    stub = StubPolicyServer(tokens=bench.COMPLETION_TOKENS, prompt_tokens=bench.PROMPT_TOKENS)
    try:
        profile = str(tmp_path / "run.prof")
        ours = bench.measure(stub.base_url, "policy_client", 8, profile)
        openai_own = bench.measure(stub.base_url, "openai_create", 8, None)
    finally:
        stub.stop()
    for run in (ours, openai_own):
        assert run["rollouts"] == 8 and run["calls"] == 8  # one chat call per arithmetic rollout
        assert run["cpu_ms_per_call"] > 0 and run["cpu_ms_per_rollout"] == run["cpu_ms_per_call"]
    shares = bench.areas(profile)
    assert abs(sum(shares.values()) - 1) < 0.01 and "policy transport + JSON" in shares
    assert sys.modules["agents.client"].__file__.startswith(str(bench.REPO))
