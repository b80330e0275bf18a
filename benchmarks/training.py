"""Trainer throughput on a GPU: GRPOTrainer vs a straightforward unchunked baseline, same model, same rows.

Model: the Qwen2.5-1.5B shape (28 layers, hidden 1536, MLP 8960, 12 heads / 2 KV heads, vocab 151936,
tied embeddings) with random weights built from a Qwen2Config (no download), bf16, LoRA r16 alpha 32
on all linear layers. Rows: synthetic multi-turn agent trajectories of 2k-16k tokens (a prompt, then
completions of 100-800 tokens alternating with tool results of 200-1500 tokens), groups of 4, about
``--step-tokens`` tokens per optimizer step; about a third of the tokens are sampled (trained).

Measured (each after one warm-up step, over ``--steps`` optimizer steps):
- ``ours/*``: GRPOTrainer.train_step at 16k tokens per micro-batch (rows packed without padding,
  varlen causal attention per row, chunked logprobs on trained tokens only), with gradient
  checkpointing on none / a fraction / all of the layers, with or without the fused LoRA linear
  (``+fused``), compiled logprob chunk math (``+compiled-logprobs``), lean ops (``+lean``:
  memory_efficient_ops, with the fused LoRA SwiGLU MLP when fused), expandable allocator segments.
  Unsuffixed ``ours/*`` names are the configuration measured on 2026-11-29 (peft's LoRA forward, eager
  logprobs, stock ops), not today's defaults; ``ours/defaults`` is whatever today's 'auto' settings give.
- ``baseline/*``: the same CISPO loss written plainly: rows padded into micro-batches of at most 16k
  tokens (padding included), ``model(input_ids, attention_mask).logits`` over every position,
  float32 log_softmax, gather; peft LoRA, same AdamW. With and without HF gradient checkpointing.

tokens/s counts real row tokens (no padding) per wall-clock second of whole optimizer steps (row
building and packing included). MFU = 6 * N * tokens/s / 989 TFLOP/s with N = the base model's
parameter count (embedding counted once, LoRA not counted, attention FLOPs not counted), the
convention of the issue. Peak memory = torch.cuda.max_memory_allocated during a step. The CUDA cache
is emptied between variants only (the first committed run, 2026-11-29, also emptied it before every
step, which charged every variant, the baseline too, its cudaMalloc calls once per step). Before the
first variant, a few untimed steps warm the process up (``--process-warmup-steps``): without them the
first variant measured ran about half speed for several steps (run of commit b5acc87), which is what made
"no checkpointing" look slow in the 2026-11-29 runs, where it came first. Variants may also set the
caching allocator (``+expandable``: expandable_segments:True) and record its counters per step.

    python benchmarks/training.py --out benchmarks/results/training-h200.json
    python benchmarks/training.py --smoke        # CPU, tiny shape: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents.trajectory import SampledTurn, Trajectory, TrajectoryGroup  # noqa: E402
from backends.training.config import TrainerConfig  # noqa: E402
from backends.training.losses import assign_aggregation_weights  # noqa: E402
from backends.training.token_rows import build_rows  # noqa: E402
from backends.training.trainer import GRPOTrainer  # noqa: E402

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16, vendor datasheet

QWEN25_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)


def build_model(shape: dict, device: str, dtype: torch.dtype, seed: int = 0, family: str = "qwen2"):
    """Random weights of `shape` for a `family` ("qwen2" or "llama") decoder, built in `dtype` on `device`."""
    import transformers

    config_cls, model_cls = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "llama": ("LlamaConfig", "LlamaForCausalLM")}[family]
    cfg = getattr(transformers, config_cls)(**shape, attn_implementation="sdpa")
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def synthetic_groups(step: int, vocab: int, step_tokens: int, min_len: int, max_len: int) -> list[TrajectoryGroup]:
    """Multi-turn agent trajectories with exact-token turns; prompt of turn k+1 extends turn k."""
    rng = random.Random(1000 + step)
    base_lp = -math.log(vocab)  # a random model's logprob, so ratios stay near 1
    groups, total = [], 0
    while total < step_tokens:
        trajs = []
        for _ in range(4):
            target = rng.randint(min_len, max_len)
            scale = max_len / 16384
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(int(600 * scale) + 8, int(1500 * scale) + 16))]
            turns = []
            while True:
                n = rng.randint(int(100 * scale) + 2, int(800 * scale) + 4)
                if len(ctx) + n > target and turns:
                    break
                comp = [rng.randrange(vocab) for _ in range(n)]
                lps = [base_lp + rng.gauss(0, 0.1) for _ in range(n)]
                turns.append(SampledTurn(message={"role": "assistant", "content": ""}, prompt_token_ids=list(ctx),
                                         token_ids=comp, logprobs=lps))
                ctx = ctx + comp + [rng.randrange(vocab) for _ in range(rng.randint(int(200 * scale) + 2,
                                                                                     int(1500 * scale) + 4))]
            total += len(turns[-1].prompt_token_ids) + len(turns[-1].token_ids)
            trajs.append(Trajectory(messages_and_choices=turns, reward=rng.random()))
        groups.append(TrajectoryGroup(trajs))
    return groups


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")


def _reset(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _alloc_stats(device: str) -> dict:
    """Caching-allocator counters (cumulative): cudaMalloc/cudaFree calls, OOM-retries, reserved peak."""
    if not device.startswith("cuda"):
        return {}
    st = torch.cuda.memory_stats()
    return {"num_device_alloc": st.get("num_device_alloc", 0), "num_device_free": st.get("num_device_free", 0),
            "num_alloc_retries": st.get("num_alloc_retries", 0),
            "reserved_peak_gib": st.get("reserved_bytes.all.peak", 0) / 2**30}


def _set_allocator(device: str, settings: str) -> None:
    """Caching-allocator settings for the next variant (e.g. expandable_segments:True), on an empty cache."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings(settings)


def _reset_peak(device: str) -> None:
    """Between steps of one variant: new peak counter, but the allocator's cache stays warm (as in training)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def run_ours(name, shape, data, cfg_kwargs, device, dtype, steps, tok):
    model = build_model(shape, device, dtype)
    trainer = GRPOTrainer("bench", TrainerConfig(**cfg_kwargs), device=device, model=model, tokenizer=tok)
    out = {"name": name, "config": cfg_kwargs, "steps": []}
    for k in range(steps + 1):
        _reset_peak(device)
        _sync(device)
        t0 = time.perf_counter()
        m = trainer.train_step(data[k])
        _sync(device)
        m["wall_s"] = time.perf_counter() - t0
        m.update(_alloc_stats(device))
        out["steps"].append(m)
        print(f"  {name} step {k}: {m['tokens']:.0f} tok in {m['wall_s']:.2f}s = {m['tokens'] / m['wall_s']:.0f} tok/s,"
              f" peak {m['peak_memory_gib']:.1f} GiB, loss {m['loss']:.5f}, grad norm {m['grad_norm']:.5f},"
              f" {m['micro_batches']:.0f} micro-batches, alloc {_alloc_stats(device)}", flush=True)
    out["patched_ops"] = trainer.patched_ops
    out["fused_lora_layers"] = trainer.fused_lora_layers
    out["packed"] = trainer.packed
    del trainer, model
    return out


def run_baseline(name, shape, data, cfg_kwargs, device, dtype, steps, gc_on):
    """Plain CISPO: padded micro-batches, full logits, float32 log_softmax; peft LoRA, AdamW."""
    from peft import LoraConfig, get_peft_model

    cfg = TrainerConfig(**cfg_kwargs)
    model = build_model(shape, device, dtype)
    torch.manual_seed(cfg.seed)
    model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules="all-linear",
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    if gc_on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=cfg.adam_betas, weight_decay=0.0,
                            **({"fused": True} if device.startswith("cuda") else {}))
    eps, eps_high = cfg.clip_range()
    autocast = torch.autocast("cuda", dtype=dtype) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)
    out = {"name": name, "config": {**cfg_kwargs, "gradient_checkpointing": gc_on}, "steps": []}
    model.train()
    for k in range(steps + 1):
        _reset_peak(device)
        _sync(device)
        t0 = time.perf_counter()
        rows, _ = build_rows(data[k], max_row_tokens=cfg.max_row_tokens, scale_rewards=True)
        assign_aggregation_weights(rows, "sequence_mean")
        batches, cur = [], []
        for r in rows:  # in order, padded to the longest row, at most micro_batch_tokens incl. padding
            if cur and max(map(len, cur + [r])) * (len(cur) + 1) > cfg.micro_batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(r)
        batches.append(cur)
        total_loss, padded = 0.0, 0
        for b in batches:
            width = max(map(len, b))
            padded += width * len(b)
            ids = torch.zeros(len(b), width, dtype=torch.long, device=device)
            att = torch.zeros(len(b), width, dtype=torch.long, device=device)
            mask = torch.zeros(len(b), width, dtype=torch.bool, device=device)
            old = torch.zeros(len(b), width, device=device)
            adv = torch.zeros(len(b), width, device=device)
            w = torch.zeros(len(b), width, device=device)
            for i, r in enumerate(b):
                n = len(r)
                ids[i, :n] = torch.tensor(r.token_ids)
                att[i, :n] = 1
                mask[i, :n] = torch.tensor(r.loss_mask)
                old[i, :n] = torch.tensor(r.sampler_logprobs)
                adv[i, :n], w[i, :n] = r.advantage, r.weight
            with autocast:
                logits = model(input_ids=ids, attention_mask=att).logits
            logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            logp = logp_all.gather(2, ids[:, 1:, None]).squeeze(-1)
            m = mask[:, 1:]
            ratio = torch.exp(logp.detach() - old[:, 1:])
            per_tok = -ratio.clamp(1 - eps, 1 + eps_high) * adv[:, 1:] * logp
            loss = (per_tok * w[:, 1:] * m).sum()
            loss.backward()
            total_loss += float(loss)
            del logits, logp_all, logp, loss
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        wall = time.perf_counter() - t0
        tokens = sum(len(r) for r in rows)
        m = {"tokens": tokens, "padded_tokens": padded, "wall_s": wall, "peak_memory_gib": _peak(device),
             "loss": total_loss, "grad_norm": grad_norm, "micro_batches": len(batches), **_alloc_stats(device)}
        out["steps"].append(m)
        print(f"  {name} step {k}: {tokens} tok ({padded} padded) in {wall:.2f}s = {tokens / wall:.0f} tok/s,"
              f" peak {m['peak_memory_gib']:.1f} GiB, loss {total_loss:.5f}, {len(batches)} micro-batches", flush=True)
    del model, opt, params
    return out


def summarise(result: dict, n_params: int) -> dict:
    timed = result["steps"][1:]
    tokens = sum(s["tokens"] for s in timed)
    wall = sum(s["wall_s"] for s in timed)
    tps = tokens / wall
    return {
        "name": result["name"],
        "tokens_per_s": round(tps),
        "mfu_percent": round(100 * 6 * n_params * tps / (PEAK_TFLOPS * 1e12), 1),
        "peak_memory_gib": round(max(s["peak_memory_gib"] for s in timed), 1),
        "tokens_per_step": round(tokens / len(timed)),
        "first_step_loss": result["steps"][0]["loss"],
        "first_step_grad_norm": result["steps"][0].get("grad_norm"),
        "first_step_wall_s": round(result["steps"][0]["wall_s"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per variant (after one warm-up)")
    ap.add_argument("--step-tokens", type=int, default=98304, help="row tokens per optimizer step")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--only", default="", help="comma list of variant names to run (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, to check the script")
    ap.add_argument("--process-warmup-steps", type=int, default=2,
                    help="untimed steps of the first listed 'ours' variant before any variant is measured (GPU): "
                    "the first variant of a process ran ~2x slow for several steps (results/training-h200.md)")
    args = ap.parse_args()

    from backends.modeling.loading import build_tiny_tokenizer

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shape = TINY if args.smoke else QWEN25_15B
    min_len, max_len = (128, 1024) if args.smoke else (2048, 16384)
    mb = 1024 if args.smoke else args.micro_batch_tokens
    step_tokens = 6000 if args.smoke else args.step_tokens
    tok = build_tiny_tokenizer()
    data = [synthetic_groups(k, shape["vocab_size"], step_tokens, min_len, max_len) for k in range(args.steps + 1)]

    common = dict(lora_rank=16, lora_alpha=32, target_modules="all-linear", learning_rate=1e-5,
                  max_row_tokens=max_len, micro_batch_tokens=mb, seed=0, backend="peft")
    gc = dict(gradient_checkpointing=True)
    lean = dict(memory_efficient_ops="on")
    peft_ops = dict(fused_lora="off", compile_logprobs="off", memory_efficient_ops="off")  # none of our kernels
    fused = dict(fused_lora="on", compile_logprobs="off", memory_efficient_ops="off")
    fused_comp = dict(fused_lora="on", compile_logprobs="on", memory_efficient_ops="off")  # + compiled logprobs
    fused_comp_lean = dict(fused_lora="on", compile_logprobs="on", memory_efficient_ops="on")  # the GPU defaults
    exp = "expandable_segments:True"  # caching-allocator setting of a variant (default: PyTorch's own)
    variants = {
        "ours/no-checkpointing": ("ours", dict(common, **peft_ops), ""),
        "ours/checkpoint-12%": ("ours", dict(common, **peft_ops, **gc, checkpoint_layer_fraction=0.125), ""),
        "ours/checkpoint-25%": ("ours", dict(common, **peft_ops, **gc, checkpoint_layer_fraction=0.25), ""),
        "ours/checkpoint-50%": ("ours", dict(common, **peft_ops, **gc, checkpoint_layer_fraction=0.5), ""),
        "ours/checkpoint-all": ("ours", dict(common, **peft_ops, **gc), ""),
        "ours/checkpoint-25%-lean-ops": ("ours", dict({**common, **peft_ops, **lean}, **gc,
                                                      checkpoint_layer_fraction=0.25), ""),
        "ours/no-checkpointing+expandable": ("ours", dict(common, **peft_ops), exp),
        "ours/checkpoint-25%+expandable": ("ours", dict(common, **peft_ops, **gc, checkpoint_layer_fraction=0.25),
                                           exp),
        "ours/checkpoint-25%+fused": ("ours", dict(common, **fused, **gc, checkpoint_layer_fraction=0.25), ""),
        "ours/checkpoint-25%+fused+expandable": ("ours", dict(common, **fused, **gc, checkpoint_layer_fraction=0.25),
                                                 exp),
        "ours/checkpoint-12%+fused+expandable": ("ours", dict(common, **fused, **gc, checkpoint_layer_fraction=0.125),
                                                 exp),
        "ours/no-checkpointing+fused+expandable": ("ours", dict(common, **fused), exp),
        "ours/no-checkpointing+fused+lean-ops+expandable": ("ours", {**common, **fused, **lean}, exp),
        "ours/checkpoint-25%+fused+expandable+compiled-logprobs": (
            "ours", dict(common, **fused_comp, **gc, checkpoint_layer_fraction=0.25), exp),
        "ours/checkpoint-25%+fused+expandable+compiled-logprobs+chunk-4096": (
            "ours", dict(common, **fused_comp, **gc, checkpoint_layer_fraction=0.25, logprob_chunk=4096), exp),
        "ours/checkpoint-25%+fused+compiled-logprobs": (
            "ours", dict(common, **fused_comp, **gc, checkpoint_layer_fraction=0.25), ""),
        "ours/no-checkpointing+fused+expandable+compiled-logprobs": ("ours", dict(common, **fused_comp), exp),
        "ours/defaults": ("ours", dict(common), ""),  # whatever 'auto' resolves to on this machine
        "ours/no-checkpointing+fused+compiled-logprobs+lean": ("ours", dict(common, **fused_comp_lean), ""),
        "ours/no-checkpointing+fused+compiled-logprobs+lean+chunk-4096": (
            "ours", dict(common, **fused_comp_lean, logprob_chunk=4096), ""),
        "ours/checkpoint-25%+fused+compiled-logprobs+lean": (
            "ours", dict(common, **fused_comp_lean, **gc, checkpoint_layer_fraction=0.25), ""),
        "ours/no-checkpointing+fused+compiled-logprobs+lean+expandable": ("ours", dict(common, **fused_comp_lean),
                                                                          exp),
        "baseline/no-checkpointing": ("baseline", dict(common), ""),
        "baseline/checkpointing": ("baseline-gc", dict(common), ""),
    }
    if args.only:
        keep = args.only.split(",")
        unknown = [k for k in keep if k not in variants]
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {list(variants)}")
        variants = {k: variants[k] for k in keep}  # in the order given

    import peft
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
           "python": platform.python_version(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "command": "python " + " ".join(sys.argv)}
    n_params = sum(p.numel() for p in build_model(shape, "meta", dtype).parameters())
    rows_info = [len(r) for r in build_rows(data[0], max_row_tokens=max_len)[0]]
    print(f"env {env}\nmodel params {n_params / 1e9:.3f}B; step 0: {len(rows_info)} rows, {sum(rows_info)} tokens, "
          f"row lengths {min(rows_info)}..{max(rows_info)}", flush=True)
    results, summary = [], []
    warm = next((cfg for kind, cfg, _ in variants.values() if kind == "ours"), None)
    if device == "cuda" and args.process_warmup_steps > 0 and warm is not None:
        print("== process warm-up (not reported)", flush=True)
        run_ours("process-warm-up", shape, data, warm, device, dtype, args.process_warmup_steps - 1, tok)
        _reset(device)
    for name, (kind, cfg, alloc) in variants.items():
        print(f"== {name}", flush=True)
        _reset(device)
        try:
            if alloc:
                _set_allocator(device, alloc)
            if kind == "ours":
                res = run_ours(name, shape, data, cfg, device, dtype, args.steps, tok)
            else:
                res = run_baseline(name, shape, data, cfg, device, dtype, args.steps, gc_on=kind == "baseline-gc")
            results.append(res)
            summary.append({**summarise(res, n_params), "allocator": alloc or "default"})
            print(f"   -> {summary[-1]}", flush=True)
        except torch.OutOfMemoryError as exc:
            print(f"   -> out of memory: {str(exc)[:200]}", flush=True)
            summary.append({"name": name, "error": "out of memory"})
        except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
            traceback.print_exc()
            summary.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        _reset(device)
        if alloc:
            _set_allocator(device, "expandable_segments:False")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"env": env, "n_params": n_params, "summary": summary,
                                                  "runs": results}, indent=1, default=str))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
