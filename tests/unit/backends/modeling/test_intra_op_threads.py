"""The probe-sized passes of the trainer run on one intra-op thread on the CPU, and leave torch's setting as it was."""

import pytest
import torch

from backends.modeling.intra_op_threads import single_thread_on_cpu
from tests.fixtures_trainer import torch_threads


@pytest.fixture
def two_threads():
    with torch_threads(2):
        yield


def test_probe_passes_run_on_one_thread_and_restore_the_setting(tiny_model_path, two_threads):
    from backends.training.config import TrainerConfig
    from backends.training.trainer import GRPOTrainer

    trainer = GRPOTrainer(str(tiny_model_path), TrainerConfig())
    seen: list[int] = []
    embeddings = trainer.model.get_input_embeddings()  # every pass, decode steps included, starts here
    hook = embeddings.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        tokens, _ = trainer.greedy_continuation([5, 17, 42], 3)
        trainer.sequence_logprobs([5, 17, 42], tokens)
    finally:
        hook.remove()
    assert len(seen) == 5 and set(seen) == {1}  # prefill, 2 decode steps, 2 scoring passes: 1 thread each
    assert torch.get_num_threads() == 2


def test_the_setting_is_restored_after_an_error_and_left_alone_off_the_cpu(two_threads):
    with pytest.raises(RuntimeError, match="inside"):
        with single_thread_on_cpu("cpu"):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2
    with single_thread_on_cpu(torch.device("meta")):  # any device but the CPU: torch's setting stands
        assert torch.get_num_threads() == 2
