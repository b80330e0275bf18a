"""One training step's parts (backends/policy/checkpoints.py) on a real tiny-random trainer and a local run store:
each part's seconds in the metrics, adding up to the stage; the probe record verifies the step's sampled completions
of its prompt and records what the token-by-token record would; the policy shift reuses its logprobs."""

import pytest

from agents.trajectory import SampledTurn, Trajectory, TrajectoryGroup
from backends.policy import checkpoints, probe
from backends.training.config import TrainerConfig
from backends.training.trainer import GRPOTrainer
from storage.layout import TRAINING_RESULT
from storage.store import RunStore

pytestmark = pytest.mark.usefixtures("single_thread")
PARTS = ("train/groups_s", "train/update_s", "train/policy_shift_s", "train/save_s", "train/probe_record_s")


def _group(prompt, completions, rewards):
    return TrajectoryGroup([Trajectory(messages_and_choices=[
        {"role": "user", "content": "q"},
        SampledTurn(message={"role": "assistant", "content": ""}, prompt_token_ids=list(prompt),
                    token_ids=list(c), logprobs=[-2.0] * len(c))], reward=r) for c, r in zip(completions, rewards)])


def test_a_step_times_its_parts_and_its_probe_record_verifies_the_sampled_answers(tiny_model_path, random_adapter,
                                                                                   tmp_path):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig(seed=0, learning_rate=1e-12))  # moves no argmax
    set_peft_model_state_dict(trainer.model, load_file(random_adapter[0] / "adapter_model.safetensors"))
    store = RunStore(str(tmp_path / "runs"), "parts", "run")
    checkpoints.initialize(store, lambda: trainer)
    short = [5, 17, 42, 7]  # the probe prompt: the shortest trained one
    greedy, _ = trainer.greedy_continuation(short, probe.PROBE_TOKENS)
    sampled = [greedy[:3] + [(greedy[3] + 1) % trainer.vocab_size, 9], greedy[:12], [1, 2, 3]]
    groups = [_group(short, sampled, [0.0, 1.0, 0.5]), _group([5, 17, 42, 7, 99, 3, 8], [[4, 4], [6]], [1.0, 0.0])]
    assert probe.probe_drafts(groups, short) == sampled

    result = checkpoints.train_step(store, 1, trainer, groups)
    m = result["metrics"]
    assert m["train/no_trainable_rows"] == 0.0
    assert all(m[k] >= 0 for k in PARTS)
    parts = sum(m[k] for k in PARTS)
    assert parts <= m["train/stage_s"] < parts + 0.1  # the parts are the stage
    # the record: the same tokens and logprobs as decoding one token per forward, in fewer forwards:
    # greedy[:12] verified in one forward, 3 more tokens at most one forward each, then the scoring pass
    record = result["probe"]
    assert record["prompt_token_ids"] == short and record["token_ids"] == greedy
    token_by_token, forwards = probe.probe_record(trainer, short)
    assert record == token_by_token and forwards == probe.PROBE_TOKENS + 1
    assert 2 <= m["train/probe_forwards"] <= 1 + (probe.PROBE_TOKENS - 13) + 1
    # the policy shift is read off the record: sampled[1] starts the greedy continuation (no forward of its own);
    # without a record it scores the first trainable turn
    assert m["train/probe_shift"] == max(abs(a + 2.0) for a in record["logprobs"][:12])
    first = trainer.sequence_logprobs(short, sampled[0])
    assert checkpoints.policy_shift(trainer, groups) == max(abs(a + 2.0) for a in first)
    # finished: the stored result comes back untouched, nothing is timed again
    assert checkpoints.train_step(store, 1, trainer, groups) == store.get_json(1, TRAINING_RESULT) == result
