"""Placement: which devices of one machine the inference server(s) and the training ranks of a run use."""

import pytest

from tasks.run_config import load_config
from tasks.support.placement import cuda_visible, describe, devices, placement, placement_problems
from tasks.support.vllm_launch import vllm_config


def _config(*overrides):
    return load_config(None, list(overrides))


def test_a_setting_and_a_count_name_consecutive_devices():
    assert devices("cpu", 2, gpus_visible=2) == ["cpu", "cpu"]
    assert devices("auto", 1, gpus_visible=0) == ["cpu"]
    assert devices("auto", 2, gpus_visible=2) == ["cuda:0", "cuda:1"]
    assert devices("cuda", 1, gpus_visible=2) == ["cuda:0"]
    assert devices("cuda:1", 3, gpus_visible=4) == ["cuda:1", "cuda:2", "cuda:3"]


def test_split_and_shared_placements_on_two_gpus():
    split = _config("inference.device=cuda:0", "training.device=cuda:1")
    assert placement(split, 2) == {"inference": ["cuda:0"], "training": ["cuda:1"]}
    assert placement_problems(split, 2) == []
    assert describe(split, 2) == "inference cuda:0; training cuda:1 (split)"
    assert describe(_config(), 2) == "inference cuda:0; training cuda:0 (shared)"
    assert describe(_config("training.mode=deployment"), 2) == "inference cuda:0 (one stage here)"
    assert placement(_config("training.mode=deployment"), 2)["training"] == []  # the worker's GPUs, not ours
    assert placement(_config("inference.backend=url", "inference.url=http://127.0.0.1:1/v1"), 2)["inference"] == []
    assert placement_problems(_config("training.device=cuda:1", "training.gpus=2"), 2) == [
        "training.device cuda:1 with training.gpus=2 needs cuda:1, cuda:2, but this machine shows 2 GPU(s)"]


def test_child_processes_see_their_gpus_through_ours():
    assert cuda_visible(["cuda:1"], None) == "1"
    assert cuda_visible(["cuda:0", "cuda:1"], "6,7") == "6,7"
    assert cuda_visible(["cuda:1"], "GPU-aaa,GPU-bbb") == "GPU-bbb"
    with pytest.raises(ValueError, match=r"cuda:2: CUDA_VISIBLE_DEVICES='0,1' shows 2 GPU\(s\)"):
        cuda_visible(["cuda:2"], "0,1")


def test_vllm_is_started_on_the_inference_gpu(monkeypatch, tiny_model_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    config = _config("base_model=tiny-random", "inference.backend=vllm", "inference.device=cuda:1")
    assert vllm_config(config, None, device="cuda:1").env["CUDA_VISIBLE_DEVICES"] == "3"
    own = _config("base_model=tiny-random", "inference.backend=vllm", "inference.vllm_env={CUDA_VISIBLE_DEVICES: '0'}")
    assert vllm_config(own, None, device="cuda:1").env["CUDA_VISIBLE_DEVICES"] == "0"  # the user's own setting wins
    assert "CUDA_VISIBLE_DEVICES" not in vllm_config(config, None, device="cpu").env
