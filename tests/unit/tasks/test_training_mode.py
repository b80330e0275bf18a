"""training.mode auto: a trainer process only where rollouts run beside the update on a GPU (tasks/training.py)."""

from __future__ import annotations

import pytest

from tasks.run_config import load_config
from tasks.training import in_child, training_mode


def config(*sets: str):
    return load_config("configs/tiny.yaml", list(sets))


@pytest.mark.parametrize("sets, on_gpu, mode", [
    ((), True, "local"),  # synchronous loop: nothing runs beside the update
    (("pipeline.max_off_policy_steps=1",), False, "local"),  # CPU: a second process would copy the base weights
    (("pipeline.max_off_policy_steps=1",), True, "process"),
    (("pipeline.max_off_policy_steps=2", "training.device=cuda:1"), True, "process"),
    (("pipeline.max_off_policy_steps=1", "training.gpus=2"), True, "local"),  # torchrun's ranks are processes already
    (("training.mode=process",), False, "process"),
    (("pipeline.max_off_policy_steps=1", "training.mode=local"), True, "local"),
    (("pipeline.max_off_policy_steps=1", "training.mode=deployment"), True, "deployment"),
])
def test_auto_resolves_by_pipeline_and_device(sets, on_gpu, mode, monkeypatch):
    # this machine has no GPU: resolve_device answers as it would on one
    monkeypatch.setattr("backends.modeling.devices.resolve_device",
                        lambda device: ("cuda:0" if device == "auto" else device) if on_gpu else "cpu")
    cfg = config(*sets)
    assert training_mode(cfg) == mode
    assert in_child(cfg) == (mode == "process" and cfg.training.gpus == 1)


def test_auto_is_the_default():
    assert config().training.mode == "auto"
