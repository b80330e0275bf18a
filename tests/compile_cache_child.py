"""One process of the compile cache test (tests/unit/backends/training/test_compile_cache_processes.py).

``python tests/compile_cache_child.py MODEL STORE_ROOT OUT`` builds a CPU trainer whose logprob kernels are
torch.compile'd and warmed up, with the run store at STORE_ROOT as its compile cache, and writes to OUT (JSON) its
``warm_up_runs`` and this process's inductor counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from backends.training.config import TrainerConfig
from backends.training.trainer import GRPOTrainer
from storage.compile_cache import StoreCompileCache
from storage.store import RunStore

# compile on the CPU ('auto' compiles on CUDA only); a small budget keeps the warm-up's forwards short
CONFIG = dict(compile_logprobs="on", warm_up="on", compile_cache="on", micro_batch_tokens=64, lora_rank=4)


def main(model: str, root: str, out: str) -> None:
    from torch._dynamo.utils import counters

    trainer = GRPOTrainer(model, TrainerConfig(**CONFIG), device="cpu",
                          compile_cache=StoreCompileCache(RunStore(root, "project", "run")))
    Path(out).write_text(json.dumps({"warm_up_runs": trainer.warm_up_runs, "inductor": dict(counters["inductor"])}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
