"""GPU check of the packed attention's ``varlen`` path (ONE FlashAttention varlen call per layer) against the ``rows``
path it replaces (one SDPA call per packed row per layer), then the train stage's time with each. One command:

    python benchmarks/varlen_check.py --out $OUT/varlen-h200.json   # H200, ~2 min; also $OUT/train-stage-*.json|.log
    .venv/bin/python benchmarks/varlen_check.py --device cpu --smoke --out /tmp/varlen-smoke.json   # the script runs

1. **Same numbers.** SmolLM2-135M's shape (30 layers, 9 query / 3 key-value heads) on random weights, the trainer as
   the main job builds it on CUDA (bf16 base under autocast, fused LoRA, lean ops; rank-8 LoRA whose B is random
   too, so every LoRA weight gets a gradient), the rows of `benchmarks/train_stage.py` (16 groups x 16 rows of ~38 +
   1-16 tokens: 2 micro-batches of <= 8192 tokens). For each path: the trained tokens' logprobs and the LoRA
   gradients of ``sum(weight * logprob)`` over both micro-batches. The same is computed by a float32 copy of the
   model and adapter (``rows`` path, no autocast): the truth both bf16 paths round away from.

   Tolerance, and why: both paths run FlashAttention-2's algorithm in bf16 with fp32 accumulation; they differ only
   in tiling (one call over all rows vs one per row) and in the rows path's slicing/cat, so their results differ by
   bf16 rounding that 30 layers compound, which no fixed number bounds in advance. What must hold is that the new
   path is as close to the float32 truth as the old one: for the logprobs (mean and max |diff|) and for each LoRA
   gradient (||g - g32|| / ||g32||, the largest over tensors), ``varlen``'s error <= 1.25 x ``rows``' error + 1e-3 of
   scale (logprobs: 1e-3 nats; gradients: 1e-3 relative). A wrong span, a lost causal mask or a mis-mapped GQA head
   moves logprobs by whole nats and gradients by O(1) relative: orders of magnitude past that.
2. **Time.** `benchmarks/train_stage.py` (the flow's train stage at the main job's shape) in a fresh process per path:
   ``--attention-kernel flash`` (the rows path: before) then ``auto`` (varlen: after), 4 steps each, step 4 profiled
   (attention calls, kernel launches, device time). Their JSONs and logs are written beside ``--out``.

Writes ``--out`` with ``"check"`` (errors, pass/fail) and ``"summary"`` (update and stage seconds before/after,
calls, ``check_passed``); exits 1 if the check failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.train_stage import SMOLLM2_135M, arithmetic_groups  # noqa: E402

REL_FACTOR, LOGPROB_SLACK, GRAD_SLACK = 1.25, 1e-3, 1e-3


def build_trainer(model, device: str, dtype_name: str):
    from backends.modeling.loading import build_tiny_tokenizer
    from backends.training.config import TrainerConfig
    from backends.training.trainer import GRPOTrainer

    cfg = TrainerConfig(learning_rate=2e-4, lora_rank=8, lora_alpha=16, seed=0, dtype=dtype_name)
    return GRPOTrainer("bench", cfg, device=device, model=model, tokenizer=build_tiny_tokenizer())


def logprobs_and_grads(trainer, batches):
    import torch

    trainer.optimizer.zero_grad(set_to_none=True)
    out = []
    for mb in batches:
        logp, _ = trainer._token_logprobs(mb)
        (logp * mb.weights).sum().backward()
        out.append(logp.detach().float())
    grads = {n: p.grad.detach().float().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return torch.cat(out), grads


def errors(logp, grads, ref_logp, ref_grads) -> dict:
    diff = (logp - ref_logp).abs()
    rel = {n: float((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)) for n, g in grads.items()}
    worst = max(rel, key=rel.get)
    return {"logprob_mean_abs": float(diff.mean()), "logprob_max_abs": float(diff.max()),
            "grad_rel_max": rel[worst], "grad_rel_max_tensor": worst,
            "grad_rel_median": sorted(rel.values())[len(rel) // 2], "tensors": len(rel)}


def check(device: str, layers: int, groups: int) -> dict:
    import torch

    from backends.training.attention_choice import AttentionChoice
    from backends.training.token_rows import build_rows
    from benchmarks.training import build_model

    cuda = device.startswith("cuda")
    shape = {**SMOLLM2_135M, "num_hidden_layers": layers}
    model32 = build_model(shape, device, torch.float32, family="llama")
    model16 = copy.deepcopy(model32).to(torch.bfloat16 if cuda else torch.float32)  # before peft wraps model32
    trainer32 = build_trainer(model32, device, "float32")
    trainer16 = build_trainer(model16, device, "auto")
    gen = torch.Generator().manual_seed(1)
    lora = {n: p for n, p in trainer32.model.named_parameters() if p.requires_grad}
    for n, p in lora.items():
        if "lora_B" in n:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    with torch.no_grad():
        for n, p in trainer16.model.named_parameters():
            if p.requires_grad:
                p.copy_(lora[n])
    base16 = {n: p for n, p in trainer16._lm.named_parameters() if "lora_" not in n}
    base32 = {n: p for n, p in trainer32._lm.named_parameters() if "lora_" not in n}
    weight_gap = max(float((base16[n].float() - p.float()).abs().max()) for n, p in base32.items())
    assert weight_gap < 1e-2, f"the bf16 and float32 models do not hold the same weights (max gap {weight_gap})"

    rows, _ = build_rows(arithmetic_groups(1, groups, 16, shape["vocab_size"], 38, 16), max_row_tokens=4096)
    trainer16.model.train()
    trainer32.model.train()
    batches16, batches32 = trainer16._micro_batches(rows), trainer32._micro_batches(rows)
    ref_logp, ref_grads = logprobs_and_grads(trainer32, batches32)
    paths = ["rows"] + (["varlen"] if trainer16.attention.usual.path == "varlen" else [])
    results, timings = {}, {}
    for path in paths:
        trainer16.attention = AttentionChoice.fixed(path, trainer16.attention.usual.sdpa_backends)
        logprobs_and_grads(trainer16, batches16)  # first call of a path: kernels' first launches, compiles
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        logp, grads = logprobs_and_grads(trainer16, batches16)
        if cuda:
            torch.cuda.synchronize()
        timings[path] = round(time.perf_counter() - started, 4)
        results[path] = (logp, grads)
    errs = {path: errors(*results[path], ref_logp, ref_grads) for path in paths}
    out = {"rows": len(rows), "tokens": sum(b.tokens for b in batches16), "micro_batches": len(batches16),
           "paths": paths, "vs_float32": errs, "forward_backward_s": timings, "base_weight_gap_bf16": weight_gap}
    if "varlen" in results:
        out["varlen_vs_rows"] = errors(*results["varlen"], *results["rows"])
        r, v = errs["rows"], errs["varlen"]
        out["bounds"] = {"logprob_mean_abs": REL_FACTOR * r["logprob_mean_abs"] + LOGPROB_SLACK,
                         "logprob_max_abs": REL_FACTOR * r["logprob_max_abs"] + LOGPROB_SLACK,
                         "grad_rel_max": REL_FACTOR * r["grad_rel_max"] + GRAD_SLACK}
        out["passed"] = all(v[k] <= bound for k, bound in out["bounds"].items())
    return out


def train_stage(device: str, kernel: str, out: Path, smoke: bool) -> dict:
    argv = [sys.executable, str(Path(__file__).with_name("train_stage.py")), "--device", device,
            "--attention-kernel", kernel, "--out", str(out)]
    argv += ["--steps", "2", "--groups", "2", "--group-size", "4", "--profile-step", "2"] if smoke else \
        ["--steps", "4", "--profile-step", "4"]
    with out.with_suffix(".log").open("w") as log:  # its per-step lines and profiler tables
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="2 layers, 2 groups, short train-stage runs (CPU)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = {"check": check(args.device, 2 if args.smoke else SMOLLM2_135M["num_hidden_layers"],
                             2 if args.smoke else 16)}
    print(json.dumps(result["check"], indent=1), flush=True)
    stages = {}
    for label, kernel in (("before_rows", "flash"), ("after_auto", "auto")):
        stage = train_stage(args.device, kernel, out.with_name(f"train-stage-{kernel}-{out.stem}.json"), args.smoke)
        s, prof = stage["summary"], stage.get("profile") or {}
        stages[label] = {"attention_path": s.get("attention_path"), "update_s_median": s["update_s_median"],
                         "stage_s_median": s["stage_s_median"], "update_s": [r["trainer.train_step"]
                                                                             for r in stage["steps"]],
                         "profiled_calls": prof.get("calls"), "profiled_device_time_s": prof.get("device_time_s")}
    before, after = stages["before_rows"], stages["after_auto"]
    result["train_stage"] = stages
    result["summary"] = {"check_passed": result["check"].get("passed"),
                         "update_s_before": before["update_s_median"], "update_s_after": after["update_s_median"],
                         "update_speedup": round(before["update_s_median"] / after["update_s_median"], 3),
                         "stage_s_before": before["stage_s_median"], "stage_s_after": after["stage_s_median"],
                         "paths": [before["attention_path"], after["attention_path"]],
                         "wall_s": round(time.perf_counter() - started, 1)}
    result["command"] = "python benchmarks/varlen_check.py " + " ".join(sys.argv[1:])
    result["environment"] = {"python": platform.python_version(), "torch": torch.__version__,
                             "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"]))
    if result["check"].get("passed") is False:
        sys.exit(1)


if __name__ == "__main__":
    main()
