"""The torchrun launch of a distributed update, the parts that need no processes: which GPUs the ranks get, and how
the ranks' records name a failure (tests/integration/test_train_step_distributed.py runs the real thing)."""

import json

import pytest

from tasks.support.distributed_training import RankLostError, _failure, rank_devices, torchrun_argv
from tasks.support.retry_policy import TransientError, is_transient


def test_ranks_get_consecutive_gpus_through_the_visible_ones():
    assert rank_devices("cpu", 2, None) == ("cpu", None)
    assert rank_devices("cuda", 2, None) == ("cuda", "0,1")
    assert rank_devices("cuda:1", 3, None) == ("cuda", "1,2,3")  # inference on cuda:0, training on the rest
    assert rank_devices("cuda:1", 2, "4,5,6") == ("cuda", "5,6")  # this process's cuda:1 is the machine's GPU 5
    with pytest.raises(ValueError, match=r"training.gpus=2 from cuda:1 needs GPUs cuda:1..cuda:2: cuda:1, cuda:2: "
                                         r"CUDA_VISIBLE_DEVICES='3,4' shows 2 GPU"):
        rank_devices("cuda:1", 2, "3,4")


def test_torchrun_only_for_more_than_one_process(tmp_path):
    two = torchrun_argv(2, tmp_path / "c.json", 3, tmp_path)
    assert two[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert two[5:] == ["-m", "tasks.support.distributed_training", str(tmp_path / "c.json"), "3", str(tmp_path)]
    assert torchrun_argv(1, tmp_path / "c.json", 0, tmp_path)[1:] == two[5:7] + [str(tmp_path / "c.json"), "0",
                                                                                   str(tmp_path)]


def _records(tmp_path, *records):
    for r in records:
        (tmp_path / f"rank-{r['rank']}.error.json").write_text(json.dumps(r))
    return tmp_path


def test_a_ranks_own_error_outranks_the_others_lost_peer(tmp_path):
    peer = {"rank": 0, "type": "PeerLostError", "message": "summing the LoRA gradients: another rank stopped",
            "transient": False}
    bug = {"rank": 1, "type": "ValueError", "message": "token id 99999 is outside the vocabulary", "transient": False}
    err = _failure(2, 2, _records(tmp_path, peer, bug), [])
    assert type(err) is RuntimeError and not is_transient(err)
    assert str(err) == "training step 2 failed on rank 1 of 2: ValueError: token id 99999 is outside the vocabulary"


def test_a_transient_rank_error_stays_transient(tmp_path):
    s3 = {"rank": 0, "type": "EndpointConnectionError", "message": "Could not connect", "transient": True}
    err = _failure(4, 2, _records(tmp_path, s3), [])
    assert isinstance(err, TransientError) and "rank 0 of 2: EndpointConnectionError" in str(err)


def test_no_error_of_its_own_means_a_killed_rank(tmp_path):
    peer = {"rank": 0, "type": "PeerLostError", "message": "another rank stopped", "transient": False}
    tail = ["  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 123)  (SIGKILL)"]
    err = _failure(5, 2, _records(tmp_path, peer), tail)
    assert isinstance(err, RankLostError) and is_transient(err)
    assert "training step 5: a training process of 2 died without an error of its own" in str(err)
    assert "torchrun: exitcode : -9 (pid: 123) (SIGKILL)" in str(err)
