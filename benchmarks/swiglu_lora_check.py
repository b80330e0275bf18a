"""The lean LoRA SwiGLU MLP with and without its Triton backward kernel (``trainer.fused_swiglu_lora``): errors and time.

At the Qwen2.5-1.5B MLP shape (hidden 1536, intermediate 8960, rank 16, a 24,576-token micro-batch, bf16 compute,
fp32 masters) with the CUDA defaults around the op (gate and up folded by ``fold_lora_b``, down row-folded by
``fold_lora_a``, the input a marked RMSNorm output (``recompute_norm``), the cast cache, LoRA gradients accumulated
into the masters, torch.compile'd elementwise kernels), one layer's op:

- errors: one forward + backward each way from the same weights, input and upstream gradient; for y, dx and the six
  masters' gradients the largest absolute difference and that over the unfused value's largest magnitude (both
  paths round to bf16, so this is a rounding apart, not an error against the exact function);
- time: CUDA events around each forward and each backward, ``--reps`` of each after ``--warm-up`` unrecorded ones
  (the Triton JIT and torch.compile happen there), the two ways interleaved rep by rep.

    python benchmarks/swiglu_lora_check.py --out $OUT/swiglu-lora-check-h200.json
    python benchmarks/swiglu_lora_check.py --smoke     # CPU, the Triton interpreter, float32, tiny: the code runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from backends.training.kernels import lean_ops, swiglu_lora_triton  # noqa: E402
from backends.training.kernels.fold_lora_a import fold_rows  # noqa: E402
from backends.training.kernels.fold_lora_b import fold_linears  # noqa: E402
from backends.training.kernels.fused_lora import LoraParts, LoraRuntime  # noqa: E402
from backends.training.kernels.lora_cast_cache import CastCache  # noqa: E402

HIDDEN, INTER = 1536, 8960  # Qwen2.5-1.5B
NAMES = ("gate dA", "gate dB", "up dA", "up dB", "down dA", "down dB")


def build(hidden: int, inter: int, rank: int, device, dtype, generator):
    """Three frozen bias-free linears (gate and up folded, down row-folded) and their fp32 masters."""
    def linear(out_f, in_f):
        layer = torch.nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out_f, in_f, generator=generator, device=device) / in_f**0.5)
        return layer.requires_grad_(False)

    linears = [linear(inter, hidden), linear(inter, hidden), linear(hidden, inter)]
    fold_linears(linears[:2], [rank, rank])
    fold_rows(linears[2], rank)
    masters = []
    for lin in linears:
        out_f, in_f = lin.weight.shape
        masters += [torch.randn(rank, in_f, generator=generator, device=device) / in_f**0.5,
                    torch.randn(out_f, rank, generator=generator, device=device) * 0.1]
    return linears, masters


class Op:
    """One way of running the op: its runtime, its own copies of the masters, the norm in front."""

    def __init__(self, fused: bool, linears, masters, norm_weight, compile: bool):
        self.runtime = LoraRuntime(CastCache(), grads_into_masters=True, fused_swiglu=fused)
        self.masters = [m.clone().requires_grad_() for m in masters]
        self.parts = [LoraParts(lin.weight, None, a, b, 2.0, getattr(lin, "_trajflow_fold", None),
                                row_fold=getattr(lin, "_trajflow_row_fold", None))
                      for lin, a, b in zip(linears, self.masters[::2], self.masters[1::2])]
        self.norm = types.SimpleNamespace(weight=norm_weight, variance_epsilon=1e-6, _trajflow_compile=compile,
                                          _trajflow_recompute_norm=True)
        self.compile = compile

    def forward(self, x):
        return lean_ops.lora_swiglu(lean_ops._norm_forward(self.norm, x), *self.parts, compile=self.compile,
                                    runtime=self.runtime)

    def zero(self):
        for m in self.masters:
            m.grad = None


@contextlib.contextmanager
def counted():
    """{kernel: calls} of ``swiglu_lora_triton``'s kernel inside the block (the fused op must take it)."""
    ran, inner = {}, {}
    for name in ("backward",):
        ran[name], inner[name] = 0, getattr(swiglu_lora_triton, name)

        def call(*args, _name=name):
            ran[_name] += 1
            return inner[_name](*args)

        setattr(swiglu_lora_triton, name, call)
    try:
        yield ran
    finally:
        for name, fn in inner.items():
            setattr(swiglu_lora_triton, name, fn)


def errors(ref: tuple, got: tuple) -> dict:
    out = {}
    for name, want, have in zip(("y", "dx", *NAMES), *(ref, got)):
        diff = float((have.double() - want.double()).abs().max())
        out[name] = {"max_abs": diff, "max_rel": diff / max(float(want.double().abs().max()), 1e-30)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=24576)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm-up", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, float32, tiny shapes")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.smoke:  # before triton is first imported (lazily, by the first kernel call)
        os.environ["TRITON_INTERPRET"] = "1"
        swiglu_lora_triton.DTYPES = (torch.float32,)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    hidden, inter, tokens = (48, 200, 150) if args.smoke else (HIDDEN, INTER, args.tokens)
    reps, warm = (2, 1) if args.smoke else (args.reps, args.warm_up)
    gen = torch.Generator(device=device).manual_seed(0)
    linears, masters = build(hidden, inter, args.rank, device, dtype, gen)
    norm_weight = (1 + torch.rand(hidden, generator=gen, device=device)).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    dy = (torch.randn(tokens, hidden, generator=gen, device=device) * 1e-2).to(dtype)
    ops = {"unfused": Op(False, linears, masters, norm_weight, not args.smoke),
           "fused": Op(True, linears, masters, norm_weight, not args.smoke)}
    def step(op, timing=None):
        xi = x.clone().requires_grad_()
        with op.runtime.casts.scope():
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if timing is not None else None
            if events:
                events[0].record()
            y = op.forward(xi)
            if events:
                events[1].record()
            y.backward(dy)
            if events:
                events[2].record()
                timing.append(events)
        return y.detach(), xi.grad

    results = {}
    with counted() as ran:
        for name, op in ops.items():
            op.zero()
            y, dx = step(op)
            results[name] = (y, dx, *(m.grad.clone() for m in op.masters))
    if ran != {"backward": 1}:
        raise SystemExit(f"the fused op did not take the kernels: {ran}")
    report = {"shape": {"tokens": tokens, "hidden": hidden, "intermediate": inter, "rank": args.rank,
                        "dtype": str(dtype)},
              "errors": errors(results["unfused"], results["fused"])}
    del results
    if device.type == "cuda":
        timings = {name: [] for name in ops}
        for i in range(warm + reps):
            for name, op in ops.items():
                step(op, timings[name] if i >= warm else None)
        torch.cuda.synchronize()
        for name, events in timings.items():
            fwd = [a.elapsed_time(b) for a, b, _ in events]
            bwd = [b.elapsed_time(c) for _, b, c in events]
            report[name] = {"forward_ms": sum(fwd) / len(fwd), "backward_ms": sum(bwd) / len(bwd),
                            "forward_min_ms": min(fwd), "backward_min_ms": min(bwd)}
        report["saved_ms"] = {k: report["unfused"][k] - report["fused"][k] for k in ("forward_ms", "backward_ms")}
        report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        report["device"] = torch.cuda.get_device_name()
    report["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
