"""Tiles of the LoRA SwiGLU MLP's Triton kernel (``swiglu_lora_triton``) on a GPU, against the unfused torch path.

At the Qwen2.5-1.5B MLP shape (24,576 tokens, intermediate 8960, rank 16, bf16), median of CUDA-event timings:

- unfused: the backward's compiled elementwise kernel (dL/dg, dL/du and h) and its three rank-r GEMMs (K = N) that
  read h, grad_g and grad_u; the forward's compiled h = silu(g) u and the GEMM z_down = h A_down^T;
- the backward kernel over block rows x block columns x warps x stages x row split, its partials' sum included;
- a forward kernel that writes h and takes z_down on the tile it holds (row blocks x column groups, each group's
  [BM, r] partial summed after), which the op does not use: measured to see whether one would pay.

    python benchmarks/swiglu_lora_sweep.py --out $OUT/swiglu-lora-sweep-h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.training.kernels import lean_ops, swiglu_lora_triton  # noqa: E402
from benchmarks.cuda_timing import median_ms  # noqa: E402

TOKENS, INTER, RANK = 24576, 8960, 16


def forward_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def h_and_z(g_ptr, u_ptr, a_ptr, h_ptr, part_ptr, n_rows, n_cols, cols_per_group, R: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
        rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        group = tl.program_id(1)
        ranks = tl.arange(0, R)
        row_ok = rows < n_rows
        acc = tl.zeros((BM, R), dtype=tl.float32)
        first = group * cols_per_group
        last = tl.minimum(first + cols_per_group, n_cols)
        for start in range(first, last, BN):
            cols = start + tl.arange(0, BN)
            col_ok = cols < last
            ok = row_ok[:, None] & col_ok[None, :]
            g = tl.load(g_ptr + rows[:, None] * n_cols + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + rows[:, None] * n_cols + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            h = (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + rows[:, None] * n_cols + cols[None, :], h, mask=ok)
            a_t = tl.load(a_ptr + ranks[None, :] * n_cols + cols[:, None], mask=col_ok[:, None], other=0.0)
            acc = tl.dot(h, a_t, acc)
        tl.store(part_ptr + group * n_rows * R + rows[:, None] * R + ranks[None, :], acc, mask=row_ok[:, None])

    return triton, h_and_z


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    g, u, dh = (torch.randn(TOKENS, INTER, device=dev, dtype=dt) for _ in range(3))
    a = torch.randn(RANK, INTER, device=dev, dtype=dt) * 0.01
    z_gate, z_up, gz_down = (torch.randn(TOKENS, RANK, device=dev, dtype=dt) for _ in range(3))
    silu = torch.compile(lean_ops._silu_mul)
    grads = torch.compile(lean_ops._silu_mul_grads_and_value)

    def unfused_backward():
        grad_g, grad_u, h = grads(dh, g, u)
        return z_gate.t() @ grad_g, z_up.t() @ grad_u, gz_down.t() @ h

    report = {"shape": {"tokens": TOKENS, "intermediate": INTER, "rank": RANK, "dtype": str(dt)},
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "unfused_backward_ms": median_ms(unfused_backward, args.reps),
              "backward_elementwise_only_ms": median_ms(lambda: grads(dh, g, u), args.reps),
              "unfused_forward_ms": median_ms(lambda: silu(g, u) @ a.t(), args.reps),
              "forward_elementwise_only_ms": median_ms(lambda: silu(g, u), args.reps)}
    triton, backward_kernel = swiglu_lora_triton._triton()
    grad_g, grad_u = torch.empty_like(g), torch.empty_like(u)
    rows = []
    for bm, bn, warps, stages, split in itertools.product((32, 64), (64, 128), (4, 8), (3,), (1024, 2048)):
        splits = triton.cdiv(TOKENS, split)
        parts = torch.empty(splits, 3, RANK, INTER, dtype=torch.float32, device=dev)

        def run(bm=bm, bn=bn, warps=warps, stages=stages, split=split, splits=splits, parts=parts):
            backward_kernel[(triton.cdiv(INTER, bn), splits)](
                dh, g, u, z_gate, z_up, gz_down, grad_g, grad_u, parts, TOKENS, INTER, split, INTER, INTER, INTER,
                RANK, RANK, RANK, INTER, INTER, R=RANK, BM=bm, BN=bn, IEEE=False, num_warps=warps, num_stages=stages)
            return parts.sum(0)
        try:
            rows.append({"bm": bm, "bn": bn, "warps": warps, "stages": stages, "split": split,
                         "ms": median_ms(run, args.reps)})
        except Exception as e:  # noqa: BLE001 - a tile that does not compile (registers, shared memory) is a result
            rows.append({"bm": bm, "bn": bn, "warps": warps, "stages": stages, "split": split, "error": str(e)[:120]})
    report["backward_kernel"] = sorted(rows, key=lambda r: r.get("ms", float("inf")))
    triton, h_and_z = forward_kernel()
    h = torch.empty_like(g)
    h_ref = silu(g, u)
    z_ref = (h_ref @ a.t()).float()
    rows = []
    for bm, bn, warps, stages, groups in itertools.product((32, 64), (64, 128), (4, 8), (1, 3), (4, 8, 16)):
        if bm * bn > 8192:
            continue
        per_group = triton.cdiv(triton.cdiv(INTER, groups), bn) * bn
        n_groups = triton.cdiv(INTER, per_group)
        parts = torch.empty(n_groups, TOKENS, RANK, device=dev, dtype=torch.float32)

        def run(bm=bm, bn=bn, warps=warps, stages=stages, per_group=per_group, n_groups=n_groups, parts=parts):
            h_and_z[(triton.cdiv(TOKENS, bm), n_groups)](g, u, a, h, parts, TOKENS, INTER, per_group, R=RANK, BM=bm,
                                                         BN=bn, num_warps=warps, num_stages=stages)
            return parts.sum(0).to(dt)
        try:
            ms = median_ms(run, args.reps)
            z = run()
            rows.append({"bm": bm, "bn": bn, "warps": warps, "stages": stages, "groups": n_groups, "ms": ms,
                         "z_rel_err": float((z.float() - z_ref).abs().max() / z_ref.abs().max()),
                         "h_equal": bool(torch.equal(h, h_ref))})
        except Exception as e:  # noqa: BLE001
            rows.append({"bm": bm, "bn": bn, "warps": warps, "stages": stages, "groups": n_groups,
                         "error": str(e)[:120]})
    report["forward_kernel"] = sorted(rows, key=lambda r: r.get("ms", float("inf")))
    report["summary"] = {"unfused_backward_ms": report["unfused_backward_ms"],
                         "best_backward_kernel_ms": report["backward_kernel"][0].get("ms"),
                         "best_backward_tiles": {k: report["backward_kernel"][0][k]
                                                 for k in ("bm", "bn", "warps", "stages", "split")},
                         "unfused_forward_ms": report["unfused_forward_ms"],
                         "best_forward_kernel_ms": report["forward_kernel"][0].get("ms")}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
