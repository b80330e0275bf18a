"""Two GPUs of one host: data-parallel training, inference replicas, and where a step's stages should run.

Model: the Qwen2.5-1.5B shape with random bf16 weights built from a Qwen2Config (``benchmarks/training.py``'s
``build_model``, no download), LoRA r16 alpha 32 on all linear layers, token ids of tiny-random's tokenizer.
Every part runs in processes of its own, started by this script with CUDA_VISIBLE_DEVICES set, so each sees exactly
its GPUs (as the flow's ``training.gpus`` / ``inference.replicas`` do):

1. Trainer tokens/s, 1 GPU vs 2 (``torchrun --nproc_per_node 2``, NCCL; ``backends/training/distributed.py``): the
   same synthetic multi-turn GRPO steps (``benchmarks/training.py``'s ``synthetic_groups``, ~``--step-tokens`` per
   step, rows of 2k-16k tokens), GRPOTrainer's GPU defaults at 16k tokens per micro-batch; tokens/s = the step's
   tokens / the step's wall time, over the timed steps after ``--warmup``. Also recorded: the largest difference of
   any LoRA weight between the 1-GPU and the 2-GPU adapters after the same steps (bf16: the tolerance to document).
2. Rollout tokens/s with 1 vs 2 replicas on the GRPO-shaped load (``--prompts`` prompts x n=``--group`` samples,
   ``--prompt-tokens`` in, ``--new-tokens`` out, EOS ignored, LoRA policy): one embedded engine per GPU in its own
   process, called in-process (no HTTP, so no fastapi/openai); the prompts are split evenly, as the policy client's
   least-outstanding router splits equal requests. All replicas start on one signal; tokens/s = all output tokens /
   (last answer - first request), wall clock across the processes.
3. The flow's step wall time: rollouts of the GRPO load by the engine, then the GRPO update on the completions (real
   token ids and logprobs), then the new adapter loaded into the engine; per step, after ``--warmup`` steps.
   ``shared``: engine and trainer on GPU 0 in one process; ``split``: engine on GPU 0, trainer on GPU 1.
   ``both`` (each stage on both GPUs in turn) is composed from parts 1 and 2: rollout wall with 2 replicas + update
   wall on 2 GPUs, at the same load.

Needs torch, transformers, peft, safetensors and pydantic (the engine's and trainer's configs); not Prefect, openai
or fastapi. Writes the JSON (top-level "summary" with the issue's keys, "details" with the rest) and a .md beside it.

    python benchmarks/multi_gpu.py --out benchmarks/results/multi-gpu-h200x2.json     # 2 GPUs, ~15-25 min
    python benchmarks/multi_gpu.py --smoke                                            # CPU, tiny shape, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SUMMARY_KEYS = ("train_tok_s_1gpu", "train_tok_s_2gpu", "train_scaling_2gpu", "rollout_tok_s_1replica",
                "rollout_tok_s_2replicas", "rollout_scaling_2replicas", "step_wall_s_shared_1gpu",
                "step_wall_s_split_2gpu")
TARGETS = {"train_scaling_2gpu": 1.85, "rollout_scaling_2replicas": 1.8}
LORA = dict(lora_rank=16, lora_alpha=32)

GPU_SPEC = dict(shape="qwen2.5-1.5b", kind="cuda", dtype="bfloat16", warmup=2, steps=5, step_tokens=65536,
                min_len=2048, max_len=16384, micro_batch_tokens=16384, prompts=64, group=16, prompt_tokens=256,
                new_tokens=256, max_batch=256, flow_prompts=16, flow_group=8, flow_steps=3)
SMOKE_SPEC = dict(shape="tiny", kind="cpu", dtype="float32", warmup=1, steps=2, step_tokens=1200, min_len=64,
                  max_len=256, micro_batch_tokens=512, prompts=4, group=2, prompt_tokens=16, new_tokens=8,
                  max_batch=16, flow_prompts=2, flow_group=2, flow_steps=1)


# ---- shared pieces (run inside the child processes) -------------------------------------------------------------
def _shape(spec: dict) -> dict:
    from benchmarks.training import QWEN25_15B, TINY

    return QWEN25_15B if spec["shape"] == "qwen2.5-1.5b" else TINY


def _dtype(spec: dict):
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec["dtype"]]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _trainer(spec: dict, device: str):
    from backends.modeling.loading import build_tiny_tokenizer
    from backends.training.config import TrainerConfig
    from backends.training.trainer import GRPOTrainer
    from benchmarks.training import build_model

    model = build_model(_shape(spec), device, _dtype(spec))
    cfg = TrainerConfig(**LORA, micro_batch_tokens=spec["micro_batch_tokens"], max_row_tokens=spec["max_len"],
                        learning_rate=1e-5)
    return GRPOTrainer("bench", cfg, device=device, model=model, tokenizer=build_tiny_tokenizer())


def _engine(spec: dict, device: str, adapter_dir: Path | None):
    """An engine over a fresh random model on `device`, serving a random r16 LoRA as policy@1 (or `adapter_dir`)."""
    from backends.inference.engine import Engine, EngineConfig
    from backends.modeling.loading import build_tiny_tokenizer
    from benchmarks.inference import random_lora
    from benchmarks.training import build_model

    model = build_model(_shape(spec), device, _dtype(spec))
    engine = Engine(model, build_tiny_tokenizer(), "bench", EngineConfig(max_batch_size=spec["max_batch"]))
    if adapter_dir is None:
        adapter_dir = Path(tempfile.mkdtemp(prefix="bench-lora-"))
        random_lora(model, LORA["lora_rank"], adapter_dir)  # the engine keeps the base weights it read
    engine.load_adapter("policy@1", str(adapter_dir))
    return engine


def _prompts(spec: dict, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(spec["prompt_tokens"])] for _ in range(count)]


async def _rollouts(engine, prompts: list[list[int]], spec: dict, group: int, policy: str, seed: int):
    from backends.inference.engine import SamplingParams

    return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=spec["new_tokens"], seed=seed + i,
                                                                    ignore_eos=True), policy, n=group)
                                  for i, p in enumerate(prompts)))


# ---- child roles ----------------------------------------------------------------------------------------------------
def role_train(spec: dict, result: Path) -> None:
    """A rank of the trainer measurement (one process, or one of torchrun's)."""
    import torch

    from backends.training import distributed
    from benchmarks.training import synthetic_groups

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = distributed.init_from_torchrun(spec["kind"]) if world > 1 else spec["kind"]
    trainer = _trainer(spec, device)
    vocab = _shape(spec)["vocab_size"]
    walls, tokens = [], []
    for k in range(spec["warmup"] + spec["steps"]):
        groups = synthetic_groups(k, vocab, spec["step_tokens"], spec["min_len"], spec["max_len"])
        _sync(device)
        t0 = time.perf_counter()
        m = trainer.train_step(groups)
        _sync(device)
        if k >= spec["warmup"]:
            walls.append(time.perf_counter() - t0)
            tokens.append(m["tokens"])
    if distributed.world()[0] == 0:
        lora = {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters() if "lora_" in n}
        torch.save(lora, result.with_suffix(".lora.pt"))
        result.write_text(json.dumps({"world": world, "tok_s": sum(tokens) / sum(walls), "wall_s": walls,
                                      "tokens": tokens, "peak_memory_gib_rank0": m["peak_memory_gib"]}))
    distributed.close()


def role_replica(spec: dict, result: Path, index: int, replicas: int, go: Path) -> None:
    """One inference replica: its share of the GRPO load, started when `go` appears."""
    engine = _engine(spec, spec["kind"], None)
    prompts = _prompts(spec, spec["prompts"], seed=1)[index::replicas]
    asyncio.run(_rollouts(engine, prompts[:2], dict(spec, new_tokens=4), 1, "policy@1", 10_000))  # warm-up, graphs
    result.with_suffix(".ready").write_text("")
    while not go.exists():
        time.sleep(0.01)
    start = time.time()
    done = asyncio.run(_rollouts(engine, prompts, spec, spec["group"], "policy@1", 0))
    end = time.time()
    tokens = sum(len(c.token_ids) for choices in done for c in choices)
    result.write_text(json.dumps({"index": index, "tokens": tokens, "start": start, "end": end}))
    engine.shutdown()


def role_step(spec: dict, result: Path, placement: str) -> None:
    """The flow's step in one process: rollouts, the update on them, the new adapter loaded into the engine."""
    from agents.trajectory import SampledTurn, Trajectory, TrajectoryGroup

    inf, train = ("cuda:0", "cuda:0" if placement == "shared" else "cuda:1") if spec["kind"] == "cuda" else ("cpu",) * 2
    trainer = _trainer(spec, train)
    folder = Path(tempfile.mkdtemp(prefix="bench-step-"))
    trainer.model.save_pretrained(str(folder / "0"))
    engine = _engine(spec, inf, folder / "0")
    rng = random.Random(7)
    rows = []
    for k in range(spec["warmup"] + spec["flow_steps"]):
        t0 = time.perf_counter()
        prompts = _prompts(spec, spec["flow_prompts"], seed=100 + k)
        done = asyncio.run(_rollouts(engine, prompts, spec, spec["flow_group"], f"policy@{k + 1}" if k else "policy@1",
                                     1000 * k))
        t1 = time.perf_counter()
        groups = [TrajectoryGroup([Trajectory(messages_and_choices=[SampledTurn(
            message={"role": "assistant", "content": ""}, prompt_token_ids=p, token_ids=c.token_ids,
            logprobs=c.logprobs)], reward=rng.random()) for c in choices]) for p, choices in zip(prompts, done)]
        trainer.train_step(groups)
        _sync(train)
        t2 = time.perf_counter()
        trainer.model.save_pretrained(str(folder / str(k + 1)))
        engine.load_adapter(f"policy@{k + 2}", str(folder / str(k + 1)))
        t3 = time.perf_counter()
        if k >= spec["warmup"]:
            rows.append({"step_s": t3 - t0, "rollouts_s": t1 - t0, "train_s": t2 - t1, "publish_s": t3 - t2})
    result.write_text(json.dumps({"placement": placement, "inference": inf, "training": train, "steps": rows}))
    engine.shutdown()


# ---- the parent -----------------------------------------------------------------------------------------------------
def _child(role: list[str], spec: dict, work: Path, name: str, gpus: str | None, torchrun: int = 0) -> Path:
    result = work / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
                if torchrun > 1 else [sys.executable])
    argv = [*launcher, str(Path(__file__).resolve()), "--spec", json.dumps(spec), "--result", str(result), *role]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(role)} (GPUs {gpus})", flush=True)
    subprocess.run(argv, env=env, check=True)
    return result


def _replicas(spec: dict, work: Path, count: int, gpu_ids: list[str] | None) -> dict:
    go = work / f"go-{count}"
    procs, results = [], []
    for i in range(count):
        result = work / f"replica-{count}-{i}.json"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu_ids[i]
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--spec", json.dumps(spec),
                                       "--result", str(result), "--role", "replica", "--index", str(i),
                                       "--replicas", str(count), "--go", str(go)], env=env))
        results.append(result)
    while not all(r.with_suffix(".ready").exists() for r in results):
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a replica process failed while loading")
        time.sleep(0.05)
    go.write_text("")
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError("a replica process failed")
    parts = [json.loads(r.read_text()) for r in results]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    return {"replicas": count, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "per_replica": parts}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _environment(spec: dict) -> dict:
    import torch

    from benchmarks.inference import hardware, versions

    env = {**versions(), **hardware(spec["kind"])}
    if spec["kind"] == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def markdown(report: dict) -> str:
    s, d = report["summary"], report["details"]
    lines = [f"# Two GPUs of one host ({report['date']}, {'smoke: CPU, tiny shape' if report['smoke'] else 'GPU'})",
             "", f"Command: `{report['command']}`", "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4g} |" for k, v in s.items()]
    lines += ["", f"Targets: {json.dumps(report['targets'])}; step wall, both GPUs per stage in turn (composed): "
              f"{d['step_wall_s_both_2gpu_composed']:.4g} s; largest LoRA weight difference, 1 vs 2 GPUs after the "
              f"same steps: {d['train_ddp_max_abs_diff_lora']:.3g}.", "",
              f"Environment: {json.dumps(report['environment'])}", "", f"Spec: {json.dumps(report['spec'])}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, two gloo ranks and two CPU replicas")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: results/multi-gpu-h200x2.json, or a "
                   "temporary file with --smoke)")
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--role", choices=("train", "replica", "step"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--go", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--placement", default="shared", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role is not None:
        spec = json.loads(args.spec)
        if spec["kind"] == "cpu":
            import torch

            torch.set_num_threads(1)
        {"train": lambda: role_train(spec, args.result),
         "replica": lambda: role_replica(spec, args.result, args.index, args.replicas, args.go),
         "step": lambda: role_step(spec, args.result, args.placement)}[args.role]()
        return 0

    spec = dict(SMOKE_SPEC if args.smoke else GPU_SPEC)
    out = args.out or (Path(tempfile.mkdtemp(prefix="multi-gpu-smoke-")) / "multi-gpu-smoke.json" if args.smoke
                       else REPO / "benchmarks" / "results" / "multi-gpu-h200x2.json")
    gpu = spec["kind"] == "cuda"
    if gpu:
        import torch

        if torch.cuda.device_count() < 2:
            print(f"needs 2 GPUs, this process sees {torch.cuda.device_count()}", file=sys.stderr)
            return 2
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="multi-gpu-"))
    train = {w: json.loads(_child(["--role", "train"], spec, work, f"train-{w}gpu", ("0" if w == 1 else "0,1")
                                  if gpu else None, torchrun=w).read_text()) for w in (1, 2)}
    import torch

    lora = [torch.load(work / f"train-{w}gpu.lora.pt", weights_only=True) for w in (1, 2)]
    diff = max(float((lora[0][n] - lora[1][n]).abs().max()) for n in lora[0])
    rollout = {n: _replicas(spec, work, n, ["0", "1"][:n] if gpu else None) for n in (1, 2)}
    steps = {pl: json.loads(_child(["--role", "step", "--placement", pl], spec, work, f"step-{pl}",
                                   ("0" if pl == "shared" else "0,1") if gpu else None).read_text())
             for pl in ("shared", "split")}
    summary = {
        "train_tok_s_1gpu": train[1]["tok_s"], "train_tok_s_2gpu": train[2]["tok_s"],
        "train_scaling_2gpu": train[2]["tok_s"] / train[1]["tok_s"],
        "rollout_tok_s_1replica": rollout[1]["tok_s"], "rollout_tok_s_2replicas": rollout[2]["tok_s"],
        "rollout_scaling_2replicas": rollout[2]["tok_s"] / rollout[1]["tok_s"],
        "step_wall_s_shared_1gpu": _mean([r["step_s"] for r in steps["shared"]["steps"]]),
        "step_wall_s_split_2gpu": _mean([r["step_s"] for r in steps["split"]["steps"]]),
    }
    assert tuple(summary) == SUMMARY_KEYS
    # Both GPUs for each stage in turn, at the flow-step load: rollouts scale as measured with 2 replicas, the update
    # as measured on 2 GPUs (the shared step's stage times divided by the measured scalings).
    shared = steps["shared"]["steps"]
    both = _mean([r["rollouts_s"] / summary["rollout_scaling_2replicas"] + r["train_s"] / summary["train_scaling_2gpu"]
                  + r["publish_s"] for r in shared])
    report = {
        "summary": summary, "targets": TARGETS, "smoke": args.smoke, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python benchmarks/multi_gpu.py" + (" --smoke" if args.smoke else "") + f" --out {out}",
        "spec": spec, "environment": _environment(spec), "wall_s": time.time() - started,
        "details": {"train": train, "train_ddp_max_abs_diff_lora": diff, "rollout": rollout, "steps": steps,
                    "step_wall_s_both_2gpu_composed": both},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(json.dumps(summary, indent=2))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
