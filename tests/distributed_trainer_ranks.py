"""A rank of the data-parallel trainer test (tests/unit/backends/training/test_trainer_ddp.py), started by torchrun.

``python -m torch.distributed.run --nproc_per_node N tests/distributed_trainer_ranks.py MODEL OUT`` trains the steps
of :func:`steps` and saves, per rank, ``OUT/rank-<r>.pt``: each step's metrics and LoRA gradients (as the optimizer
saw them) and the final LoRA weights. Run without torchrun, it is the one-process reference (rank 0 of 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from backends.training import distributed
from backends.training.config import TrainerConfig
from backends.training.trainer import GRPOTrainer
from tests.fixtures_trainer import record_gradients, synthetic_group

# KL shaping and TIS exercise the reduced step mean and per-token weights; small micro-batches, several per rank.
CONFIG = dict(learning_rate=1e-3, kl_coef=0.1, tis_cap=2.0, micro_batch_tokens=24, max_row_tokens=20, seed=3)


def steps():
    """Three steps: rows of many lengths; the same again (the adapter has moved: KL and ratios are not trivial);
    one row in all (a rank gets none and contributes zeros)."""
    mixed = [synthetic_group([0.0, 1.0, 0.25], prompt=(5, 6, 7, 8, 9)), synthetic_group([2.0, 0.0], completion_len=6),
             synthetic_group([1.0, 0.0, 0.0, 1.0, 0.5], prompt=(11, 12)), synthetic_group([0.3, 0.9], completion_len=9)]
    lonely = synthetic_group([0.0, 1.0], completion_len=17)  # rows of 20 and 21 tokens: the second is dropped
    return [mixed, mixed, [lonely]]


def main(model: str, out: Path) -> None:
    if "RANK" in __import__("os").environ:
        distributed.init_from_torchrun("cpu")
    rank, world_size = distributed.world()
    trainer = GRPOTrainer(model, TrainerConfig(**CONFIG))
    grads = record_gradients(trainer)
    metrics = [trainer.train_step(groups) for groups in steps()]
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    torch.save({"metrics": metrics, "grads": grads, "lora": lora, "world_size": world_size},
               out / f"rank-{rank}.pt")
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
