"""The training flow with ``sft``: step 0 is the SFT'd adapter, published and probed, then GRPO steps continue from it;
the run's identity includes the demonstrations (their content) and the SFT settings."""

from __future__ import annotations

import pytest
from safetensors.torch import load

from storage.store import RunStore
from tasks.run_config import load_config
from tests.fixtures_sft import ARITHMETIC, write_jsonl


def test_step_0_is_sfted_published_and_grpo_continues(prefect_api, tmp_path, tiny_model_path, demo_file):
    from flows.train import train

    config = load_config("configs/tiny.yaml", [
        f"storage={tmp_path / 'runs'}", "agent=tests.flow_agents:EchoAgent", "steps=1", "groups_per_step=2",
        "group_size=2", f"sft.data={demo_file}", "sft.epochs=2", "sft.learning_rate=1e-2", "sft.batch_size=2"])
    assert train(config)["step"] == 1
    store = RunStore(config.storage, config.project, config.run)
    assert store.committed_steps() == [0, 1]
    m0 = store.read_manifest(0).metrics
    assert m0["sft/loss"] == m0["sft/loss_epoch_2"] and m0["sft/optimizer_steps"] == 4  # 2 epochs x 4 / 2
    assert m0["publish/probe_max_abs_diff"] <= m0["publish/probe_tolerance"]  # served is what SFT trained
    training0 = store.get_json(0, "training.json")
    assert training0["sft"]["data_sha256"] and training0["sft"]["settings"]["epochs"] == 2
    lora_b = [w for k, w in load(store.get_bytes(0, "adapter/adapter_model.safetensors")).items() if "lora_B" in k]
    assert any(w.abs().sum() > 0 for w in lora_b)  # not the untrained LoRA (B = 0)
    assert store.exists(1, "training.json") and "train/reward" in store.read_manifest(1).metrics
    assert store.read_run_config()["sft"]["data"] == str(demo_file)

    # another sft setting, no sft at all, or another file behind the same path: refused before anything runs
    with pytest.raises(ValueError, match="different sft"):
        train(config.model_copy(update={"sft": config.sft.model_copy(update={"epochs": 3}), "steps": 2}))
    with pytest.raises(ValueError, match="different sft"):
        train(config.model_copy(update={"sft": None, "steps": 2}))
    write_jsonl(demo_file, ARITHMETIC)
    with pytest.raises(ValueError, match=r"sft.data changed since step 0 was trained on it \(content sha256"):
        train(config.model_copy(update={"steps": 2}))
    assert store.committed_steps() == [0, 1]
