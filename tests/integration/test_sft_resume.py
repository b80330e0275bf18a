"""A supervised warm start killed mid-way (SIGKILL at a crash point, in a process of its own) resumes from its last
save point: the finished epoch is not redone, and step 0's adapter equals an uninterrupted run's. A finished one is
never run again."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load

from storage.store import RunStore
from tests.fixtures_sft import ARITHMETIC, write_jsonl
from tests.paths import REPO

# 2 conversations, one per optimizer step: 2 steps per epoch, 6 in all; a save point after every step
SETS = ("sft.epochs=3", "sft.batch_size=1", "sft.save_every_steps=1", "sft.learning_rate=1e-2")


def _sft(launcher, tmp_path, root, demos, crash_at=None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRAJFLOW_CRASH_AT", "PREFECT_API_URL")}
    if crash_at:
        env["TRAJFLOW_CRASH_AT"] = crash_at
    argv = ["-m", "flows.sft", "configs/tiny.yaml", "--set", f"storage={root}", "--set", f"sft.data={demos}"]
    for item in SETS:
        argv += ["--set", item]
    out = tmp_path / f"sft-{os.urandom(4).hex()}.log"
    code = launcher.run(argv, env, REPO, out, timeout=300)
    return code, out.read_text()


def _adapter(store: RunStore) -> dict[str, torch.Tensor]:
    return load(store.get_bytes(0, "adapter/adapter_model.safetensors"))


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("single_thread")
def test_killed_sft_resumes_without_redoing_finished_epochs(fork_launcher, tmp_path, monkeypatch):
    demos = write_jsonl(tmp_path / "demos.jsonl", ARITHMETIC[:2])
    root = tmp_path / "runs"
    store = RunStore(str(root), "ci", "tiny")

    code, out = _sft(fork_launcher, tmp_path, root, demos, crash_at="sft-saved:3")  # in the middle of epoch 2
    assert code == -signal.SIGKILL, out[-3000:]
    progress = store.get_json(0, "sft-progress/progress.json")
    assert progress["optimizer_steps"] == 3 and progress["epoch"] == 1 and progress["batch"] == 1
    assert len(progress["epoch_losses"]) == 1  # epoch 1 finished before the kill
    assert not store.exists(0, "training.json") and store.read_run_config() is None
    assert store.list_files(0, "sft-progress/000002/") == []  # an older save point is removed once a newer one is stored
    assert store.list_files(0, "sft-progress/000003/adapter/")

    code, out = _sft(fork_launcher, tmp_path, root, demos)
    assert code == 0, out[-3000:]
    assert "epoch 3/3: loss" in out
    metrics = store.get_json(0, "training.json")["metrics"]
    assert metrics["sft/steps_run"] == 3 and metrics["sft/optimizer_steps"] == 6  # steps 4-6 only
    assert store.list_files(0, "sft-progress/") == ["sft-progress/progress.json"]  # save points gone, step 0's checkpoint holds it

    # the uninterrupted reference, and the finished run once more, here (no process start: the machine is shared)
    from tasks.run_config import load_config
    from tasks.sft import sft_policy_fn
    from tasks.support.runtime import close_runtime

    sets = [f"sft.data={demos}", *SETS]
    reference_config = load_config("configs/tiny.yaml", [f"storage={tmp_path / 'reference'}", *sets])
    try:
        uninterrupted = sft_policy_fn(reference_config)["metrics"]
    finally:
        close_runtime(reference_config)
    assert uninterrupted["sft/steps_run"] == 6
    assert [metrics[f"sft/loss_epoch_{k}"] for k in (1, 2, 3)] == pytest.approx(
        [uninterrupted[f"sft/loss_epoch_{k}"] for k in (1, 2, 3)], rel=1e-5)
    resumed, straight = _adapter(store), _adapter(RunStore(str(tmp_path / "reference"), "ci", "tiny"))
    assert resumed.keys() == straight.keys()
    for name in resumed:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-4, atol=1e-5)  # 1 vs 2 threads

    # finished: asked again, nothing is trained (no trainer is even built) or written
    before = store.get_bytes(0, "training.json")
    config = load_config("configs/tiny.yaml", [f"storage={root}", *sets])
    monkeypatch.setattr("backends.training.trainer.GRPOTrainer.__init__", None)
    try:
        assert sft_policy_fn(config)["metrics"] == metrics
    finally:
        close_runtime(config)
    assert store.get_bytes(0, "training.json") == before
