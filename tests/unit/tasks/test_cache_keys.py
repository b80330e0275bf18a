"""The cache-key rule (tasks/support/cache_keys.py): readable keys, the rollouts' naming their sampling policy step."""

from __future__ import annotations

from tasks.run_config import load_config
from tasks.support.cache_keys import cache_key_fn, sampled_cache_key_fn


def test_rollout_keys_name_the_policy_step_the_pipeline_assigns():
    sync = load_config("configs/tiny.yaml", [])
    ahead = load_config("configs/tiny.yaml", ["pipeline.max_off_policy_steps=2"])
    key = sampled_cache_key_fn("rollouts")
    assert key(None, {"config": sync, "step": 5}) == "tiny/step-00005/rollouts-v1-policy-00004"
    assert key(None, {"config": ahead, "step": 5}) == "tiny/step-00005/rollouts-v1-policy-00002"
    assert key(None, {"config": ahead, "step": 2}) == "tiny/step-00002/rollouts-v1-policy-00000"
    # the other stages' keys do not depend on the pipeline
    assert cache_key_fn("scoring")(None, {"config": ahead, "step": 5}) == "tiny/step-00005/scoring-v1"
