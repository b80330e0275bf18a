"""Learning proof: does GRPO make the default agent better? Validation reward before and after, 3+ seeds.

Runs the real training flow (``python -m flows.train``) once per seed on the given config (default:
``configs/default.yaml``, SmolLM2-135M-Instruct on the arithmetic task), with an evaluation of the base
policy at step 0 and of the trained policy at the last step on the same validation scenarios. Writes
``<out>.json`` (per-seed curves, before/after, mean and spread) and ``<out>.png`` (train and
validation reward per step, every seed).

    .venv/bin/python benchmarks/learning.py --seeds 0 1 2 --steps 8 --out benchmarks/results/learning_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_seed(config: str, seed: int, steps: int, storage: str, extra: list[str]) -> dict:
    run = f"learn-s{seed}"
    cmd = [sys.executable, "-m", "flows.train", config, "--set", f"seed={seed}", "--set", f"run={run}",
           "--set", f"steps={steps}", "--set", f"storage={storage}", "--set", "eval_at_start=true",
           "--set", f"eval_every={steps}", *[a for s in extra for a in ("--set", s)]]
    started = time.perf_counter()
    env = {**os.environ, "PREFECT_HOME": tempfile.mkdtemp(prefix="learn-home-"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    from storage.store import RunStore
    from tasks.run_config import load_config

    project = load_config(config, extra).project
    store = RunStore(storage, project, run)
    history = [{"step": s, **store.read_manifest(s).metrics} for s in store.committed_steps()]
    return {"seed": seed, "wall_s": time.perf_counter() - started,
            "val_before": history[0]["val/reward"], "val_after": history[-1]["val/reward"],
            "train_reward": [h.get("train/reward") for h in history[1:]],
            "val_correct_before": history[0].get("val/correct"), "val_correct_after": history[-1].get("val/correct"),
            "step_s": [h.get("time/step_s") for h in history[1:]]}


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in results:
        steps = list(range(1, len(r["train_reward"]) + 1))
        line, = ax.plot(steps, r["train_reward"], "o-", alpha=0.7, label=f"train reward, seed {r['seed']}")
        ax.plot([0, len(steps)], [r["val_before"], r["val_after"]], "s--", color=line.get_color(), alpha=0.9,
                label=f"val reward, seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", dest="extra", action="append", default=[], help="extra config overrides")
    parser.add_argument("--out", default="benchmarks/results/learning_cpu")
    parser.add_argument("--storage", default=None, help="storage root (reuse one to resume finished seeds)")
    parser.add_argument("--parallel", action="store_true", help="run the seeds as parallel processes")
    args = parser.parse_args()
    storage = args.storage or tempfile.mkdtemp(prefix="learning-runs-")
    if args.parallel:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(args.seeds)) as pool:
            results = list(pool.map(lambda s: run_seed(args.config, s, args.steps, storage, args.extra), args.seeds))
    else:
        results = [run_seed(args.config, s, args.steps, storage, args.extra) for s in args.seeds]
    deltas = [r["val_after"] - r["val_before"] for r in results]
    import torch
    import transformers

    summary = {
        "command": "python benchmarks/learning.py " + " ".join(sys.argv[1:]),
        "config": args.config, "overrides": args.extra, "steps": args.steps, "seeds": args.seeds,
        "val_before_mean": statistics.mean(r["val_before"] for r in results),
        "val_after_mean": statistics.mean(r["val_after"] for r in results),
        "delta_mean": statistics.mean(deltas),
        "delta_stdev": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
        "improved_seeds": sum(d > 0 for d in deltas),
        "per_seed": results,
        "environment": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    plot(results, out.with_suffix(".png"), f"{Path(args.config).stem}: {args.steps} steps, seeds {args.seeds}")
    print(json.dumps({k: summary[k] for k in ("val_before_mean", "val_after_mean", "delta_mean", "delta_stdev",
                                              "improved_seeds")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
