"""TRL's GRPO loss path on our rows, side by side with our trainer: same model, same LoRA, same rows, one process each.

TRL (``trl.GRPOTrainer``, 1.16) generates its own completions, so its trainer cannot take our rows whole; what is
timed is its update: per micro-batch ``GRPOTrainer.compute_loss(model, inputs)`` (its fused, tiled LM head for
per-token logprobs and entropy, its CISPO loss, its normaliser) and ``accelerator.backward``, then gradient
clipping and the optimizer TRL's ``create_optimizer`` builds, once per step. The inputs are what
``_generate_and_score_completions`` would hand it for our rows, in TRL's padding scheme:

- each row splits at its first trained token: ``prompt_ids`` (left-padded) and ``completion_ids`` (right-padded);
  ``tool_mask`` is our loss mask over the completion (0 on tool results, TRL's multi-turn mask), so exactly our
  trained tokens carry loss; ``old_per_token_logps`` are the sampler's logprobs; ``advantages`` ours per row;
- rows in order, as many per micro-batch as fit ``--micro-batch-tokens`` counting the padding (TRL pads a
  micro-batch to its longest prompt plus its longest completion);
- ``num_items_in_batch`` = the step's trained tokens (TRL's CISPO divides the summed loss by it).

Variants: ``trl/defaults`` (TRL's own defaults: gradient checkpointing on, bf16 autocast) and
``trl/no-checkpointing``; ``ours/defaults`` (``GRPOTrainer`` with no speed setting; it warms up at set-up on CUDA) and
``ours/cudnn`` (``attention_kernel: cudnn``: rows padded to 512-token buckets, cuDNN attention). Each variant
runs in its own child process: ``--warm-steps`` untimed steps, then ``--steps`` timed ones; tokens/s = row tokens
(no padding) / wall seconds of the timed steps. Liger: TRL 1.16 deprecates ``use_liger_kernel`` and refuses its
fused cross-entropy (it replaces the forward TRL patches with its own fused LM head), so it is not a variant.

    python benchmarks/training_trl.py --out benchmarks/results/training-trl-h200.json
    python benchmarks/training_trl.py --smoke --out /tmp/trl.json     # CPU, tiny shape (needs trl + datasets)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("ours/defaults", "ours/cudnn", "trl/defaults", "trl/no-checkpointing")
OURS_SETTINGS = {"ours/defaults": {}, "ours/cudnn": {"attention_kernel": "cudnn"}}  # on top of the common ones


def trl_batches(rows, budget: int) -> list[list]:
    """Rows in order; a micro-batch takes rows while n x (longest prompt + longest completion) <= budget."""
    batches, cur = [], []

    def width(rs) -> int:
        return max(r.loss_mask.index(True) for r in rs) + max(len(r) - r.loss_mask.index(True) for r in rs)

    for r in rows:
        if cur and width(cur + [r]) * (len(cur) + 1) > budget:
            batches.append(cur)
            cur = []
        cur.append(r)
    if cur:
        batches.append(cur)
    return batches


def trl_inputs(rows, pad_id: int, device: str, num_items: int) -> dict:
    """The dict ``GRPOTrainer._compute_loss`` reads, for these rows (see the module docstring)."""
    import torch

    firsts = [r.loss_mask.index(True) for r in rows]
    p_w = max(firsts)
    c_w = max(len(r) - f for r, f in zip(rows, firsts))
    n = len(rows)
    prompt_ids = torch.full((n, p_w), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_w), dtype=torch.long)
    completion_ids = torch.full((n, c_w), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((n, c_w), dtype=torch.long)
    tool_mask = torch.zeros((n, c_w), dtype=torch.long)
    old = torch.zeros((n, c_w), dtype=torch.float32)
    for i, (r, f) in enumerate(zip(rows, firsts)):
        c = len(r) - f
        prompt_ids[i, p_w - f:] = torch.tensor(r.token_ids[:f])
        prompt_mask[i, p_w - f:] = 1
        completion_ids[i, :c] = torch.tensor(r.token_ids[f:])
        completion_mask[i, :c] = 1
        tool_mask[i, :c] = torch.tensor([int(m) for m in r.loss_mask[f:]])
        old[i, :c] = torch.tensor(r.sampler_logprobs[f:])
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
           "completion_mask": completion_mask, "tool_mask": tool_mask, "old_per_token_logps": old,
           "advantages": torch.tensor([r.advantage for r in rows], dtype=torch.float32),
           "num_items_in_batch": torch.tensor(float(num_items))}
    return {k: v.to(device) for k, v in out.items()}


def run_trl(model, tok, data, max_len, args, device, gc_on: bool) -> list[dict]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from trl import GRPOConfig, GRPOTrainer

    from backends.training.losses import assign_aggregation_weights
    from backends.training.token_rows import build_rows

    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    cuda = device == "cuda"
    conf = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-"), per_device_train_batch_size=2, num_generations=2,
                      loss_type="cispo", beta=0.0, learning_rate=1e-5, max_grad_norm=1.0, report_to="none",
                      gradient_checkpointing=gc_on, bf16=cuda, use_cpu=not cuda, logging_steps=1,
                      max_completion_length=max_len)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=conf,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}), processing_class=tok)
    model = trainer.model
    if gc_on:  # what Trainer.train() does before its first step
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=conf.gradient_checkpointing_kwargs
                                            or {"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    optimizer = trainer.create_optimizer()
    params = [p for p in model.parameters() if p.requires_grad]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    steps = []
    for k, groups in enumerate(data):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rows, _ = build_rows(groups, max_row_tokens=max_len, scale_rewards=True)
        assign_aggregation_weights(rows, "sequence_mean")
        rows = [r for r in rows if any(r.loss_mask)]
        batches = trl_batches(rows, args.micro_batch_tokens)
        num_items = sum(r.trained_tokens for r in rows)
        trainer.current_gradient_accumulation_steps = len(batches)
        trainer.args.steps_per_generation = len(batches)
        total, padded = 0.0, 0
        for b in batches:
            inputs = trl_inputs(b, pad, device, num_items)
            padded += inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
            loss = trainer.compute_loss(model, inputs)
            trainer.accelerator.backward(loss)
            total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, conf.max_grad_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        tokens = sum(len(r) for r in rows)
        steps.append({"step": k, "wall_s": wall, "tokens": tokens, "padded_tokens": padded, "loss": total,
                      "grad_norm": grad_norm, "micro_batches": len(batches),
                      "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")})
        print(f"  trl step {k}: {tokens} tok ({padded} padded) {wall:.2f}s = {tokens / wall:.0f} tok/s, loss {total:.5f},"
              f" {len(batches)} micro-batches, peak {steps[-1]['peak_gib']:.1f} GiB", flush=True)
    return steps


def run_ours(model, tok, data, max_len, args, device) -> list[dict]:
    import torch

    from backends.training.config import TrainerConfig
    from backends.training.trainer import GRPOTrainer

    cfg = TrainerConfig(lora_rank=16, lora_alpha=32, target_modules="all-linear", learning_rate=1e-5,
                        max_row_tokens=max_len, micro_batch_tokens=args.micro_batch_tokens, seed=0, backend="peft",
                        **OURS_SETTINGS[args.variant])
    trainer = GRPOTrainer("bench", cfg, device=device, model=model, tokenizer=tok)  # warms up on CUDA (defaults)
    steps = []
    for k, groups in enumerate(data):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        m = trainer.train_step(groups)
        wall = time.perf_counter() - t0
        steps.append({"step": k, "wall_s": wall, "tokens": m["tokens"], "loss": m["loss"],
                      "grad_norm": m["grad_norm"], "micro_batches": m["micro_batches"], "peak_gib": m["peak_memory_gib"]})
        print(f"  ours step {k}: {m['tokens']:.0f} tok {wall:.2f}s = {m['tokens'] / wall:.0f} tok/s, "
              f"loss {m['loss']:.5f}, peak {m['peak_memory_gib']:.1f} GiB", flush=True)
    return steps


def child(args) -> None:
    import torch

    from benchmarks.training import QWEN25_15B, TINY, build_model, synthetic_groups
    from backends.modeling.loading import build_tiny_tokenizer

    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    shape = TINY if args.smoke else QWEN25_15B
    min_len, max_len = (128, 1024) if args.smoke else (2048, 16384)
    step_tokens = 6000 if args.smoke else args.step_tokens
    total = args.warm_steps + args.steps
    data = [synthetic_groups(k, shape["vocab_size"], step_tokens, min_len, max_len) for k in range(total)]
    model, tok = build_model(shape, device, dtype), build_tiny_tokenizer()
    if args.variant in OURS_SETTINGS:
        steps = run_ours(model, tok, data, max_len, args, device)
    else:
        steps = run_trl(model, tok, data, max_len, args, device, gc_on=args.variant == "trl/defaults")
    Path(args.child_out).write_text(json.dumps({"variant": args.variant, "warm_steps": args.warm_steps,
                                                "steps": steps}))


def summarise(run: dict) -> dict:
    timed = run["steps"][run["warm_steps"]:]
    tokens, wall = sum(s["tokens"] for s in timed), sum(s["wall_s"] for s in timed)
    return {"variant": run["variant"], "tok_s": round(tokens / wall),
            "peak_gib": round(max(s["peak_gib"] for s in timed), 1),
            "step_wall_s": [round(s["wall_s"], 2) for s in run["steps"]],
            "first_step_loss": run["steps"][0]["loss"], "first_step_grad_norm": run["steps"][0]["grad_norm"],
            "padded_share": round(1 - sum(s["tokens"] for s in timed) / sum(s.get("padded_tokens", s["tokens"])
                                                                             for s in timed), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--warm-steps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--step-tokens", type=int, default=98304)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.smoke:
        args.micro_batch_tokens = 1024
    work = Path(tempfile.mkdtemp(prefix="trl-bench-"))
    summary, runs = [], []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
        out = work / f"{len(runs)}.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        cmd = [sys.executable, __file__, "--child", "--variant", variant, "--child-out", str(out),
               "--warm-steps", str(args.warm_steps), "--steps", str(args.steps), "--step-tokens", str(args.step_tokens),
               "--micro-batch-tokens", str(args.micro_batch_tokens)] + (["--smoke"] if args.smoke else [])
        print(f"== {variant}", flush=True)
        rc = subprocess.Popen(cmd, env=env).wait()
        if rc != 0:
            summary.append({"variant": variant, "error": f"child exited {rc}"})
            continue
        runs.append(json.loads(out.read_text()))
        summary.append(summarise(runs[-1]))
        print(f"   -> {summary[-1]}", flush=True)
    def ours_of(variant):
        return next((s["tok_s"] for s in summary if s["variant"] == variant and "tok_s" in s), None)

    ours, cudnn = ours_of("ours/defaults"), ours_of("ours/cudnn")
    trl = [s for s in summary if s["variant"].startswith("trl/") and "tok_s" in s]
    best = max(trl, key=lambda s: s["tok_s"]) if trl else None
    result = {"summary": {"ours_tok_s": ours, "trl_tok_s": best and best["tok_s"],
                          "trl_best_variant": best and best["variant"],
                          "over_trl": round(ours / best["tok_s"], 2) if ours and best else None,
                          "ours_cudnn_tok_s": cudnn,
                          "over_trl_cudnn": round(cudnn / best["tok_s"], 2) if cudnn and best else None},
              "variants": summary, "runs": runs, "env": environment(args)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    if not math.isfinite(float(ours or cudnn or math.nan)):
        sys.exit(1)


def environment(args) -> dict:
    import peft
    import torch
    import transformers

    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "trl": trl_version, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "command": "python " + " ".join(sys.argv)}


if __name__ == "__main__":
    main()
