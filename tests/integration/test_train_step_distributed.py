"""`training.gpus: 2`: the train task runs the update under a real torchrun (two gloo ranks on the CPU, tiny-random).

Asserted: step 0 is written by a training process of its own, never by a trainer in the flow's process; a rank killed while
the other waits for its gradients fails the step with a transient error (the task retries it) and commits nothing;
the retry, here as the `train-step` deployment's flow, redoes the update from storage; the stored adapter, optimizer
state and probe record are the one-process update's on the same global batch (up to float32 rounding).
"""

from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load

from backends.policy.checkpoints import training_result
from storage.layout import ADAPTER_WEIGHTS_REL, SCORED, TRAINER_STATE, TRAINER_STATE_DIR
from tasks.run_config import load_config
from tasks.support.distributed_training import RankLostError
from tasks.support.retry_policy import is_transient
from tasks.support.runtime import close_runtime, get_runtime
from tasks.training import initialize_policy_fn, train_policy_fn
from tests.fixtures_trainer import assert_same_adam_updates, synthetic_group

LR = 1e-3


def _config(tmp_path, run: str, *extra: str):
    return load_config("configs/tiny.yaml", [f"storage={tmp_path / 'runs'}", f"run={run}", "training.device=cpu",
                                             f"trainer.learning_rate={LR}", *extra])


def _groups():
    return [synthetic_group([0.0, 1.0, 0.25], prompt=(5, 6, 7, 8, 9)), synthetic_group([2.0, 0.0], completion_len=6),
            synthetic_group([1.0, 0.0, 0.0, 1.0, 0.5], prompt=(11, 12))]


def _adapter(store, step: int) -> dict[str, torch.Tensor]:
    return load(store.get_bytes(step, ADAPTER_WEIGHTS_REL))


def _trainer_state(store, step: int) -> dict:
    return torch.load(io.BytesIO(store.get_bytes(step, f"{TRAINER_STATE_DIR}/{TRAINER_STATE}")), weights_only=True)


def test_distributed_update_under_torchrun_survives_a_killed_rank(prefect_api, tiny_model_path, tmp_path,
                                                                 monkeypatch):
    from flows.train_step import train_step

    ddp = _config(tmp_path, "ddp", "training.gpus=2")
    one = _config(tmp_path, "one")
    try:
        initialize_policy_fn(ddp)
        rt = get_runtime(ddp)
        assert rt._trainer is None and training_result(rt.store, 0) is not None  # written by a training process
        rt.store.write_groups(1, SCORED, _groups())

        monkeypatch.setenv("TRAJFLOW_CRASH_AT", "training-rank1:1")  # SIGKILL rank 1 before its gradients
        with pytest.raises(RankLostError, match=r"training step 1: a training process of 2 died .*SIGKILL"
                                                r".*a retry redoes it from storage") as lost:
            train_policy_fn(ddp, 1)
        assert is_transient(lost.value) and training_result(rt.store, 1) is None
        monkeypatch.delenv("TRAJFLOW_CRASH_AT")

        deployed = ddp.model_copy(update={"training": ddp.training.model_copy(update={"mode": "deployment"})})
        result = train_step(deployed, 1)  # the retry, as the GPU deployment's flow runs it
        assert result["metrics"]["train/data_parallel_ranks"] == 2 and result["probe"]["source"] == "trained-turn"

        initialize_policy_fn(one)  # the reference: one process, in this one, on the same stored batch
        get_runtime(one).store.write_groups(1, SCORED, _groups())
        reference = train_policy_fn(one, 1)
        assert "train/data_parallel_ranks" not in reference["metrics"]
        for key in ("train/loss", "train/grad_norm", "train/trained_tokens", "train/rows"):
            assert result["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-4, abs=1e-7), key
        one_store = get_runtime(one).store
        assert_same_adam_updates(_adapter(rt.store, 1), _adapter(one_store, 1), LR, 1, "ddp vs one process")
        assert result["probe"]["token_ids"] == reference["probe"]["token_ids"]
        assert result["probe"]["logprobs"] == pytest.approx(reference["probe"]["logprobs"], abs=1e-4)
        states = [_trainer_state(rt.store, 1), _trainer_state(one_store, 1)]
        assert states[0]["scheduler"]["last_epoch"] == states[1]["scheduler"]["last_epoch"] == 1
        exp_avg = [s["optimizer"]["state"][0]["exp_avg"] for s in states]  # Adam's first moment: the gradient
        torch.testing.assert_close(exp_avg[0], exp_avg[1], rtol=0, atol=1e-4 * float(exp_avg[1].abs().max()))
    finally:
        close_runtime(ddp)
        close_runtime(one)
