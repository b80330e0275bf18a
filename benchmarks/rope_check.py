"""The rotary embedding of q and k (``fused_rope``'s op) compiled by torch.compile against the Triton kernel of
``rope_triton``: time each way and how far apart the two are.

At the Qwen2.5-1.5B attention shape (q [1, L, 12, 128], k [1, L, 2, 128], bf16, in q_proj's layout; cos and sin
[1, L, 1, 128] bf16 as Qwen2's rotary embedding makes them, rope_theta 1e6) for each L of ``--lengths``:

- time: the median over ``--reps`` CUDA-event timings (``benchmarks.cuda_timing.median_ms``) of ``--inner`` calls in
  a row, divided by ``--inner`` (back-to-back calls keep the GPU busy while the host launches the next: the number is
  the kernels' time, not a host's launch latency), forward and backward each way: (a) ``kernel(_rotate_pair, True)``
  and ``kernel(_rotate_grad_pair, True)``, the compiled path; (b) ``rope_triton.rotate``. Also the bandwidth that
  the bytes each way must move (q and k read and written once, cos and sin read once) make of that time;
- errors: the largest |a - b| between the two paths' outputs, and each path's largest error against the formulas in
  float64 (both round the float32 result to bf16 once, so a bf16 rounding apart at most);
- ``--sweep``: the Triton kernel's time at each (tokens a program, warps) of ``SWEEP``, to pick
  ``rope_triton.BLOCK_TOKENS`` and ``WARPS``.

    python3 benchmarks/rope_check.py --sweep --out $OUT/rope-check-h200.json
    python3 benchmarks/rope_check.py --smoke     # CPU, the Triton interpreter, float32, tiny: the code runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.training.kernels import fused_rope, rope_triton  # noqa: E402
from backends.training.kernels.torch_compile import failure, kernel  # noqa: E402
from benchmarks.cuda_timing import median_ms  # noqa: E402

HEADS, KV_HEADS, DIM, THETA = 12, 2, 128, 1e6  # Qwen2.5-1.5B
LENGTHS = (8192, 24576)
SMOKE_LENGTHS, SMOKE_DIM = (5, 21), 16
SWEEP = [(tokens, warps) for tokens in (1, 2, 4, 8, 16) for warps in (1, 2, 4, 8)]


def angles(length: int, dim: int, device, dtype):
    """cos, sin [1, L, 1, D] of positions 0..L-1, as Qwen2's rotary embedding makes them (halves equal), unsqueezed
    over the heads as ``_FusedRope`` hands them to its kernels."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    freqs = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None, :, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def exact(q, k, cos, sin, backward: bool):
    """Both ways' function in float64."""
    fn = fused_rope._rotate_grad_pair if backward else fused_rope._rotate_pair
    return fn(*(t.double() for t in (q, k, cos, sin)))


def max_abs(pairs) -> float:
    return max(float((a.double() - b.double()).abs().max()) for a, b in pairs)


def timed(fn, reps: int, inner: int) -> float:
    def calls():
        for _ in range(inner):
            fn()

    return median_ms(calls, reps) / inner


def one_length(length: int, args, device, dtype) -> dict:
    gen = torch.Generator(device=device).manual_seed(length)
    dim = SMOKE_DIM if args.smoke else DIM
    q, k, grad_q, grad_k = (torch.randn(1, length, h, dim, generator=gen, device=device).to(dtype)
                            for h in (HEADS, KV_HEADS, HEADS, KV_HEADS))
    cos, sin = angles(length, dim, device, dtype)
    if not rope_triton.runs(q, k, cos, sin):
        raise SystemExit(f"rope_triton.runs refuses the benchmark's inputs ({dtype}, {device})")
    ways = {
        "compiled": {False: lambda: kernel(fused_rope._rotate_pair, not args.smoke)(q, k, cos, sin),
                     True: lambda: kernel(fused_rope._rotate_grad_pair, not args.smoke)(grad_q, grad_k, cos, sin)},
        "triton": {False: lambda: rope_triton.rotate(q, k, cos, sin, False),
                   True: lambda: rope_triton.rotate(grad_q, grad_k, cos, sin, True)},
    }
    row = {"tokens": length, "max_abs_diff": {}, "max_abs_err_vs_float64": {}}
    for backward, direction in ((False, "forward"), (True, "backward")):
        outs = {name: fns[backward]() for name, fns in ways.items()}
        row["max_abs_diff"][direction] = max_abs(zip(outs["compiled"], outs["triton"]))
        want = exact(grad_q, grad_k, cos, sin, True) if backward else exact(q, k, cos, sin, False)
        row["max_abs_err_vs_float64"][direction] = {name: max_abs(zip(out, want)) for name, out in outs.items()}
    if device.type != "cuda":
        return row
    moved = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
    for name, fns in ways.items():
        row[name] = {}
        for backward, direction in ((False, "forward"), (True, "backward")):
            ms = timed(fns[backward], args.reps, args.inner)
            row[name][f"{direction}_ms"] = ms
            row[name][f"{direction}_tb_per_s"] = moved / ms / 1e9
    row["bytes_moved_each_way"] = moved
    if args.sweep:
        chosen = rope_triton.BLOCK_TOKENS, rope_triton.WARPS
        row["sweep"] = []
        try:
            for tokens, warps in SWEEP:
                rope_triton.BLOCK_TOKENS, rope_triton.WARPS = tokens, warps
                row["sweep"].append({"block_tokens": tokens, "warps": warps,
                                     **{f"{d}_ms": timed(ways["triton"][b], args.reps, args.inner)
                                        for b, d in ((False, "forward"), (True, "backward"))}})
        finally:
            rope_triton.BLOCK_TOKENS, rope_triton.WARPS = chosen
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--inner", type=int, default=10, help="calls in a row per timing")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel at each (tokens a program, warps)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, float32, tiny shapes, no timing")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.smoke:  # before triton is first imported (lazily, by the first kernel call)
        os.environ["TRITON_INTERPRET"] = "1"
        rope_triton.DTYPES = (torch.float32,)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    report = {"shape": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": SMOKE_DIM if args.smoke else DIM,
                        "dtype": str(dtype)},
              "kernel": {"block_tokens": rope_triton.BLOCK_TOKENS, "warps": rope_triton.WARPS},
              "lengths": [one_length(n, args, device, dtype) for n in (SMOKE_LENGTHS if args.smoke else args.lengths)]}
    # torch_compile falls back to eager (once, with a warning) where compiling fails: then (a) is not the compiled path
    report["compile_failure"] = failure()
    if device.type == "cuda":
        import triton

        report.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    report["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
