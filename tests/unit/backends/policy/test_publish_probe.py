"""The publish probe against the real embedded server: the trainer's own adapter passes, a stale one is refused.

In process (trainer given) and from the probe record in training.json (no trainer: how a flow whose updates run
on a GPU worker checks them).
"""

import math
from pathlib import Path

import openai
import pytest

from agents.client import policy_client
from agents.trajectory import Trajectory, TrajectoryGroup
from backends.policy import checkpoints, probe
from backends.policy.probe import PROBE_MESSAGES, StaleAdapterError
from backends.policy.probe_rule import judge
from backends.policy.publish import local_adapter, publish
from backends.serving.inference_client import InferenceClient
from backends.training.config import TrainerConfig
from backends.training.trainer import GRPOTrainer
from storage.layout import TRAINING_RESULT
from storage.store import RunStore
from tests.fixtures_server import API_KEY

pytestmark = pytest.mark.usefixtures("single_thread")


async def test_probe_passes_the_trained_adapter_and_refuses_a_stale_one(tiny_server, tiny_model_path,
                                                                        random_adapter, tmp_path):
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(seed=0))
    trainer.save_checkpoint(tmp_path / "ckpt")
    inference = InferenceClient(tiny_server.base_url, API_KEY)
    client = openai.AsyncOpenAI(base_url=tiny_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        metrics = await publish(inference, client, "probe-run@0", None, tmp_path / "ckpt" / "adapter",
                                PROBE_MESSAGES, seed=7, trainer=trainer)
        assert metrics["publish/probe_tolerance"] == 0.05  # float32 trainer, nothing configured
        assert metrics["publish/probe_max_abs_diff"] < 1e-3
        assert metrics["publish/probe_mean_abs_diff"] <= metrics["publish/probe_max_abs_diff"]
        # the server is handed some other adapter under the new name: its answers are not the trainer's
        with pytest.raises(StaleAdapterError, match=r"probe-run@1 differ from the trainer's by .*tolerance 0.05"):
            await publish(inference, client, "probe-run@1", None, random_adapter[0], PROBE_MESSAGES, seed=7,
                          trainer=trainer)
    finally:
        await client.close()


def test_float32_keeps_a_flat_tolerance_and_a_configured_one_replaces_the_rule():
    confident = [-0.01] * 4
    assert judge([0.04, 0.0, 0.01, 0.0], confident, "float32", None).passed
    assert not judge([0.06, 0.0, 0.01, 0.0], confident, "float32", None).passed
    assert judge([0.3, 0.3, 0.3, 0.3], confident, "bfloat16", 0.35).passed  # flat: no median bound
    assert not judge([0.01, 0.01, 0.01, 0.02], confident, "bfloat16", 0.01).passed


def test_bf16_noise_on_a_near_tie_passes_and_a_stale_or_wrong_adapter_does_not():
    # the async benchmark's stop (async-h200.md): 16 of 16 greedy tokens agree, one differs by 0.2855; under the
    # former flat 0.25 it failed. Here that token is a near-tie (p = 0.6), the others confident and close.
    recorded = [-0.02] * 15 + [math.log(0.6)]
    near_miss = [0.01, 0.03, 0.0, 0.02, 0.05, 0.01, 0.0, 0.04, 0.02, 0.01, 0.0, 0.03, 0.02, 0.01, 0.0, 0.2855]
    assert max(near_miss) > 0.25
    verdict = judge(near_miss, recorded, "bfloat16", None)
    assert verdict.passed and verdict.worst == 15 and verdict.worst_allowed == pytest.approx(0.125 + 0.4)
    # a confident token (p = 0.98) that far off is not rounding: d log p <= 2 (1 - p) delta
    confident_off = near_miss[:15] + [0.2855]
    assert not judge(confident_off, [-0.02] * 16, "bfloat16", None).passed
    # a stale adapter moves most tokens a little: each within its allowance, the median not
    stale = [0.15] * 10 + [0.05] * 6
    verdict = judge(stale, [math.log(0.5)] * 16, "bfloat16", None)
    assert all(d <= 0.125 + 0.5 for d in stale) and not verdict.passed
    assert "median 0.1500 (tolerance 0.125)" in verdict.describe()
    # a wrong model: far off everywhere
    assert not judge([1.5] * 16, [-0.3] * 16, "bfloat16", None).passed


QUESTIONS = ["What is 2 + 3?", "Say a word."]


async def _groups(client, model: str, rewards) -> list[TrajectoryGroup]:
    """Real rollouts from the server (its own prompt token ids), one group per question."""
    groups = []
    for q, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}] if q == 0 else \
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
        r = await client.chat.completions.create(model=model, messages=messages, n=len(rewards), max_tokens=6,
                                                 seed=10 + q)
        groups.append(TrajectoryGroup([Trajectory(messages_and_choices=[*messages, c], reward=rw)
                                       for c, rw in zip(r.choices, rewards)], scenario_id=f"q{q}"))
    return groups


def _adapter(store: RunStore, step: int) -> Path:
    return local_adapter(store, step, store.get_json(step, TRAINING_RESULT)["adapter"],
                                      store.project, store.run)


async def test_training_json_carries_a_probe_record_that_a_publisher_without_trainer_checks(
        tiny_server, tiny_model_path, random_adapter, tmp_path):
    store = RunStore(str(tmp_path / "runs"), "probe", "rec")
    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(seed=0, learning_rate=0.05))
    inference = InferenceClient(tiny_server.base_url, API_KEY)
    client = policy_client(tiny_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        # step 0 (initialize): PROBE_MESSAGES rendered exactly as the server renders that chat request
        zero = checkpoints.save_checkpoint(store, 0, trainer, {})["probe"]
        served = await client.chat.completions.create(model="tiny-random", messages=PROBE_MESSAGES, max_tokens=1)
        assert zero["source"] == "probe-messages" and zero["prompt_token_ids"] == served.prompt_token_ids
        assert len(zero["token_ids"]) == probe.PROBE_TOKENS and zero["dtype"] == "float32"
        metrics = await publish(inference, client, "rec@0", None, _adapter(store, 0), PROBE_MESSAGES, seed=1,
                                record=zero)
        assert metrics["publish/probe_common_prefix"] == probe.PROBE_TOKENS
        assert metrics["publish/probe_max_abs_diff"] < 1e-3 and metrics["publish/probe_tolerance"] == 0.05

        # step 1: a real update on the server's rollouts; the record continues the shortest trained prompt
        groups = await _groups(client, "rec@0", [0.0, 1.0, 0.0, 1.0])
        result = checkpoints.train_step(store, 1, trainer, groups)
        assert store.get_json(1, TRAINING_RESULT)["probe"] == result["probe"]
        one = result["probe"]
        assert one["source"] == "trained-turn"
        assert one["prompt_token_ids"] == min((t.prompt_token_ids for g in groups for tr in g.trajectories
                                               for t in tr.sampled_turns()), key=len)
        assert one["logprobs"] == pytest.approx(trainer.sequence_logprobs(one["prompt_token_ids"], one["token_ids"]))
        assert result["metrics"]["train/probe_shift"] > 0.05  # a large update: step 0's adapter is now stale
        metrics = await publish(inference, client, "rec@1", None, _adapter(store, 1), PROBE_MESSAGES, seed=1,
                                record=one)
        assert metrics["publish/probe_max_abs_diff"] < 1e-3
        # the server holds step 0's adapter under step 1's name: refused, also under the looser bf16 rule
        for dtype in ("float32", "bfloat16"):
            with pytest.raises(StaleAdapterError, match=r"rec@1-stale differ from the trainer's probe record"):
                await publish(inference, client, "rec@1-stale", None, _adapter(store, 0), PROBE_MESSAGES, seed=1,
                              record={**one, "dtype": dtype})

        # step 2: equal rewards, so no optimizer step (shift ~0: the old remote check would not look at all);
        # some other adapter served under the new name is still refused
        result = checkpoints.train_step(store, 2, trainer, await _groups(client, "rec@1", [1.0, 1.0, 1.0]))
        assert result["metrics"]["train/no_trainable_rows"] == 1.0 and result["metrics"]["train/probe_shift"] < 1e-3
        with pytest.raises(StaleAdapterError, match=r"tolerance 0.05"):
            await publish(inference, client, "rec@2-other", None, random_adapter[0], PROBE_MESSAGES, seed=1,
                          record=result["probe"])
        metrics = await publish(inference, client, "rec@2", None, _adapter(store, 2), PROBE_MESSAGES, seed=1,
                                record=result["probe"])
        assert metrics["publish/probe_max_abs_diff"] < 1e-3
    finally:
        await client.close()
        for name in ("rec@0", "rec@1", "rec@1-stale", "rec@2-other", "rec@2"):
            try:
                await inference.unload_adapter(name)
            except Exception:  # noqa: BLE001 - not loaded
                pass


def test_a_greedy_flip_compares_the_prefix_and_the_first_differing_position():
    record = {"token_ids": [5, 6, 7, 8], "logprobs": [-0.1, -0.2, -0.3, -0.4], "dtype": "bfloat16"}
    # same tokens: all positions compared
    diffs, against, same = probe.compare_with_record(record, [5, 6, 7, 8], [-0.1, -0.25, -0.3, -0.4], [{}] * 4)
    assert same == 4 and diffs == pytest.approx([0, 0.05, 0, 0]) and against == record["logprobs"]
    # a near-tie flip at position 2: positions 0-2 compared (max vs max at 2), plus the server's logprob of the
    # trainer's token there; what follows has another context and is not compared
    diffs, against, same = probe.compare_with_record(record, [5, 6, 9, 1], [-0.1, -0.2, -0.29, -9.0],
                                                     [{}, {}, {9: -0.29, 7: -0.31}, {}])
    assert same == 2 and diffs == pytest.approx([0, 0, 0.01, 0.01]) and against == [-0.1, -0.2, -0.3, -0.3]
    # wrong tokens: the trainer's token is not among the server's top logprobs, so the server gives it less than the
    # least of them (-4.0): at least 3.9 below the trainer's -0.1
    diffs, against, same = probe.compare_with_record(record, [3], [-0.05], [{3: -0.05, 11: -4.0}])
    assert same == 0 and diffs == pytest.approx([0.05, 3.9])
    assert not judge(diffs, against, "bfloat16", None).passed
