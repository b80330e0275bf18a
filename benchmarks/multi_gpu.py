"""Two GPUs of one host: data-parallel training, inference replicas, and where a step's stages should run.

Model: the Qwen2.5-1.5B shape with random bf16 weights built from a Qwen2Config (``benchmarks/training.py``'s
``build_model``, no download), LoRA r16 alpha 32 on all linear layers, token ids of tiny-random's tokenizer.
Every measurement runs in processes of its own, started by this script with CUDA_VISIBLE_DEVICES set, so each sees
exactly its GPUs (as the flow's ``training.gpus`` / ``inference.replicas`` do). Three parts, chosen with ``--parts``:

1. ``train``: trainer tokens/s, 1 GPU vs 2 (``torchrun --nproc_per_node 2``, NCCL;
   ``backends/training/distributed.py``): the same synthetic multi-turn GRPO steps (``benchmarks/training.py``'s
   ``synthetic_groups``, ~``step_tokens`` per step, rows of 2k-16k tokens), GRPOTrainer's GPU defaults at 16k tokens
   per micro-batch; tokens/s = the timed steps' tokens / their wall time, after ``warmup`` steps. Also recorded: the
   largest difference of any LoRA weight between the 1-GPU and the 2-GPU adapters after the same ``warmup`` + 1
   steps (both runs always do those; bf16: the tolerance to document).
2. ``rollout``: rollout tokens/s with 1 vs 2 replicas on the GRPO-shaped load (``prompts`` prompts x n=``group``
   samples, ``prompt_tokens`` in, ``new_tokens`` out, EOS ignored, LoRA policy): one embedded engine per GPU in its
   own process, called in-process (no HTTP, so no fastapi/openai); the prompts are split evenly, as the policy
   client's least-outstanding router splits equal requests. The load runs in rounds, every replica starting a round
   on one signal: ``rollout_warmup`` rounds (CUDA-graph captures) then ``rollout_rounds`` timed ones; tokens/s = all
   output tokens / the sum over timed rounds of (last answer - first request), wall clock across the processes.
3. ``step``: the flow's step wall time: rollouts of the flow load (``flow_prompts`` x ``flow_group``) by the
   engine, then the GRPO update on the completions (real token ids and logprobs), then the new adapter loaded into
   the engine; per step, after ``warmup`` steps. ``shared``: engine and trainer on GPU 0 in one process;
   ``split``: engine on GPU 0, trainer on GPU 1. ``both`` (each stage on both GPUs in turn) is composed from all
   three parts: rollout time over the 2-replica scaling + update time over the 2-GPU scaling.

Results merge into ``--out``: each run adds or replaces the parts it ran (with their own date, command, hardware and
versions) and recomputes the top-level "summary" (the issue's 8 keys, null for a part not run yet);
``benchmarks/multi_gpu_report.py`` owns that file. A part's file is written as soon as it ends.

Budget (``--budget-s``, default 420 s per part asked for): the measurements still to run share what is left equally
(6 in all: 2 per part); within one, warm-up always runs and so does the first timed step (or round), and a further
one starts only if it is expected to end within its share (expected: the longest timed one so far). The result
records how many were timed of how many planned. Sizes (GPU defaults), each part alone on an H200 including model
builds and warm-up: ``train`` 10 steps of 128k tokens on 1 GPU (~4 s each at the ~32k tok/s of
``results/training-h200.json``) then on 2 (~2 s each), plus ~20 s per process for imports, model build, NCCL and
the first step's compile: ~2 min. ``rollout`` 3 rounds of 64 x 16 x 256 = 262k output tokens (1,024 sequences,
4 waves of the 256-row batch) on 1 replica then on 2: ~16-33 s per round on one replica at 8-16k tok/s, so ~2-3.5
min. ``step`` 5 steps per placement of 16 x 8 x 256 = 33k rollout tokens plus a 65k-token update, ~8 s each, plus
~40 s for two model builds and the captures, twice: ~2-3 min.

Needs torch, transformers, peft, safetensors and pydantic (the engine's and trainer's configs); not Prefect, openai
or fastapi. On a host with 2 GPUs, one command per part (each ~2-4 min), into one file:

    python benchmarks/multi_gpu.py --parts train --out benchmarks/results/multi-gpu-h200x2.json
    python benchmarks/multi_gpu.py --parts rollout --out benchmarks/results/multi-gpu-h200x2.json
    python benchmarks/multi_gpu.py --parts step --out benchmarks/results/multi-gpu-h200x2.json
    python benchmarks/multi_gpu.py --smoke --out /tmp/mg.json          # CPU, tiny shape, all parts, ~1.5 min
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import multi_gpu_report as report

LORA = dict(lora_rank=16, lora_alpha=32)
BUDGET_PER_PART_S = 420.0

GPU_SPEC = dict(shape="qwen2.5-1.5b", kind="cuda", dtype="bfloat16", warmup=2, steps=8, step_tokens=131072,
                min_len=2048, max_len=16384, micro_batch_tokens=16384, prompts=64, group=16, prompt_tokens=256,
                new_tokens=256, max_batch=256, rollout_warmup=1, rollout_rounds=2, flow_prompts=16, flow_group=8,
                flow_steps=3)
SMOKE_SPEC = dict(shape="tiny", kind="cpu", dtype="float32", warmup=1, steps=2, step_tokens=1200, min_len=64,
                  max_len=256, micro_batch_tokens=512, prompts=4, group=2, prompt_tokens=16, new_tokens=8,
                  max_batch=16, rollout_warmup=1, rollout_rounds=2, flow_prompts=2, flow_group=2, flow_steps=1)


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


def may_start(timed: list[float], deadline: float | None, now: float | None = None) -> bool:
    """Whether another timed step (or round) may start: always the first; a later one only if it is expected to end
    by `deadline` (epoch seconds), expected = the longest timed one so far."""
    if deadline is None or not timed:
        return True
    return (time.time() if now is None else now) + max(timed) <= deadline


def _timed(planned: int, walls: list[float]) -> dict:
    return {"planned": planned, "timed": len(walls), "budget_stopped": len(walls) < planned}


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


def _wait_for(paths: list[Path], procs: list[subprocess.Popen], what: str) -> None:
    while not all(p.exists() for p in paths):
        if any(proc.poll() is not None for proc in procs):
            raise RuntimeError(f"a replica process ended while {what}")
        time.sleep(0.01)


# ---- child roles ----------------------------------------------------------------------------------------------------
def role_train(spec: dict, result: Path, deadline: float | None) -> None:
    """A rank of the trainer measurement (one process, or one of torchrun's); ranks agree on stopping early."""
    import torch

    from backends.training import distributed
    from benchmarks.training import synthetic_groups

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = distributed.init_from_torchrun(spec["kind"]) if world > 1 else spec["kind"]
    trainer = _trainer(spec, device)
    vocab = _shape(spec)["vocab_size"]
    walls, tokens, lora = [], [], None
    for k in range(spec["warmup"] + spec["steps"]):
        go = k < spec["warmup"] or may_start(walls, deadline)
        if world > 1:  # every rank must take the same steps, or the all-reduce of a lone rank hangs
            go = distributed.all_reduce_sum([float(go)], device)[0] == world
        if not go:
            break
        groups = synthetic_groups(k, vocab, spec["step_tokens"], spec["min_len"], spec["max_len"])
        _sync(device)
        t0 = time.perf_counter()
        m = trainer.train_step(groups)
        _sync(device)
        if k >= spec["warmup"]:
            walls.append(time.perf_counter() - t0)
            tokens.append(m["tokens"])
        if k == spec["warmup"] and distributed.world()[0] == 0:  # the steps every run does, whatever its budget
            lora = {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters() if "lora_" in n}
    if distributed.world()[0] == 0:
        torch.save(lora, result.with_suffix(".lora.pt"))
        result.write_text(json.dumps({"world": world, "tok_s": sum(tokens) / sum(walls), "wall_s": walls,
                                      "tokens": tokens, "peak_memory_gib_rank0": m["peak_memory_gib"],
                                      **_timed(spec["steps"], walls)}))
    distributed.close()


def role_replica(spec: dict, folder: Path, index: int, replicas: int) -> None:
    """One inference replica: its share of the GRPO load once per round, each round started when ``go-<r>`` appears
    in `folder`, until ``stop`` does."""
    engine = _engine(spec, spec["kind"], None)
    prompts = _prompts(spec, spec["prompts"], seed=1)[index::replicas]
    (folder / f"ready-{index}").write_text("")
    r = 0
    while True:
        while not (folder / f"go-{r}").exists() and not (folder / "stop").exists():
            time.sleep(0.01)
        if not (folder / f"go-{r}").exists():
            break
        start = time.time()
        done = asyncio.run(_rollouts(engine, prompts, spec, spec["group"], "policy@1", 1_000_000 * r + 1000 * index))
        end = time.time()
        tokens = sum(len(c.token_ids) for choices in done for c in choices)
        (folder / f"round-{r}-{index}.json").write_text(json.dumps({"tokens": tokens, "start": start, "end": end}))
        r += 1
    engine.shutdown()


def role_step(spec: dict, result: Path, placement: str, deadline: float | None) -> None:
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
        if k >= spec["warmup"] and not may_start([r["step_s"] for r in rows], deadline):
            break
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
    result.write_text(json.dumps({"placement": placement, "inference": inf, "training": train, "steps": rows,
                                  **_timed(spec["flow_steps"], [r["step_s"] for r in rows])}))
    engine.shutdown()


# ---- the parent -----------------------------------------------------------------------------------------------------
def _script(spec: dict, deadline: float | None) -> list[str]:
    return [str(Path(__file__).resolve()), "--spec", json.dumps(spec),
            *(["--deadline", repr(deadline)] if deadline is not None else [])]


def _env(gpus: str | None) -> dict:
    """This process's environment for a child: the repo first on its path, the rest kept (e.g. carried wheels')."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def _child(role: list[str], spec: dict, work: Path, name: str, gpus: str | None, deadline: float | None,
           torchrun: int = 0) -> dict:
    result = work / f"{name}.json"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
                if torchrun > 1 else [sys.executable])
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(role)} (GPUs {gpus})", flush=True)
    subprocess.run([*launcher, *_script(spec, deadline), "--result", str(result), *role], env=_env(gpus), check=True)
    return json.loads(result.read_text())


def _replicas(spec: dict, work: Path, count: int, gpu_ids: list[str] | None, deadline: float | None) -> dict:
    """`count` replica processes driven round by round: warm-up rounds, then timed ones while the budget allows."""
    folder = work / f"rollout-{count}"
    folder.mkdir()
    print(f"[{time.strftime('%H:%M:%S')}] rollout: {count} replica(s) (GPUs {gpu_ids})", flush=True)
    procs = [subprocess.Popen([sys.executable, *_script(spec, None), "--role", "replica", "--result", str(folder),
                               "--index", str(i), "--replicas", str(count)],
                              env=_env(gpu_ids[i] if gpu_ids is not None else None)) for i in range(count)]
    rounds, walls = [], []
    try:
        _wait_for([folder / f"ready-{i}" for i in range(count)], procs, "loading")
        for r in range(spec["rollout_warmup"] + spec["rollout_rounds"]):
            if r >= spec["rollout_warmup"] and not may_start(walls, deadline):
                break
            (folder / f"go-{r}").write_text("")
            files = [folder / f"round-{r}-{i}.json" for i in range(count)]
            _wait_for(files, procs, f"in round {r}")
            parts = [json.loads(f.read_text()) for f in files]
            wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
            if r >= spec["rollout_warmup"]:
                walls.append(wall)
                rounds.append({"tokens": sum(p["tokens"] for p in parts), "wall_s": wall, "per_replica": parts})
        (folder / "stop").write_text("")
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError("a replica process failed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    tokens = sum(r["tokens"] for r in rounds)
    return {"replicas": count, "tokens": tokens, "wall_s": sum(walls), "tok_s": tokens / sum(walls),
            "rounds": rounds, **_timed(spec["rollout_rounds"], walls)}


def part_train(spec: dict, work: Path, gpu: bool, deadline) -> tuple[dict, dict]:
    import torch

    train = {str(w): _child(["--role", "train"], spec, work, f"train-{w}gpu", ("0" if w == 1 else "0,1")
                            if gpu else None, deadline(), torchrun=w) for w in (1, 2)}
    lora = [torch.load(work / f"train-{w}gpu.lora.pt", weights_only=True) for w in (1, 2)]
    diff = max(float((lora[0][n] - lora[1][n]).abs().max()) for n in lora[0])
    return ({"train": train, "train_ddp_max_abs_diff_lora": diff, "lora_compared_after_steps": spec["warmup"] + 1},
            {w: {k: train[w][k] for k in ("planned", "timed", "budget_stopped")} for w in train})


def part_rollout(spec: dict, work: Path, gpu: bool, deadline) -> tuple[dict, dict]:
    rollout = {str(n): _replicas(spec, work, n, ["0", "1"][:n] if gpu else None, deadline()) for n in (1, 2)}
    return {"rollout": rollout}, {n: {k: rollout[n][k] for k in ("planned", "timed", "budget_stopped")}
                                  for n in rollout}


def part_step(spec: dict, work: Path, gpu: bool, deadline) -> tuple[dict, dict]:
    steps = {pl: _child(["--role", "step", "--placement", pl], spec, work, f"step-{pl}",
                        ("0" if pl == "shared" else "0,1") if gpu else None, deadline()) for pl in ("shared", "split")}
    return {"steps": steps}, {pl: {k: steps[pl][k] for k in ("planned", "timed", "budget_stopped")} for pl in steps}


PART_RUNNERS = {"train": part_train, "rollout": part_rollout, "step": part_step}
MEASUREMENTS_PER_PART = 2


def _environment(spec: dict) -> dict:
    import torch

    from benchmarks.inference import hardware, versions

    env = {**versions(), **hardware(spec["kind"])}
    if spec["kind"] == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def parse_parts(text: str) -> tuple[str, ...]:
    """`--parts`: a comma list of train, rollout, step (any order, repeats ignored), run in that order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in report.PARTS]
    if unknown or not names:
        what = f"unknown part(s) {', '.join(map(repr, unknown))}" if unknown else "no part given"
        raise argparse.ArgumentTypeError(f"{what}; choose from {', '.join(report.PARTS)}, comma-separated")
    return tuple(n for n in report.PARTS if n in names)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, two gloo ranks and two CPU replicas")
    p.add_argument("--parts", type=parse_parts, default=report.PARTS,
                   help="comma list of train, rollout, step (default: all); results merge into --out")
    p.add_argument("--budget-s", type=_positive, default=None,
                   help=f"seconds for this command's timed steps (default {BUDGET_PER_PART_S:.0f} per part): no new "
                   "timed step starts that would end past its share; the first timed one always runs")
    p.add_argument("--out", type=Path, default=None, help="result JSON, merged into if it exists (default: "
                   "results/multi-gpu-h200x2.json, or a temporary file with --smoke)")
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--role", choices=("train", "replica", "step"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--placement", default="shared", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role is not None:
        spec = json.loads(args.spec)
        if spec["kind"] == "cpu":
            import torch

            torch.set_num_threads(1)
        {"train": lambda: role_train(spec, args.result, args.deadline),
         "replica": lambda: role_replica(spec, args.result, args.index, args.replicas),
         "step": lambda: role_step(spec, args.result, args.placement, args.deadline)}[args.role]()
        return 0

    spec = dict(SMOKE_SPEC if args.smoke else GPU_SPEC)
    out = args.out or (Path(tempfile.mkdtemp(prefix="multi-gpu-smoke-")) / "multi-gpu-smoke.json" if args.smoke
                       else REPO / "benchmarks" / "results" / "multi-gpu-h200x2.json")
    try:
        existing = report.load(out, args.smoke)
    except report.ResultFileError as exc:
        print(f"multi_gpu.py: {exc}", file=sys.stderr)
        return 2
    gpu = spec["kind"] == "cuda"
    if gpu:
        import torch

        if torch.cuda.device_count() < 2:
            print(f"multi_gpu.py: needs 2 GPUs, this process sees {torch.cuda.device_count()}", file=sys.stderr)
            return 2
    budget = args.budget_s if args.budget_s is not None else BUDGET_PER_PART_S * len(args.parts)
    end = time.time() + budget
    left = [MEASUREMENTS_PER_PART * len(args.parts)]

    def deadline() -> float:
        """The next measurement's share: what is left of the budget, split equally among those still to run."""
        share = time.time() + (end - time.time()) / left[0]
        left[0] -= 1
        return share

    command = " ".join(["python", "benchmarks/multi_gpu.py", *map(shlex.quote, argv)])
    work = Path(tempfile.mkdtemp(prefix="multi-gpu-"))
    environment = _environment(spec)
    new: dict = {}
    for name in args.parts:
        started = time.time()
        details, timed = PART_RUNNERS[name](spec, work, gpu, deadline)
        new[name] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command, "environment": environment,
                     "spec": spec, "budget_s": budget, "wall_s": time.time() - started, "timed": timed,
                     "details": details}
        doc = report.merge(existing, new, args.smoke, time.strftime("%Y-%m-%d %H:%M:%S %Z"))
        report.write(out, doc)  # after each part: a later part's failure keeps this one
        print(f"[{time.strftime('%H:%M:%S')}] {name} done in {time.time() - started:.0f} s; wrote {out}", flush=True)
    print(json.dumps(doc["summary"], indent=2))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
