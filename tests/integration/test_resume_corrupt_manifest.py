"""A run whose last step's manifest.json was truncated resumes past it: the step is redone and committed.

Before, `trajflow runs` and the resume skipped the step while the publisher's hash-checked download
raised on the same manifest, so every rerun failed at publish. In-process flow on a real Prefect API
(the test harness), tiny-random, on a local folder and on S3 (moto); the second run starts with an
empty adapter cache, as on a fresh machine.
"""

from __future__ import annotations

import fsspec
import pytest

from storage.store import RunStore
from tasks.run_config import load_config


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_resume_gets_past_a_truncated_manifest(kind, prefect_api, tmp_path, tiny_model_path, monkeypatch, request):
    from flows.train import train

    root = str(tmp_path / "runs") if kind == "local" else f"s3://{request.getfixturevalue('s3_bucket')}/runs"
    config = load_config("configs/tiny.yaml", [f"storage={root}", "agent=tests.flow_agents:EchoAgent", "steps=1",
                                               "groups_per_step=2", "group_size=2"])
    monkeypatch.setenv("TRAJFLOW_CACHE", str(tmp_path / "cache-first-machine"))
    train(config)
    store = RunStore(config.storage, config.project, config.run)
    assert store.committed_steps() == [0, 1]
    first = store.read_manifest(1)
    adapter = store.get_bytes(1, "adapter/adapter_model.safetensors")

    manifest = f"{store.step_url(1)}/manifest.json"
    with fsspec.open(manifest, "rb") as f:
        data = f.read()
    with fsspec.open(manifest, "wb") as f:
        f.write(data[: len(data) // 2])  # truncated, as by a disk that filled up or a half-copied bucket

    monkeypatch.setenv("TRAJFLOW_CACHE", str(tmp_path / "cache-fresh-machine"))
    result = train(config)
    assert result["step"] == 1
    fresh = RunStore(config.storage, config.project, config.run)
    assert fresh.committed_steps() == [0, 1]
    redone = fresh.read_manifest(1)
    assert redone.files == first.files  # the stored update was reused, not trained again
    assert fresh.get_bytes(1, "adapter/adapter_model.safetensors", verify=True) == adapter
    fs, steps = fsspec.core.url_to_fs(store.step_url(1))
    fs.invalidate_cache()
    aside = [p for p in fs.ls(steps, detail=False) if "/manifest.json.corrupt-" in p]
    assert len(aside) == 1 and fs.cat_file(aside[0]) == data[: len(data) // 2]  # moved aside, with a logged reason
    assert train(config)["step"] == 1  # and a third run has nothing left to do
