"""What a user gets from the trainer in a fresh process: cold start, the first steps, and the steady speed.

A GRPO update in deployment mode runs in a new process every step, so the figure that matters is not the
speed of the 7th variant in a warm process (``benchmarks/training.py``) but, per process:

- ``cold_start_s``: from the parent starting the child process (``subprocess.Popen``) to the end of its first
  optimizer step (``torch.cuda.synchronize`` after the step): interpreter start, imports, model build,
  trainer set-up (incl. ``GRPOTrainer.warm_up`` when on) and step 0;
- ``warm_up_s`` and ``warm_up_runs``: what the warm-up took and ran (micro-batches, tokens, and with 'cudnn' or
  'auto''s long rows the bucket, how many padded row lengths it built plans for, one attention call each, and the
  first of them);
- ``attention`` and, per step, ``attention_paths``: the trainer's attention rule and how many micro-batches took
  each path (with 'auto' the micro-batch's rows decide);
- ``first_in_process_tok_s``: row tokens / wall seconds of steps 1..3 of that process (the first steps after the
  one that paid the cold start);
- ``steady_tok_s``: the same over the last ``--steady-steps`` steps (steps under ``--profile-steps`` left out of both);
- per step: wall, ``gpu_busy_s`` (CUDA events recorded at the step's start and end: the GPU's elapsed time over the
  step, idle gaps included, so it reads as the wall unless the GPU ran behind; ``--profile-steps`` gives the busy and
  idle split), process CPU seconds, cudaMalloc calls, Dynamo graph count and compile seconds, so a slow step says
  whether it waited for the GPU, compiled or allocated;
- per ``--profile-steps`` step: syncs, launches and op counts (``profile_counts``) and where the step's wall time
  goes that no kernel uses (``profile_gaps``, ``benchmarks/profile_gaps.py``: the GPU's busy and idle time, its
  largest idle gaps with what the host ran, CUDA time by category, the host threads' time and the step thread's
  CPU seconds); ``--profile-shapes`` records the ops' input shapes (splits GEMMs into base and LoRA-sized, at some
  host cost), ``--profile-stack`` the Python stacks (names the Python function open at each gap; costlier).

Each configuration runs as its own child process (``--child``), one after another, never two at once. The
compile cache (``TORCHINDUCTOR_CACHE_DIR``) is a fresh empty folder for ``cold-cache`` runs and the folder a
previous child filled for ``warm-cache`` runs: a spot machine starts with the first, a per-step process on the
same machine gets the second. A ``store-cache`` run has a fresh empty folder too, and the run store (a local folder
standing in for the run's storage: ``TrainerConfig.compile_cache``, ``backends/training/compile_cache.py``) that the
configuration's previous ``cold-cache`` or ``store-cache`` run saved its compile artifacts into: a fresh machine of a
run whose earlier update stored them. A ``cold-cache`` run gets a new empty store (it compiles, then saves into it);
a ``warm-cache`` run none. ``warm_up_runs`` then says what was loaded (``compile_cache_loaded``), how many local cache
hits followed (``compile_cache_hits``) and what was saved (``compile_cache_saved``). ``--smoke`` turns the compile
cache on (its 'auto' is off on the CPU; with nothing compiled it stores nothing).

Model, rows and definitions as ``benchmarks/training.py`` (Qwen2.5-1.5B shape, random weights, bf16, LoRA r16 on
all linear layers, synthetic multi-turn rows of 2k-16k tokens, ~98k tokens per step, 16k per micro-batch).
MFU two ways: the 6N convention (N = base parameters, LoRA and attention not counted) and LoRA-aware:
forward 2N + attention, backward 2N (activation gradients only; frozen weights get none) + 2x attention, plus
the LoRA matmuls (6 x LoRA parameters); attention per row of length L: 4 x layers x hidden x L^2 / 2 (causal)
forward, so 3x that forward + backward.

    python benchmarks/training_fresh_process.py --out benchmarks/results/training-fresh-h200.json
    python benchmarks/training_fresh_process.py --smoke --out /tmp/fresh.json   # CPU, tiny shape, seconds
    # 'auto' (per micro-batch) against its two sides and cuDNN with a larger budget, one process each:
    RUNS=defaults+warm-up:cold-cache,varlen+warm-up:cold-cache,cudnn+warm-up:cold-cache,cudnn-mb24k+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 7 --steady-steps 3 --profile-steps 5 --runs $RUNS \\
        --out $OUT/training-fresh-auto-h200.json

    # a fresh machine whose run storage holds the compile artifacts of an earlier update (trainer.compile_cache):
    # cold local caches, then cold local caches with the store the cold run filled
    python benchmarks/training_fresh_process.py --steps 2 --steady-steps 1 \\
        --runs defaults+warm-up:cold-cache,defaults+warm-up:store-cache --out $OUT/training-fresh-store-cache-h200.json

    # where the ~0.4 s a step that no kernel uses goes (GPU idle gaps, CUDA time by category, host time)
    python benchmarks/training_fresh_process.py --steps 6 --steady-steps 2 --profile-steps 4 --profile-shapes \\
        --runs defaults+warm-up:cold-cache --out $OUT/training-fresh-gaps-h200.json

    # the LoRA projections' per-micro-batch work: now (defaults) against before (casts and autograd's grads per
    # micro-batch), each profiled at step 5 (syncs, launches, op counts, device time in the summary's ``profiled``)
    RUNS=defaults+warm-up:cold-cache,lora-per-micro-batch+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 8 --steady-steps 3 --profile-steps 5 --runs $RUNS \\
        --out $OUT/training-fresh-loragrad-h200.json

    # LoRA's B product folded into the gate/up GEMMs (defaults) against not folded, and folded everywhere
    RUNS=fold-off+warm-up:cold-cache,defaults+warm-up:cold-cache,fold-everywhere+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 6 --steady-steps 3 --runs $RUNS \\
        --out $OUT/training-fresh-fold-h200.json

    # the frozen base products as FP8 GEMMs (trainer.fp8_base, opt-in) against the defaults; the fp8 run also records
    # once, after its steps, the mean and max |logprob fp8 - bf16| over step 0's rows (no grad: fp8_logprob_gap)
    RUNS=defaults+warm-up:cold-cache,fp8+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 6 --steady-steps 3 --runs $RUNS \\
        --out $OUT/training-fresh-fp8-h200.json

    # q, k and v as one LoRA product per attention layer (trainer.group_qkv, opt-in) against the defaults, each
    # profiled at step 4 (launches and op counts in the summary's ``profiled``)
    RUNS=defaults+warm-up:cold-cache,group-qkv+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 6 --steady-steps 2 --profile-steps 4 --runs $RUNS \\
        --out $OUT/training-fresh-group-qkv-h200.json

    # the norm outputs no longer kept for backward (trainer.recompute_norm, defaults) against kept, at 16k and 24k
    # tokens per micro-batch, then 20k, and 24k with group_qkv: which reaches the most tokens/s at <= 40 GiB peak?
    RUNS=norm-off+warm-up:cold-cache,defaults+warm-up:cold-cache,mb24k-norm-off+warm-up:cold-cache
    RUNS=$RUNS,mb24k+warm-up:cold-cache,mb20k+warm-up:cold-cache,mb24k-group-qkv+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 5 --steady-steps 2 --runs $RUNS \\
        --out $OUT/training-fresh-norm-h200.json

    # LoRA's A folded into the input-gradient GEMMs of down, k and v (trainer.fold_lora_a, opt-in), and cuDNN rows
    # padded to 256 instead of the default 512, each against 24k-token micro-batches with the defaults
    RUNS=mb24k+warm-up:cold-cache,mb24k-fold-a+warm-up:cold-cache,mb24k-b256+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 7 --steady-steps 3 --runs $RUNS \\
        --out $OUT/training-fresh-fold-a-h200.json

    # the fused LoRA ops' rank-r product first and the base GEMM adding into it (trainer.low_rank_first, opt-in)
    # against 24k-token micro-batches with the defaults
    RUNS=mb24k+warm-up:cold-cache,mb24k-low-rank-first+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 7 --steady-steps 3 --runs $RUNS \\
        --out $OUT/training-fresh-low-rank-first-h200.json

    # q, k and v's input gradients summed in their GEMMs (trainer.chain_input_grads, 'auto' on CUDA), on and off
    RUNS=mb24k-chain-off+warm-up:cold-cache,mb24k-chain-on+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 7 --steady-steps 3 --runs $RUNS \\
        --out $OUT/training-fresh-chain-h200.json

    # the LoRA SwiGLU MLP's rank-r reductions fused into its elementwise Triton kernels (trainer.fused_swiglu_lora)
    # off against on, 24k-token micro-batches
    RUNS=mb24k-swiglu-off+warm-up:cold-cache,mb24k-swiglu-on+warm-up:cold-cache
    python benchmarks/training_fresh_process.py --steps 7 --steady-steps 3 --runs $RUNS \\
        --out $OUT/training-fresh-swiglu-h200.json

``--smoke`` warms up on the CPU too for the ``+warm-up`` configurations ('auto' would not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections import Counter
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16, vendor datasheet
CONFIGS = {  # name: trainer settings on top of the benchmark's common ones (the defaults warm up on CUDA)
    "defaults+warm-up": {},
    "no-warm-up": {"warm_up": "off"},
    "sdpa-default+warm-up": {"attention_kernel": "sdpa-default"},
    "flash+warm-up": {"attention_kernel": "flash"},  # one SDPA call per packed row (auto is varlen on CUDA)
    # cuDNN first, rows padded to a multiple of the bucket; the warm-up builds each padded length's plans
    "cudnn+warm-up": {"attention_kernel": "cudnn"},
    "cudnn-b256+warm-up": {"attention_kernel": "cudnn", "attention_bucket": 256},
    # 'auto' is chosen per micro-batch (cuDNN rows where every row is long, else varlen): these are its two sides
    "varlen+warm-up": {"attention_kernel": "varlen"},  # the 'auto' before the per-micro-batch choice
    "cudnn-mb24k+warm-up": {"attention_kernel": "cudnn", "micro_batch_tokens": 24576},  # over --micro-batch-tokens
    # the defaults where the logprob kernels compile on the CPU too (on CUDA the same as the defaults): a smoke of the
    # compile cache, whose runs compile nothing on the CPU otherwise
    "compiled-logprobs+warm-up": {"compile_logprobs": "on"},
    # the defaults with fewer, larger micro-batches (fewer launches per token; more activation memory: <= 40 GiB?)
    "mb24k+warm-up": {"micro_batch_tokens": 24576},
    "mb32k+warm-up": {"micro_batch_tokens": 32768},
    "mb20k+warm-up": {"micro_batch_tokens": 20480},
    # the fused ops keeping each norm's output again for backward (recompute_norm is on by default on CUDA)
    "norm-off+warm-up": {"recompute_norm": "off"},
    "mb24k-norm-off+warm-up": {"micro_batch_tokens": 24576, "recompute_norm": "off"},
    "mb24k-group-qkv+warm-up": {"micro_batch_tokens": 24576, "group_qkv": "on"},
    # q, k and v's input gradients summed in their GEMMs (trainer.chain_input_grads, 'auto' on CUDA) and not
    "mb24k-chain-off+warm-up": {"micro_batch_tokens": 24576, "chain_input_grads": "off"},
    "mb24k-chain-on+warm-up": {"micro_batch_tokens": 24576, "chain_input_grads": "on"},
    # LoRA's A folded into the base input-gradient GEMM where the input is wide (down, k, v; trainer.fold_lora_a)
    "mb24k-fold-a+warm-up": {"micro_batch_tokens": 24576, "fold_lora_a": "on"},
    "mb24k-fold-a-off+warm-up": {"micro_batch_tokens": 24576, "fold_lora_a": "off"},  # its default is on on CUDA
    # the fused LoRA ops' rank-r product first, the base GEMM adding into it (trainer.low_rank_first, opt-in)
    "mb24k-low-rank-first+warm-up": {"micro_batch_tokens": 24576, "low_rank_first": "on"},
    "mb24k-low-rank-first-off+warm-up": {"micro_batch_tokens": 24576, "low_rank_first": "off"},  # on on CUDA
    # the LoRA SwiGLU MLP's rank-r reductions inside its elementwise Triton kernels (trainer.fused_swiglu_lora), off and
    # on at 24k-token micro-batches
    "mb24k-swiglu-off+warm-up": {"micro_batch_tokens": 24576, "fused_swiglu_lora": "off"},
    "mb24k-swiglu-on+warm-up": {"micro_batch_tokens": 24576, "fused_swiglu_lora": "on"},
    # the attention rule's cuDNN rows padded to a multiple of 256
    "mb24k-b256+warm-up": {"micro_batch_tokens": 24576, "attention_bucket": 256},
    "mb24k-b128+warm-up": {"micro_batch_tokens": 24576, "attention_bucket": 128},
    "mb24k-low-rank-first-b256+warm-up": {"micro_batch_tokens": 24576, "low_rank_first": "on", "attention_bucket": 256},
    # the fused LoRA ops' work around their products as before the cast cache and the fp32 grad accumulation
    # (both on by default on CUDA), together and one at a time
    "lora-per-micro-batch+warm-up": {"cache_lora_casts": "off", "accumulate_lora_grads": "off"},
    "no-cast-cache+warm-up": {"cache_lora_casts": "off"},
    "autograd-lora-grads+warm-up": {"accumulate_lora_grads": "off"},
    # LoRA's B product folded into the base GEMM where the output is wide (defaults on CUDA: the MLP's gate and up)
    # against not folded, and folded everywhere it can be (q, k, v, o, down too: where the rule says it does not pay)
    "fold-off+warm-up": {"fold_lora_b": "off"},
    "fold-everywhere+warm-up": {"fold_lora_b": "on"},
    # the frozen base weights' products in FP8 (fold_lora_b is off with it); the smoke turns fused_lora on for it
    "fp8+warm-up": {"fp8_base": "on"},
    # rotary embedding as transformers' elementwise kernels, against the one fused op per layer (on by default on CUDA)
    "rope-off+warm-up": {"fused_rope": "off"},
    # an attention layer's q, k and v as one LoRA product (trainer.group_qkv, opt-in) against the defaults
    "group-qkv+warm-up": {"group_qkv": "on"},
    # the loss' gradient through the output head computed in the logprob forward (no logits recomputed in backward;
    # trainer.logprob_grad_in_forward, 'auto' on) against the recomputing backward
    "mb24k-head-grad-off+warm-up": {"micro_batch_tokens": 24576, "logprob_grad_in_forward": "off"},
    "mb24k-head-grad-on+warm-up": {"micro_batch_tokens": 24576, "logprob_grad_in_forward": "on"},
}

# aten ops whose counts per step the profile summary keeps (the ones the LoRA cast cache and grad accumulation cut)
COUNTED_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::copy_", "aten::_to_copy", "aten::mul", "aten::mul_",
               "aten::add_", "aten::add")


def profile_counts(events) -> dict:
    """What a profiled step launched and waited for, from its ``key_averages()``: calls of each CUDA runtime
    synchronisation (``cudaStreamSynchronize`` is what ``.item()``, ``.tolist()`` and a pageable host-to-device copy
    wait in), kernel launches, the counts of ``COUNTED_OPS``, and the device time summed over every event (kernels,
    copies and fills, each counted once as self time)."""
    calls = {e.key: e.count for e in events}
    device_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
                    for e in events)
    return {
        "stream_syncs": calls.get("cudaStreamSynchronize", 0),
        "syncs": {k: v for k, v in calls.items() if k.startswith("cu") and "Synchronize" in k},
        "kernel_launches": sum(v for k, v in calls.items() if k.startswith("cu") and "LaunchKernel" in k),
        "memcpy_calls": sum(v for k, v in calls.items() if k.startswith("cu") and "Memcpy" in k),
        "ops": {k: calls[k] for k in COUNTED_OPS if k in calls},
        "device_time_s": round(device_us / 1e6, 4),
    }


def lora_aware_flops(n_params: int, lora_params: int, shape: dict, row_lengths: list[int]) -> float:
    """FLOPs of one optimizer step over rows of these lengths (see the module docstring)."""
    tokens = sum(row_lengths)
    attn_fwd = sum(4 * shape["num_hidden_layers"] * shape["hidden_size"] * n * n / 2 for n in row_lengths)
    return 4 * n_params * tokens + 3 * attn_fwd + 6 * lora_params * tokens


def fp8_logprob_gap(trainer, groups, max_row_tokens: int) -> dict:
    """Mean and max |logprob_fp8 - logprob_bf16| over the trained tokens of ``groups``' rows: one no-grad forward
    each way per micro-batch, the same adapter."""
    import torch

    from backends.training.token_rows import build_rows

    rows = build_rows(groups, max_row_tokens=max_row_tokens)[0]
    gaps = []
    with torch.no_grad():
        for mb in trainer.micro_batches(rows):
            bf16 = trainer.token_logprobs(mb)
            with trainer.fp8_scope():
                gaps.append((trainer.token_logprobs(mb) - bf16).abs().float())
    gap = torch.cat(gaps)
    return {"mean": float(gap.mean()), "max": float(gap.max()), "tokens": gap.numel()}


def child(args) -> None:
    t_start = time.time()
    import torch

    from benchmarks import profile_gaps
    from benchmarks.training import QWEN25_15B, TINY, build_model, synthetic_groups
    from backends.modeling.loading import build_tiny_tokenizer
    from backends.training.config import TrainerConfig
    from backends.training.packing import plan_bins
    from backends.training.token_rows import build_rows
    from backends.training.trainer import GRPOTrainer

    t_imported = time.time()
    cuda = not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = TINY if args.smoke else QWEN25_15B
    min_len, max_len = (128, 1024) if args.smoke else (2048, 16384)
    step_tokens = 6000 if args.smoke else args.step_tokens
    settings = CONFIGS[args.config]
    if args.smoke and args.config.endswith("+warm-up"):  # 'auto' warms up on CUDA only: the smoke runs it too
        settings = {"warm_up": "on", **settings}
    if args.smoke:
        settings = {"compile_cache": "on", **settings}
    # fused_lora's 'auto' is off on the CPU: the smoke turns it on for the switches that act only with it
    if args.smoke and "on" in (settings.get("fp8_base"), settings.get("group_qkv"), settings.get("fold_lora_a"),
                                  settings.get("low_rank_first")):
        settings = {"fused_lora": "on", **settings}
    if args.smoke and "chain_input_grads" in settings:  # it acts only with recompute_norm ('auto': CUDA), on or off
        settings = {"fused_lora": "on", "memory_efficient_ops": "on", "recompute_norm": "on", **settings}
    common = {"micro_batch_tokens": 1024 if args.smoke else args.micro_batch_tokens}  # a variant may override it
    cfg = TrainerConfig(lora_rank=16, lora_alpha=32, target_modules="all-linear", learning_rate=1e-5,
                        max_row_tokens=max_len, seed=0, backend="peft", **{**common, **settings})
    model = build_model(shape, device, dtype)
    if cuda:
        torch.cuda.synchronize()
    t_model = time.time()
    store = None
    if args.compile_store:
        from storage.compile_cache import StoreCompileCache
        from storage.store import RunStore

        store = StoreCompileCache(RunStore(args.compile_store, "bench", "run"))
    trainer = GRPOTrainer("bench", cfg, device=device, model=model, tokenizer=build_tiny_tokenizer(),
                          compile_cache=store)
    if cuda:
        torch.cuda.synchronize()
    t_trainer = time.time()
    print(f"  [{args.config}] warm-up {trainer.warm_up_s:.2f}s: {trainer.warm_up_runs}", flush=True)
    data = [synthetic_groups(k, shape["vocab_size"], step_tokens, min_len, max_len) for k in range(args.steps)]
    n_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    lora_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)

    from torch._dynamo.utils import counters

    def compile_seconds() -> float:
        try:
            from torch._dynamo.utils import compilation_time_metrics
            return sum(sum(v) for v in compilation_time_metrics.values())
        except ImportError:
            return float("nan")

    def cpu_seconds() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    steps = []
    for k in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            allocs0 = torch.cuda.memory_stats().get("num_device_alloc", 0)
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            ev0.record()
        graphs0, comp0, cpu0 = counters["stats"]["unique_graphs"], compile_seconds(), cpu_seconds()
        prof, marked = None, contextlib.nullcontext()
        if k in args.profile_steps:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []),
                                          record_shapes=args.profile_shapes, with_stack=args.profile_stack)
            prof.__enter__()
            marked = torch.profiler.record_function(profile_gaps.STEP)
        t0, thread0 = time.perf_counter(), time.thread_time()
        with marked:
            m = trainer.train_step(data[k])
        thread_cpu = time.thread_time() - thread0
        if cuda:
            ev1.record()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        rows = [len(r) for r in build_rows(data[k], max_row_tokens=max_len)[0]]
        bins = [[rows[i] for i in b] for b in plan_bins(rows, trainer.micro_batch_tokens)]
        rec = {"step": k, "wall_s": wall, "done_at": time.time(), "tokens": m["tokens"], "tok_s": m["tokens"] / wall,
               "peak_gib": m["peak_memory_gib"], "loss": m["loss"], "cpu_s": cpu_seconds() - cpu0,
               "new_graphs": counters["stats"]["unique_graphs"] - graphs0, "compile_s": compile_seconds() - comp0,
               "flops_lora_aware": lora_aware_flops(n_params, lora_params, shape, rows),
               # micro-batches per attention path as the trainer chose them ('auto': by their rows' lengths)
               "attention_paths": Counter(trainer.attention.mode(b).path for b in bins)}
        if cuda:
            rec["gpu_busy_s"] = ev0.elapsed_time(ev1) / 1000
            rec["device_allocs"] = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs0
        if prof is not None:
            prof.__exit__(None, None, None)
            table = prof.key_averages()
            rec["profile_counts"] = profile_counts(table)
            rec["profile_gaps"] = profile_gaps.summarise(profile_gaps.trace_events(prof), step_thread_cpu_s=thread_cpu,
                                                         lora_dim=cfg.lora_rank, top_kernels=40)
            rec["profile_by_cpu"] = table.table(sort_by="self_cpu_time_total", row_limit=25)
            if cuda:
                rec["profile_by_cuda"] = table.table(sort_by="self_cuda_time_total", row_limit=25)
        steps.append(rec)
        print(f"  [{args.config}] step {k}: {rec['tokens']:.0f} tok {wall:.2f}s = {rec['tok_s']:.0f} tok/s, "
              f"cpu {rec['cpu_s']:.2f}s, new graphs {rec['new_graphs']}, compile {rec['compile_s']:.1f}s, "
              f"allocs {rec.get('device_allocs')}, peak {rec['peak_gib']:.1f} GiB", flush=True)
    fp8_gap = fp8_logprob_gap(trainer, data[0], max_len) if trainer.fp8 is not None else None
    out = {"config": args.config, "settings": settings, "attention": trainer.attention_path, "fp8_logprob_gap": fp8_gap,
           "fp8_lora_layers": trainer.fp8_lora_layers, "grouped_qkv_layers": trainer.grouped_qkv_layers,
           "recompute_norm": trainer.recompute_norm, "chain_input_grads": trainer.chain_input_grads,
           "row_folded_lora_layers": trainer.row_folded_lora_layers,
           "micro_batch_tokens": trainer.micro_batch_tokens, "warm_up_s": trainer.warm_up_s,
           "warm_up_runs": trainer.warm_up_runs, "folded_lora_layers": trainer.folded_lora_layers, "n_params": n_params,
           "lora_params": lora_params, "t_start": t_start, "t_imported": t_imported, "t_model": t_model,
           "t_trainer": t_trainer, "steps": steps}
    Path(args.child_out).write_text(json.dumps(out))


CACHE_MODES = ("cold-cache", "warm-cache", "store-cache")


class CacheFolders:
    """Each run's local compile cache folder and run store (see the module docstring), per configuration, under
    ``work``."""

    def __init__(self, work: Path):
        self.work, self.inductor, self.stores = work, {}, {}

    def of(self, config: str, cache: str) -> tuple[Path, Path | None]:
        """(``TORCHINDUCTOR_CACHE_DIR``, run store root or None) of the next ``config`` run with ``cache``."""
        if cache != "warm-cache" or config not in self.inductor:
            self.inductor[config] = Path(tempfile.mkdtemp(prefix="inductor-", dir=self.work))
        if cache == "warm-cache":
            return self.inductor[config], None
        if cache == "cold-cache" or config not in self.stores:
            self.stores[config] = Path(tempfile.mkdtemp(prefix="store-", dir=self.work))
        return self.inductor[config], self.stores[config]


def _rate(steps: list[dict]) -> float:
    return sum(s["tokens"] for s in steps) / sum(s["wall_s"] for s in steps)


def summarise_run(run: dict, steady_steps: int) -> dict:
    """Rates over steps run without the profiler (a profiled step runs ~15% slower): first in process = steps 1-3,
    steady = the last `steady_steps`."""
    s, spawned = run["steps"], run["spawned_at"]
    plain = [x for x in s[1:] if "profile_by_cpu" not in x]
    first = [x for x in s[1:4] if "profile_by_cpu" not in x]
    window = plain[-steady_steps:]
    steady = _rate(window)
    flops = sum(x["flops_lora_aware"] for x in window) / sum(x["wall_s"] for x in window)
    return {
        "config": run["config"], "cache": run["cache"],
        "cold_start_s": round(s[0]["done_at"] - spawned, 2),
        "start_to_imported_s": round(run["t_imported"] - spawned, 2),
        "model_build_s": round(run["t_model"] - run["t_imported"], 2),
        "trainer_setup_s": round(run["t_trainer"] - run["t_model"], 2),
        "warm_up_s": round(run["warm_up_s"], 2),
        "warm_up_runs": run.get("warm_up_runs", {}),
        "attention": run.get("attention"), "micro_batch_tokens": run.get("micro_batch_tokens"),
        "folded_lora_layers": run.get("folded_lora_layers"),
        "row_folded_lora_layers": run.get("row_folded_lora_layers"),
        "fp8_lora_layers": run.get("fp8_lora_layers"),
        "grouped_qkv_layers": run.get("grouped_qkv_layers"),
        "recompute_norm": run.get("recompute_norm"),
        "chain_input_grads": run.get("chain_input_grads"),
        # fp8 runs: |logprob fp8 - bf16| over step 0's trained tokens, measured once after the steps (no grad)
        "fp8_logprob_gap": run.get("fp8_logprob_gap"),
        "attention_paths_steady": [x.get("attention_paths") for x in window],
        "step0_s": round(s[0]["wall_s"], 2),
        "first_in_process_tok_s": round(_rate(first)),
        "steady_tok_s": round(steady),
        "peak_gib": round(max(x["peak_gib"] for x in s), 1),
        "mfu_6n_percent": round(100 * 6 * run["n_params"] * steady / (PEAK_TFLOPS * 1e12), 1),
        "mfu_lora_aware_percent": round(100 * flops / (PEAK_TFLOPS * 1e12), 1),
        "step_wall_s": [round(x["wall_s"], 2) for x in s],
        "steady_steps": [s.index(x) for x in window],
        # per profiled step: syncs, launches, op counts and summed device time (profile_counts)
        "profiled": {x["step"]: x["profile_counts"] for x in s if "profile_counts" in x},
        # per profiled step: GPU busy/idle and its gaps, CUDA time by category, host time (profile_gaps)
        "profiled_gaps": {x["step"]: x["profile_gaps"] for x in s if "profile_gaps" in x},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per process")
    ap.add_argument("--steady-steps", type=int, default=4, help="last steps that define the steady speed")
    ap.add_argument("--step-tokens", type=int, default=98304)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--runs", default="defaults+warm-up:cold-cache,defaults+warm-up:warm-cache,no-warm-up:cold-cache,"
                    "sdpa-default+warm-up:cold-cache", help="config:cache pairs, run in this order")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="defaults", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compile-store", default="", help=argparse.SUPPRESS)
    ap.add_argument("--profile-steps", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="comma list of steps to run under torch.profiler (diagnosis; slows those steps)")
    ap.add_argument("--profile-shapes", action="store_true", help="profiled steps record input shapes")
    ap.add_argument("--profile-stack", action="store_true", help="profiled steps record Python stacks")
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    runs, summary = [], []
    caches = CacheFolders(Path(tempfile.mkdtemp(prefix="fresh-process-")))
    work = caches.work
    for pair in args.runs.split(","):
        config, cache = pair.split(":")
        if config not in CONFIGS or cache not in CACHE_MODES:
            raise SystemExit(f"unknown run {pair!r}: configs {list(CONFIGS)}, caches {'|'.join(CACHE_MODES)}")
        inductor, store = caches.of(config, cache)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "PYTHONPATH": os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        child_out = work / f"{len(runs)}.json"
        cmd = [sys.executable, __file__, "--child", "--config", config, "--child-out", str(child_out),
               "--compile-store", str(store or ""),
               "--steps", str(args.steps), "--step-tokens", str(args.step_tokens),
               "--micro-batch-tokens", str(args.micro_batch_tokens),
               "--profile-steps", ",".join(map(str, args.profile_steps))] + (["--smoke"] if args.smoke else []) \
            + [flag for flag, on in (("--profile-shapes", args.profile_shapes), ("--profile-stack", args.profile_stack))
               if on]
        print(f"== {config}, {cache}", flush=True)
        spawned = time.time()
        rc = subprocess.Popen(cmd, env=env).wait()
        if rc != 0:
            summary.append({"config": config, "cache": cache, "error": f"child exited {rc}"})
            continue
        run = {**json.loads(child_out.read_text()), "cache": cache, "spawned_at": spawned}
        runs.append(run)
        summary.append(summarise_run(run, args.steady_steps))
        print(f"   -> {summary[-1]}", flush=True)
        if args.out:
            write(args, summary, runs)
    if args.out:
        write(args, summary, runs)
    print(json.dumps(summary, indent=1))


def write(args, summary: list[dict], runs: list[dict]) -> None:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "command": "python " + " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"env": env, "runs_summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
