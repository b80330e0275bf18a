"""Data-parallel GRPO steps: two gloo processes under a real torchrun take the one-process update."""

import os
import subprocess
import sys

import pytest
import torch

from backends.training.distributed import split_rows
from tests.fixtures_trainer import assert_same_adam_updates, assert_same_gradients
from tests.paths import REPO


def test_rows_are_split_by_token_budget():
    assert split_rows([5, 50, 20, 30, 10], 2) == [[1, 4], [0, 2, 3]]  # 60 vs 55 tokens
    assert split_rows([7, 7, 7], 3) == [[0], [1], [2]]
    assert split_rows([9], 2) == [[0], []]  # fewer rows than ranks: a rank with none
    assert split_rows([], 2) == [[], []]
    shares = split_rows(list(range(1, 41)), 4)
    assert sorted(i for s in shares for i in s) == list(range(40))
    loads = [sum(i + 1 for i in s) for s in shares]
    assert max(loads) - min(loads) <= 1
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        split_rows([1], 0)


def test_ddp_two_gloo_ranks_take_the_one_process_update(tiny_model_path, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = str(REPO / "tests" / "distributed_trainer_ranks.py")
    ddp = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            script, str(tiny_model_path), str(two)], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    single = subprocess.run([sys.executable, script, str(tiny_model_path), str(one)], cwd=REPO, env=env,
                            capture_output=True, text=True)
    out, _ = ddp.communicate(timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    assert ddp.returncode == 0, out[-3000:]
    ref = torch.load(one / "rank-0.pt", weights_only=False)
    ranks = [torch.load(two / f"rank-{r}.pt", weights_only=False) for r in (0, 1)]
    assert ref["world_size"] == 1 and all(r["world_size"] == 2 for r in ranks)
    for r in ranks:  # each rank, its own half of the rows: the summed gradients and the step are one process's
        assert_same_gradients(r["grads"], ref["grads"], "ddp vs one process")
        assert_same_adam_updates(r["lora"], ref["lora"], 1e-3, 3, "ddp vs one process")
        for got, want in zip(r["metrics"], ref["metrics"]):
            for key in ("loss", "grad_norm", "entropy", "trained_tokens", "tokens", "rows", "kl_policy_ref",
                        "mismatch_kl", "ratio_min", "ratio_max", "clip_fraction", "tis_weight_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
            assert got["data_parallel_ranks"] == 2
    for name, w in ranks[0]["lora"].items():  # the ranks stay identical: same gradient, same AdamW step
        assert torch.equal(w, ranks[1]["lora"][name]), name
    last = [r["metrics"][2] for r in ranks]
    assert last[0]["rows"] == 1 and last[0]["micro_batches"] == 1  # one row: rank 1 had none and sent zeros
    assert ranks[0]["metrics"][0]["micro_batches"] >= 4  # several micro-batches per rank were summed
