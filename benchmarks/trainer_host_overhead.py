"""Host (Python) time of one trainer micro-batch, forward + backward, on the CPU with kernels of ~zero cost.

On the H200 a step's backward is launched just in time, so every microsecond of Python around a kernel is a
microsecond the GPU idles. This isolates that Python: the Qwen2.5-1.5B shape's op structure and LAYER COUNT
(Qwen2, 28 layers, 4 q / 2 kv heads, LoRA on all linear layers) at tiny widths (hidden 64, intermediate 128,
vocabulary 512, r 16) and a micro-batch of a few dozen tokens, one intra-op thread: each aten op's math is then a
few microseconds, and the wall time of ``GRPOTrainer._micro_batch_step`` (logprobs, loss, backward) is host time:
the Python of our ops and of transformers/peft, plus torch's eager dispatch of each op.

Variants (each its own trainer, float32, the CPU's numerics):

- ``cuda-defaults``: the switches the CUDA defaults turn on, forced on where they run on the CPU: fused_lora,
  memory_efficient_ops, cache_lora_casts and accumulate_lora_grads (follow fused_lora), fused_rope, recompute_norm,
  and fold_lora_b as its CUDA 'auto' folds (only where it pays: the MLP's gate and up; the CPU's 'auto' folds
  nothing, so this script folds them itself, as ``norm_recompute_memory.py`` does); compile off (the CPU's eager
  kernels, one op each, as the compiled kernel is one launch). A step's cast-cache scope is open, as in a step.
- ``plain-peft``: stock transformers + peft (fused_lora, memory_efficient_ops, fused_rope off): what stock costs.

Per micro-batch: wall ms (median of ``--repeats`` medians over ``--micro-batches`` each; the machine is shared, so
also the thread's CPU ms and the fastest micro-batch of all, which another process's load inflates least), ms per
layer, Python function calls (cProfile) and aten ops (torch.profiler: every ``aten::`` event, and the top-level
ones, i.e. those not inside another aten op: the dispatches our code and the libraries make) per layer, and the top
cProfile entries by tottime. Not timed: the CPU-only ``release_freed_memory`` (malloc_trim) before each
micro-batch, which the GPU path does not run (no-op'd here).

    python benchmarks/trainer_host_overhead.py --out benchmarks/results/trainer-host-overhead-cpu.json
    # the same run, labelled as the state before a change, kept in the same files:
    python benchmarks/trainer_host_overhead.py --label before --out benchmarks/results/trainer-host-overhead-cpu.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.training import TINY, build_model  # noqa: E402

SHAPE = {**TINY, "num_hidden_layers": 28, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6}
LORA = {"lora_rank": 16, "lora_alpha": 32, "target_modules": "all-linear"}
CUDA_DEFAULTS = {"fused_lora": "on", "memory_efficient_ops": "on", "cache_lora_casts": "on",
                 "accumulate_lora_grads": "on", "fused_rope": "on", "recompute_norm": "on", "fold_lora_b": "off",
                 "fold_lora_a": "on"}  # fold_lora_a "on" folds where CUDA's "auto" does (in > out + r)
PLAIN_PEFT = {"fused_lora": "off", "memory_efficient_ops": "off", "fused_rope": "off", "recompute_norm": "off",
              "fold_lora_b": "off"}
VARIANTS = {"cuda-defaults": (CUDA_DEFAULTS, True), "plain-peft": (PLAIN_PEFT, False)}


def build(settings: dict, fold_where_it_pays: bool):
    """(trainer, micro-batch) for one variant: the tiny 28-layer model, two rows of ``--row-tokens`` tokens."""
    from backends.modeling.loading import build_tiny_tokenizer
    from backends.training import trainer as trainer_module
    from backends.training.config import TrainerConfig
    from backends.training.kernels.fold_lora_b import fold_model
    from backends.training.kernels.fused_lora import fusable_parts
    from backends.training.token_rows import TrainingRow

    trainer_module.release_freed_memory = lambda: False  # CPU-only malloc_trim: not the GPU path's host time
    cfg = TrainerConfig(backend="peft", dtype="float32", warm_up="off", compile_logprobs="off", **LORA, **settings)
    trainer = trainer_module.GRPOTrainer("bench", cfg, device="cpu", model=build_model(SHAPE, "cpu", torch.float32),
                                         tokenizer=build_tiny_tokenizer())
    if fold_where_it_pays:  # fold_lora_b's CUDA 'auto': gate and up
        trainer.folded_lora_layers = fold_model(trainer._lm, fusable_parts, only_where_it_pays=True)
    return trainer, TrainingRow


def micro_batch(trainer, row_cls, tokens: int):
    rows = []
    for k, n in enumerate((tokens // 2, tokens - tokens // 2)):
        ids = [(7 * i + 3 + k) % SHAPE["vocab_size"] for i in range(n)]
        rows.append(row_cls(ids, [i >= n // 4 for i in range(n)], [-6.2] * n, advantage=0.5 - k, weight=1.0 / n,
                            source=f"row{k}"))
    (mb,) = trainer.micro_batches(rows)
    return mb


def run_one(trainer, mb) -> None:
    trainer._micro_batch_step(mb, 0.2, 0.28)


def measure(name: str, settings: dict, fold: bool, args) -> dict:
    trainer, row_cls = build(settings, fold)
    mb = micro_batch(trainer, row_cls, args.tokens)
    layers = SHAPE["num_hidden_layers"]
    trainer.model.train()
    with trainer.lora_casts_scope():
        for _ in range(5):  # first calls: lazy inits, caches
            run_one(trainer, mb)
        medians, cpu_medians, fastest = [], [], []
        for _ in range(args.repeats):
            times, cpu = [], []
            for _ in range(args.micro_batches):
                t0, c0 = time.perf_counter(), time.thread_time()
                run_one(trainer, mb)
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            medians.append(statistics.median(times))
            fastest.append(min(times))
            cpu_medians.append(statistics.median(cpu))
        prof = cProfile.Profile()
        prof.enable()
        run_one(trainer, mb)
        prof.disable()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            run_one(trainer, mb)
    trainer.optimizer.zero_grad(set_to_none=True)
    stats = pstats.Stats(prof)
    calls = stats.total_calls
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:args.top]
    aten = [e for e in tp.events() if e.name.startswith("aten::")]

    def inside_aten(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return True
            p = p.cpu_parent
        return False

    top_level = [e for e in aten if not inside_aten(e)]
    wall = statistics.median(medians)
    return {
        "settings": settings, "fold_gate_up": fold, "fused_lora_layers": trainer.fused_lora_layers,
        "folded_lora_layers": trainer.folded_lora_layers, "patched_ops": trainer.patched_ops,
        "fused_rope_layers": trainer.fused_rope_layers, "tokens": mb.tokens,
        "wall_ms": wall * 1e3, "wall_ms_repeats": [m * 1e3 for m in medians], "ms_per_layer": wall * 1e3 / layers,
        "thread_cpu_ms": statistics.median(cpu_medians) * 1e3, "min_ms": min(fastest) * 1e3,
        "python_calls": calls, "python_calls_per_layer": calls / layers,
        "aten_ops": len(aten), "aten_ops_per_layer": len(aten) / layers,
        "aten_top_level_ops": len(top_level), "aten_top_level_ops_per_layer": len(top_level) / layers,
        "top_tottime": [{"function": f"{Path(f).name}:{line}({fn})", "calls": nc, "tottime_ms": tt * 1e3,
                         "cumtime_ms": ct * 1e3} for (f, line, fn), (_, nc, tt, ct, _) in top],
    }


def markdown(out: dict) -> str:
    lines = [f"# Trainer host time per micro-batch (CPU, {out['shape']['num_hidden_layers']} layers, tiny widths)", "",
             f"`{out['command']}`", "", f"versions: {out['versions']}", ""]
    for label, results in out["runs"].items():
        lines += [f"## {label}", "", "| variant | wall ms | thread CPU ms | min ms | ms/layer | Python calls/layer | "
                  "aten ops/layer | top-level aten ops/layer | repeats (ms) |", "|---|---|---|---|---|---|---|---|---|"]
        for name, r in results.items():
            reps = ", ".join(f"{x:.1f}" for x in r["wall_ms_repeats"])
            lines.append(f"| {name} | {r['wall_ms']:.1f} | {r['thread_cpu_ms']:.1f} | {r['min_ms']:.1f} "
                         f"| {r['ms_per_layer']:.3f} | {r['python_calls_per_layer']:.0f} "
                         f"| {r['aten_ops_per_layer']:.0f} "
                         f"| {r['aten_top_level_ops_per_layer']:.0f} | {reps} |")
        for name, r in results.items():
            lines += ["", f"Top cProfile entries by tottime, {name} (one micro-batch, profiled):", "",
                      "| function | calls | tottime ms | cumtime ms |", "|---|---|---|---|"]
            lines += [f"| `{t['function']}` | {t['calls']} | {t['tottime_ms']:.2f} | {t['cumtime_ms']:.2f} |"
                      for t in r["top_tottime"]]
        lines.append("")
    return "\n".join(lines + out.get("notes", [])) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens of the micro-batch (two rows)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--micro-batches", type=int, default=10, help="timed micro-batches per repeat")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--label", default="now", help="name of this run in the output (an existing file keeps other "
                    "labels and its 'notes', markdown lines printed at the end)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None, help="JSON path; the .md beside it")
    args = ap.parse_args()
    import peft
    import transformers

    torch.set_num_threads(1)
    results = {}
    for name in args.variants.split(","):
        settings, fold = VARIANTS[name]
        results[name] = measure(name, settings, fold, args)
        r = results[name]
        print(f"{name}: {r['wall_ms']:.1f} ms/micro-batch (fastest {r['min_ms']:.1f}), {r['ms_per_layer']:.3f} "
              f"ms/layer, {r['python_calls_per_layer']:.0f} Python calls/layer, "
              f"{r['aten_ops_per_layer']:.0f} aten ops/layer "
              f"({r['aten_top_level_ops_per_layer']:.0f} top-level)", flush=True)
    out = {"command": "python benchmarks/trainer_host_overhead.py" + "".join(
               f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v != ap.get_default(k)),
           "shape": SHAPE, "lora": LORA, "threads": 1,
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "peft": peft.__version__},
           "runs": {}}
    if args.out and Path(args.out).exists():  # other labels' runs and the reader's notes stay
        old = json.loads(Path(args.out).read_text())
        out = {**old, **out, "runs": old.get("runs", {})}
    out["runs"][args.label] = results
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text(markdown(out))


if __name__ == "__main__":
    main()
