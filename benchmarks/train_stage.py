"""Where the seconds of the flow's train stage go, at the main job's shape (SmolLM2-135M, arithmetic rows).

On the H200 the train stage of `configs/default.yaml` with 16 groups x 16 rollouts (benchmarks/results/async-h200.md)
took 6.8 s per step, of which `train/update_s` 3.4 s, for ~256 rows of ~50 tokens (~13k tokens: about 0.1 s of
arithmetic for a 135M model). This runs the product's own stage function (`backends.policy.checkpoints.train_step`:
read the scored groups, the GRPO update, the probe record, the policy-shift pass, checkpoint upload, training.json)
on a local run store and reports the parts it times itself (`train/groups_s`, `update_s`, `probe_record_s`, `policy_shift_s`,
`save_s`, `stage_s`, and the probe record's decoder forwards `train/probe_forwards`), plus the store calls
timed by wrapping them, on random weights of SmolLM2-135M's shape and rows of the arithmetic agent's lengths (prompt
~38 tokens shared by a group's 16 rows, completions of 1-16 tokens). The probe record verifies the sampled
completions of its prompt as drafts: `--drafts greedy` (default) makes those of the probe prompt's group prefixes of
the policy's greedy continuation, half of them with a different last token, as a trained policy's samples start
(random weights sample nothing like their argmax); `--drafts random` keeps random tokens (no draft matches). `--profile-step K` adds torch.profiler's top operators for the update of step K, and
the counts of its attention calls and kernel launches. `--attention-kernel flash` runs the packed attention as one SDPA
call per row (the path before ONE varlen call per layer became the default: `TrainerConfig.attention_kernel`).

    python benchmarks/train_stage.py --device cuda --out benchmarks/results/train-stage-h200.json
    .venv/bin/python benchmarks/train_stage.py --device cpu --steps 3 --groups 4 --out /tmp/train-stage.json  # smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)


PARTS = ("train/groups_s", "train/update_s", "train/policy_shift_s", "train/save_s", "train/probe_record_s")
PROFILED_CALLS = ("aten::_flash_attention_forward", "aten::_flash_attention_backward",
                  "aten::_scaled_dot_product_flash_attention", "aten::_efficient_attention_forward",
                  "aten::_cudnn_attention_forward", "cudaLaunchKernel", "SliceBackward0", "CatBackward0")


def arithmetic_groups(step: int, groups: int, group_size: int, vocab: int, prompt_tokens: int, max_new: int):
    """`groups` single-turn groups: one prompt per group, `group_size` completions of 1..max_new tokens each."""
    from agents.trajectory import SampledTurn, Trajectory, TrajectoryGroup

    rng = random.Random(7000 + step)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens + rng.randint(-4, 4))]
        trajs = []
        for _ in range(group_size):
            n = rng.randint(1, max_new)
            turn = SampledTurn(message={"role": "assistant", "content": ""}, prompt_token_ids=list(prompt),
                               token_ids=[rng.randrange(vocab) for _ in range(n)],
                               logprobs=[-math.log(vocab) + rng.gauss(0, 0.1) for _ in range(n)])
            trajs.append(Trajectory(messages_and_choices=[turn], reward=rng.random()))
        out.append(TrajectoryGroup(trajs))
    return out


def greedy_drafts(groups, trainer, max_new: int, seed: int) -> None:
    """The probe prompt's group (the shortest prompt) answers with prefixes of the policy's greedy continuation, every
    other one with a different last token: what the probe record finds in a trained policy's samples."""
    from backends.policy.probe import PROBE_TOKENS

    rng = random.Random(seed)
    group = min(groups, key=lambda g: len(g.trajectories[0].messages_and_choices[0].prompt_token_ids))
    prompt = group.trajectories[0].messages_and_choices[0].prompt_token_ids
    greedy, _ = trainer.greedy_tokens(list(prompt), PROBE_TOKENS)
    for i, traj in enumerate(group.trajectories):
        turn = traj.messages_and_choices[0]
        n = rng.randint(1, min(max_new, len(greedy)))
        tokens = greedy[:n - 1] + [greedy[n - 1] if i % 2 == 0 else (greedy[n - 1] + 1) % trainer.vocab_size]
        turn.token_ids, turn.logprobs = tokens, turn.logprobs[:1] * n


def timed(times: dict, name: str, fn, sync):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        started = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sync()
            times[name] += time.perf_counter() - started
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=38)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--profile-step", type=int, default=0, help="torch.profiler over the update of this step (0: none)")
    ap.add_argument("--drafts", default="greedy", choices=["greedy", "random"],
                    help="the probe prompt's sampled answers: prefixes of the greedy continuation, or random tokens")
    ap.add_argument("--attention-kernel", default="auto", choices=["auto", "varlen", "flash", "sdpa-default", "cudnn"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from torch.autograd import DeviceType

    import backends.policy.checkpoints as checkpoints
    from backends.modeling.loading import build_tiny_tokenizer
    from backends.training.config import TrainerConfig
    from backends.training.trainer import GRPOTrainer
    from benchmarks.training import build_model
    from storage.store import RunStore

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    model = build_model(SMOLLM2_135M, args.device, dtype, family="llama")
    cfg = TrainerConfig(learning_rate=2e-4, lora_rank=8, lora_alpha=16, seed=0,  # configs/default.yaml's trainer
                        attention_kernel=args.attention_kernel)
    trainer = GRPOTrainer("bench", cfg, device=args.device, model=model, tokenizer=build_tiny_tokenizer())
    sync()
    build_s = time.perf_counter() - started

    times: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory(prefix="train-stage-") as root:
        store = RunStore(root, "bench", "train-stage")
        checkpoints.initialize(store, lambda: trainer)
        for name in ("read_groups", "write_groups", "upload_folder", "put_json", "get_json", "exists"):
            setattr(store, name, timed(times, f"store.{name}", getattr(store, name), sync))
        for name in ("train_step", "save_checkpoint"):
            setattr(trainer, name, timed(times, f"trainer.{name}", getattr(trainer, name), sync))
        steps, profile = [], None
        for step in range(1, args.steps + 1):
            groups = arithmetic_groups(step, args.groups, args.group_size, SMOLLM2_135M["vocab_size"],
                                       args.prompt_tokens, args.max_new)
            if args.drafts == "greedy":
                greedy_drafts(groups, trainer, args.max_new, seed=step)
            times.clear()
            prof = None
            if step == args.profile_step:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                prof = torch.profiler.profile(activities=acts)
                prof.__enter__()
            t0 = time.perf_counter()
            result = checkpoints.train_step(store, step, trainer, groups=groups, max_off_policy_steps=None)
            sync()
            total = time.perf_counter() - t0
            if prof is not None:
                prof.__exit__(None, None, None)
                key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
                events = prof.key_averages()
                profile = {"by_self_cpu": events.table(sort_by="self_cpu_time_total", row_limit=25),
                           "by_device": events.table(sort_by=key, row_limit=25),
                           "calls": {e.key: e.count for e in events if e.key in PROFILED_CALLS or "varlen" in e.key},
                           "device_time_s": round(sum(e.self_device_time_total for e in events
                                                      if e.device_type == DeviceType.CUDA) / 1e6, 4)}
            m = result["metrics"]
            row = {"step": step, "stage_s": round(total, 4), **{k: round(m[k], 4) for k in PARTS},
                   "probe_forwards": m["train/probe_forwards"],
                   **{k: round(v, 4) for k, v in sorted(times.items())},
                   "tokens": m.get("train/tokens"), "micro_batches": m.get("train/micro_batches"),
                   "update_step_time_s": round(m.get("train/step_time_s", 0.0), 4)}
            # the write of training.json and what train_step does between its parts
            row["unaccounted_s"] = round(total - sum(m[k] for k in PARTS), 4)
            steps.append(row)
            print(json.dumps(row), flush=True)

    later = steps[1:] or steps

    def median(key):
        return sorted(r[key] for r in later)[len(later) // 2]

    summary = {"stage_s_median": median("stage_s"), "update_s_median": median("trainer.train_step"),
               **{f"{k.removeprefix('train/')}_median": median(k) for k in PARTS if k != "train/update_s"},
               "probe_forwards_median": median("probe_forwards"), "drafts": args.drafts,
               "tokens_per_step": later[-1]["tokens"], "model_build_s": round(build_s, 2),
               "attention_path": trainer.attention_path}
    out = {"summary": summary, "steps": steps, "profile": profile,
           "command": "python benchmarks/train_stage.py " + " ".join(sys.argv[1:]),
           "config": vars(args), "model_shape": SMOLLM2_135M,
           "environment": {"python": platform.python_version(), "torch": torch.__version__,
                           "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    if profile:
        print(profile["by_self_cpu"])
        print(profile["by_device"])
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
