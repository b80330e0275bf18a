"""Host time a GRPO step spends before its first GPU kernel, piece by piece, on the CPU.

``GRPOTrainer._train_step`` first runs PREPARE on the host (``build_rows``, ``assign_aggregation_weights``, the
trainer's ``_check_vocabulary``, ``plan_bins``), then packs micro-batch 0 (``make_micro_batch``) before anything runs
on the GPU; later micro-batches are packed while the GPU runs the previous one, but their host time still competes
with kernel launches. This times each piece on the rows of ``benchmarks/training.py``'s ``synthetic_groups`` at the
H200 benchmark's shape (vocabulary 151936, ~96k tokens a step in rows of 2k-16k tokens, 24k-token micro-batches).

``make_micro_batch`` runs with ``--device`` ("cpu": its host work, the Python/numpy over the rows and the host
tensors; "cuda": that plus ``pin_memory`` and the asynchronous copies, as the trainer runs it). The time is the host's,
until the call returns (the copies may still run; the device is synchronised after, untimed).

Per step (``--steps`` steps, each its own rows), each piece runs ``--repeats`` times and its median wall time is kept;
the summary is the median over the steps. ``critical_path`` = PREPARE + the first micro-batch's pack.

    python benchmarks/step_prepare_host.py --label before --out benchmarks/results/step-prepare-host-cpu.json
    python benchmarks/step_prepare_host.py --label after --out benchmarks/results/step-prepare-host-cpu.json
    python benchmarks/step_prepare_host.py --device cuda --label after --out step-prepare-host-h200.json  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.training.losses import assign_aggregation_weights  # noqa: E402
from backends.training.packing import make_micro_batch, plan_bins  # noqa: E402
from backends.training.token_rows import build_rows  # noqa: E402
from backends.training.trainer import GRPOTrainer  # noqa: E402
from benchmarks.training import synthetic_groups  # noqa: E402

VOCAB = 151936
PIECES = ("build_rows", "assign_aggregation_weights", "check_vocabulary", "plan_bins", "prepare",
          "make_micro_batch_first", "make_micro_batch_all", "critical_path")


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def _timed_pack(rows, device):
    mb, ms = _timed(lambda: make_micro_batch(rows, device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return mb, ms


def one_run(groups, max_row_tokens: int, budget: int, device: str) -> dict[str, float]:
    """Milliseconds of each piece, in the trainer's order, over one step's groups."""
    ms: dict[str, float] = {}
    rows, ms["build_rows"] = _timed(lambda: build_rows(groups, max_row_tokens=max_row_tokens)[0])
    _, ms["assign_aggregation_weights"] = _timed(lambda: assign_aggregation_weights(rows, "sequence_mean"))
    # the trainer's own check, on a stand-in that holds only what it reads
    trainer = SimpleNamespace(vocab_size=VOCAB)
    _, ms["check_vocabulary"] = _timed(lambda: GRPOTrainer._check_vocabulary(trainer, rows))
    bins, ms["plan_bins"] = _timed(lambda: plan_bins([len(r) for r in rows], budget))
    packs = [_timed_pack([rows[i] for i in b], device)[1] for b in bins]
    ms["prepare"] = sum(ms[k] for k in PIECES[:4])
    ms["make_micro_batch_first"] = packs[0]
    ms["make_micro_batch_all"] = sum(packs)
    ms["critical_path"] = ms["prepare"] + packs[0]
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("--steps", 3), ("--repeats", 7), ("--step-tokens", 98304), ("--min-len", 2048),
                          ("--max-len", 16384), ("--budget", 24576)):  # budget: micro-batch tokens
        ap.add_argument(name, type=int, default=default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--label", default="after", help="the key this run is stored under (e.g. before / after)")
    ap.add_argument("--out", default=None, help="JSON file; other labels already in it are kept")
    args = ap.parse_args()
    torch.set_num_threads(1)

    steps = []
    for step in range(args.steps):
        groups = synthetic_groups(step, vocab=VOCAB, step_tokens=args.step_tokens, min_len=args.min_len,
                                  max_len=args.max_len)
        rows = build_rows(groups, max_row_tokens=args.max_len)[0]
        runs = [one_run(groups, args.max_len, args.budget, args.device) for _ in range(args.repeats)]
        median = {k: statistics.median(r[k] for r in runs) for k in PIECES}
        steps.append({"step": step, "rows": len(rows), "tokens": sum(len(r) for r in rows),
                      "trained_tokens": sum(r.trained_tokens for r in rows),
                      "micro_batches": len(plan_bins([len(r) for r in rows], args.budget)),
                      "median_ms": {k: round(v, 2) for k, v in median.items()}})
        print(json.dumps(steps[-1]), flush=True)
    setup = {"vocab": VOCAB, "step_tokens": args.step_tokens, "min_len": args.min_len, "max_len": args.max_len,
             "budget": args.budget, "steps": args.steps, "repeats": args.repeats, "device": args.device,
             "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
             "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}}
    run = {"median_ms": {k: round(statistics.median(s["median_ms"][k] for s in steps), 2) for k in PIECES},
           "setup": setup, "steps": steps}

    path = Path(args.out) if args.out else None
    out = json.loads(path.read_text()) if path is not None and path.exists() else {}
    out.setdefault("runs", {})[args.label] = run
    labels = list(out["runs"])
    out["summary"] = {k: {label: out["runs"][label]["median_ms"][k] for label in labels} for k in PIECES}
    print(json.dumps(out["summary"], indent=1))
    if path is not None:
        path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
