"""GPU check of the lean ops (backends/training/kernels/lean_ops.py): error against float64, speed and stored bytes.

At the shape of one Qwen2.5-1.5B layer and one 16k-token micro-batch (hidden 1536, MLP 8960, LoRA r16,
bf16), for the RMSNorm and the LoRA SwiGLU MLP, compares three versions on fresh random inputs:
``stock`` (transformers' RMSNorm math / the fused LoRA linear around F.silu(g) * u, plain autograd),
``lean`` (our autograd functions, compiled elementwise kernels) and a float64 reference of the same
formula. Reports ||out - ref|| / ||ref|| for the output and every gradient, the forward+backward time
(median of CUDA-event-timed repeats after warm-up) and the bytes autograd keeps for backward.

    python benchmarks/lean_ops_check.py --out benchmarks/results/lean-ops-h200.json
    python benchmarks/lean_ops_check.py --smoke      # CPU, small shape, eager
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.training.kernels.fused_lora import LoraParts, lora_linear  # noqa: E402
from backends.training.kernels.lean_ops import lora_swiglu, rms_norm  # noqa: E402
from benchmarks.activation_memory import saved_activation_bytes  # noqa: E402


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def timed(fn, upstream, device, repeats: int) -> float:
    """Median ms of forward + backward."""
    def once():
        fn().backward(upstream)

    for _ in range(3):
        once()
    if device != "cuda":
        return float("nan")
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        once()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def grads(fn, inputs, upstream):
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(upstream)
    return out.detach(), [t.grad.detach().clone() for t in inputs]


def compare(name, versions, inputs, upstream, params, device, repeats):
    """Each version's errors against 'reference' (float64), time and stored bytes."""
    ref_out, ref_grads = versions.pop("reference")
    rows = {}
    for label, fn in versions.items():
        out, gs = grads(fn, inputs, upstream)
        rows[label] = {
            "output_rel_err": rel(out, ref_out),
            "grad_rel_err": [rel(g, r) for g, r in zip(gs, ref_grads)],
            "fwd_bwd_ms": timed(fn, upstream, device, repeats),
            "stored_mib": saved_activation_bytes(fn, params) / 2**20,
        }
        print(f"{name:6s} {label:6s} out err {rows[label]['output_rel_err']:.2e}  grad errs "
              f"{', '.join(f'{e:.1e}' for e in rows[label]['grad_rel_err'])}  "
              f"{rows[label]['fwd_bwd_ms']:.2f} ms  stored {rows[label]['stored_mib']:.0f} MiB", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tokens, hidden, inter, rank = (256, 64, 160, 4) if args.smoke else (16384, 1536, 8960, 16)
    compile = device == "cuda"
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dt)

    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "shape": dict(tokens=tokens, hidden=hidden, intermediate=inter, rank=rank, dtype=str(dtype))}

    # RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)
    x = randn(tokens, hidden).requires_grad_()
    w = (1 + randn(hidden, scale=0.1))
    up = randn(tokens, hidden)
    eps = 1e-6

    def stock_norm():
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    xd = x.detach().double().requires_grad_()
    ref = w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))
    ref.backward(up.double())
    results["rms_norm"] = compare("norm", {"reference": (ref.detach(), [xd.grad]), "stock": stock_norm,
                                           "lean": lambda: rms_norm(x, w, eps, compile)}, [x], up, [w], device,
                                  args.repeats)

    # LoRA SwiGLU MLP: down(silu(gate(x)) * up(x)), LoRA on all three (scaling 2 = alpha 32 / r 16)
    def parts(out_f, in_f):
        a = randn(rank, in_f, scale=in_f**-0.5, dt=torch.float32).requires_grad_()
        b = randn(out_f, rank, scale=0.02, dt=torch.float32).requires_grad_()
        return LoraParts(randn(out_f, in_f, scale=in_f**-0.5), None, a, b, 2.0)

    gate, upp, down = parts(inter, hidden), parts(inter, hidden), parts(hidden, inter)
    x = randn(tokens, hidden).requires_grad_()
    upstream = randn(tokens, hidden)
    leaves = [x] + [t for p in (gate, upp, down) for t in (p.lora_a, p.lora_b)]

    def lin(v, p):
        return lora_linear(v, p.weight, None, p.lora_a, p.lora_b, p.scaling, dtype)

    def stock_mlp():
        return lin(F.silu(lin(x, gate)) * lin(x, upp), down)

    d_leaves = [t.detach().double().requires_grad_() for t in leaves]
    dx, (ga, gb, ua, ub, da, db) = d_leaves[0], d_leaves[1:]

    def dlin(v, p, a, b):
        return v @ p.weight.double().t() + (v @ a.t() @ b.t()) * p.scaling

    ref = dlin(F.silu(dlin(dx, gate, ga, gb)) * dlin(dx, upp, ua, ub), down, da, db)
    ref.backward(upstream.double())
    results["lora_swiglu"] = compare(
        "mlp", {"reference": (ref.detach(), [t.grad for t in d_leaves]), "stock": stock_mlp,
                "lean": lambda: lora_swiglu(x, gate, upp, down, dtype=dtype, compile=compile)},
        leaves, upstream, [p.weight for p in (gate, upp, down)] + leaves[1:], device, args.repeats)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
