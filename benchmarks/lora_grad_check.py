"""The LoRA weight-gradient accumulation and the cast copies of one micro-batch, per projection shape: time and error.

For each LoRA projection of the Qwen2.5-1.5B shape (q, k, v, o, gate, up, down; rank 16, a 16k-token micro-batch,
bf16 compute, fp32 masters) it times, with CUDA events over ``--iters`` repeats after a warm-up:

- ``autograd``: today's path without ``accumulate_lora_grads``: dA = (gz^T x).to(fp32), dB = (g^T z).to(fp32) * s, each
  added into ``.grad`` (what autograd's accumulation does from the second micro-batch on);
- ``into_masters``: ``lora_grad_accumulation.accumulate`` (one fp32-output addmm each where torch has it);
- ``casts``: ``cast_lora`` (A.to(bf16), (s*B).to(bf16)), what ``cache_lora_casts`` skips after a step's first
  micro-batch;

and the largest error of each accumulated gradient against a float64 reference, relative to its largest entry, so a
layout or aliasing problem of the fp32-output addmm on this torch shows as an error, not as a speed. The summary
scales the per-module times to a step (28 layers x 7 projections x ``--micro-batches``).

    python benchmarks/lora_grad_check.py --out $OUT/lora-grad-check-h200.json
    python benchmarks/lora_grad_check.py --smoke            # CPU, tiny shapes: the code runs, numbers mean nothing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from backends.training.kernels.lora_cast_cache import cast_lora  # noqa: E402
from backends.training.kernels.lora_grad_accumulation import accumulate, fp32_out_supported  # noqa: E402

HIDDEN, INTER, KV = 1536, 8960, 256  # Qwen2.5-1.5B: hidden, MLP width, key/value width (2 heads x 128)
PROJECTIONS = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (HIDDEN, HIDDEN),
               "gate": (HIDDEN, INTER), "up": (HIDDEN, INTER), "down": (INTER, HIDDEN)}  # (in, out)
LAYERS = 28


def autograd_path(a, b, gz, x2, g, z, s):
    """What the op returned and autograd added, before accumulate_lora_grads."""
    a.grad.add_((gz.t() @ x2).to(a.dtype))
    b.grad.add_((g.t() @ z).to(b.dtype).mul_(s))


def into_masters_path(a, b, gz, x2, g, z, s):
    accumulate(a, gz.t(), x2)
    accumulate(b, g.t(), z, alpha=s)


def timed(fn, iters: int, device) -> float:
    """Seconds per call (CUDA events on CUDA, the wall clock elsewhere) after two warm-up calls."""
    fn(), fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def check(name: str, n_in: int, n_out: int, tokens: int, rank: int, device, dtype, iters: int) -> dict:
    g_ = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g_, device=device) * scale).to(dtype)

    x2, g = rnd(tokens, n_in), rnd(tokens, n_out, scale=1e-3)
    a = torch.randn(rank, n_in, generator=g_, device=device) * 0.02
    b = torch.randn(n_out, rank, generator=g_, device=device) * 0.02
    s = 2.0
    sb = (b * s).to(dtype)
    z, gz = x2 @ a.to(dtype).t(), g @ sb
    want_a = gz.t().double() @ x2.double()
    want_b = s * (g.t().double() @ z.double())
    row = {"projection": name, "in": n_in, "out": n_out}
    for label, path in (("autograd", autograd_path), ("into_masters", into_masters_path)):
        ma, mb = (torch.nn.Parameter(t.clone()) for t in (a, b))
        ma.grad, mb.grad = torch.zeros_like(ma), torch.zeros_like(mb)
        path(ma, mb, gz, x2, g, z, s)  # one accumulation from zero: its error against float64
        row[f"{label}_err_a"], row[f"{label}_err_b"] = relative_error(ma.grad, want_a), relative_error(mb.grad, want_b)
        row[f"{label}_s"] = timed(lambda: path(ma, mb, gz, x2, g, z, s), iters, device)
    row["casts_s"] = timed(lambda: cast_lora(a, b, s, dtype), iters, device)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of one micro-batch")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=9, help="micro-batches of a step, for the per-step sums")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.bfloat16
    shapes = {k: (max(8, i // 64), max(8, o // 64)) for k, (i, o) in PROJECTIONS.items()} if args.smoke else PROJECTIONS
    tokens, iters = (256, 3) if args.smoke else (args.tokens, args.iters)
    rows = [check(name, i, o, tokens, args.rank, device, dtype, iters) for name, (i, o) in shapes.items()]
    per_step = LAYERS * args.micro_batches
    summary = {
        "fp32_out_addmm": fp32_out_supported(device.type, dtype),
        "autograd_ms_per_step": 1e3 * per_step * sum(r["autograd_s"] for r in rows),
        "into_masters_ms_per_step": 1e3 * per_step * sum(r["into_masters_s"] for r in rows),
        # the cache makes them once a step instead of once a micro-batch
        "casts_saved_ms_per_step": 1e3 * LAYERS * (args.micro_batches - 1) * sum(r["casts_s"] for r in rows),
        "max_err_autograd": max(max(r["autograd_err_a"], r["autograd_err_b"]) for r in rows),
        "max_err_into_masters": max(max(r["into_masters_err_a"], r["into_masters_err_b"]) for r in rows),
    }
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "tokens": tokens, "rank": args.rank, "micro_batches": args.micro_batches, "iters": iters,
           "command": "python " + " ".join(sys.argv)}
    result = {"env": env, "summary": summary, "projections": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
