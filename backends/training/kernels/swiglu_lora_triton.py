"""The LoRA SwiGLU MLP's backward elementwise kernel with its rank-r reductions over [N, I] fused in (Triton).

In the lean MLP op (``lean_ops._LoraSwiGLU``), with g, u, dh [N, I] in the compute dtype c, h = silu(g) * u, s_g = s of
gate and so on, A_c the cast of a master A ([r, I] for down):

    grad_u = (dh g sig)_c,   grad_g = (dh u sig (1 + g (1 - sig)))_c,   sig = sigmoid(g)
    S_gate = z_gate^T grad_g,   S_up = z_up^T grad_u,   S_down = gz_down^T h_c    (float32, [r, I] each)
    dA_down = S_down,   dB_gate = s_gate S_gate^T,   dB_up = s_up S_up^T

The elementwise math is float32 inside, each result rounded to c once: the formulas of ``lean_ops._silu_mul`` and
``_silu_mul_grads`` as torch.compile runs them. Unfused, the backward writes h and three rank-r GEMMs (K = N) read h,
grad_g and grad_u again. Fused, the products are taken on the tiles the elementwise kernel holds in registers: the
write of h and the reads of h, grad_g and grad_u go (at the Qwen2.5-1.5B shape, I = 8960, bf16, 24,576 tokens:
~1.8 GB per layer and micro-batch). dB_down, dA_gate and dA_up read [N, r] or [N, hidden] tensors and stay torch GEMMs.

Measured on an H200 at that shape (``benchmarks/swiglu_lora_sweep.py``, three sweeps in three machine leases; the
second and third are ``results/swiglu-lora-sweep-h200.json`` and ``-3-``): the unfused backward's elementwise kernel
and three GEMMs take 1.01 / 1.06 / 1.03 ms, this kernel at each sweep's fastest tiles 0.78 / 0.83 / 0.84 ms (32 x 64
in the first, the 64 x 64 below in the second and third, where 32 x 64 took 0.93 / 0.86). The forward stays
unfused: h = silu(g) u (compiled) and z_down = h A_down^T (cuBLAS) took 0.45 / 0.54 ms, a kernel doing both 0.57 ms
(one program per row block looping over I) and 0.53 ms (row blocks x column groups, partial z's summed after): not
worth a kernel.

Choices:

- Each product is a ``tl.dot`` of the ROUNDED tile (h, grad_g, grad_u in c), the values the unfused GEMMs read from
  memory, accumulated in float32 (``input_precision='ieee'`` where c is float32: no TF32).
- A grid of column blocks (BN) x row splits (``_SPLIT_ROWS`` rows each); each program writes its partial [3, r, BN]
  into a [splits, 3, r, I] float32 buffer and one ``sum(0)`` adds the splits. Float atomics would add in arrival
  order (other bits each run); the partials give the same bits every run for the same N, at 3 r I 4 bytes a split
  (~1.7 MB at that shape). The sums differ from the unfused GEMMs' by summation order (and, where those round their
  product to c before the cast to float32, by that rounding).
- Tiles: BM 64, BN 64, 8 warps, 3 stages, 2048-row splits, the fastest of the second and third H200 sweeps (0.834
  and 0.838 ms at 24,576 tokens, against 0.925 and 0.856 for the first sweep's 32 x 64 / 4 warps / 1024-row splits;
  ``benchmarks/results/swiglu-lora-sweep-h200.json``, ``swiglu-lora-sweep-3-h200.json``); no autotune: it would
  run in the trainer's cold start. The trainer's warm-up runs the op, so the JIT compile happens there. The row
  count is not specialized on (``do_not_specialize``: one compile whatever a micro-batch's length), and row offsets
  are int64 (N I passes 2^31 at ~240k tokens).
- ``runs`` says where it can run: CUDA tensors (or CPU ones under the Triton interpreter, ``TRITON_INTERPRET=1``,
  which the tests use), triton importable, c in ``DTYPES`` (bf16/fp16), the three projections of one rank, a power
  of two >= 16 (``tl.dot``'s smallest tile), row-major inputs. Anywhere else the op keeps its torch path (the same
  function up to rounding).
"""

from __future__ import annotations

import functools

import torch

from backends.training.kernels.triton_device import launchable

DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
BLOCK_ROWS, BLOCK_COLS, WARPS, STAGES = 64, 64, 8, 3
# rows a program sums over: 24,576 tokens x 8960 columns make 12 splits x 140 column blocks = 1680 programs
_SPLIT_ROWS = 2048


@functools.cache
def _triton():
    """The triton module and the backward kernel, or None where triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["n_rows"])
    def backward_kernel(dh_ptr, g_ptr, u_ptr, zg_ptr, zu_ptr, gzd_ptr, gg_ptr, gu_ptr, part_ptr, n_rows, n_cols,
                        split_rows, stride_dh, stride_g, stride_u, stride_zg, stride_zu, stride_gzd, stride_gg,
                        stride_gu, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        split = tl.program_id(1)
        ranks = tl.arange(0, R)
        col_ok = cols < n_cols
        acc_g = tl.zeros((R, BN), dtype=tl.float32)
        acc_u = tl.zeros((R, BN), dtype=tl.float32)
        acc_h = tl.zeros((R, BN), dtype=tl.float32)
        first = split * split_rows
        last = tl.minimum(first + split_rows, n_rows)
        for start in range(first, last, BM):
            rows = (start + tl.arange(0, BM)).to(tl.int64)
            row_ok = rows < last
            ok = row_ok[:, None] & col_ok[None, :]
            dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            grad_u = (dh * g * sig).to(gu_ptr.dtype.element_ty)
            grad_g = (dh * u * sig * (1 + g * (1 - sig))).to(gg_ptr.dtype.element_ty)
            h = (g * sig * u).to(gg_ptr.dtype.element_ty)
            tl.store(gg_ptr + rows[:, None] * stride_gg + cols[None, :], grad_g, mask=ok)
            tl.store(gu_ptr + rows[:, None] * stride_gu + cols[None, :], grad_u, mask=ok)
            # the [N, r] operands loaded transposed ([r, BM]): each product is z^T tile, [r, BN]
            zg = tl.load(zg_ptr + rows[None, :] * stride_zg + ranks[:, None], mask=row_ok[None, :], other=0.0)
            zu = tl.load(zu_ptr + rows[None, :] * stride_zu + ranks[:, None], mask=row_ok[None, :], other=0.0)
            gzd = tl.load(gzd_ptr + rows[None, :] * stride_gzd + ranks[:, None], mask=row_ok[None, :], other=0.0)
            if IEEE:
                acc_g = tl.dot(zg, grad_g, acc_g, input_precision="ieee")
                acc_u = tl.dot(zu, grad_u, acc_u, input_precision="ieee")
                acc_h = tl.dot(gzd, h, acc_h, input_precision="ieee")
            else:
                acc_g = tl.dot(zg, grad_g, acc_g)
                acc_u = tl.dot(zu, grad_u, acc_u)
                acc_h = tl.dot(gzd, h, acc_h)
        out = part_ptr + split * 3 * R * n_cols + ranks[:, None] * n_cols + cols[None, :]
        keep = col_ok[None, :]
        tl.store(out, acc_g, mask=keep)
        tl.store(out + R * n_cols, acc_u, mask=keep)
        tl.store(out + 2 * R * n_cols, acc_h, mask=keep)

    return triton, backward_kernel


def _rank_fits(r: int) -> bool:
    return r >= 16 and r & (r - 1) == 0


def runs(g: torch.Tensor, u: torch.Tensor, ranks) -> bool:
    """Whether the kernels can take this call (module docstring): device, triton, dtype, ranks (the three
    projections' one rank: the backward's partials hold three [r, I] sums) and layout."""
    device_ok = launchable(g)
    return (device_ok and g.dtype in DTYPES and u.dtype == g.dtype and g.is_contiguous() and u.is_contiguous()
            and len(set(ranks)) == 1 and _rank_fits(ranks[0]) and _triton() is not None)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` where its columns are contiguous (a [N, r] slice of a wider buffer: the kernels take a row stride),
    else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def backward(dh, g, u, z_gate, z_up, gz_down) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_g, grad_u, sums): the gradients of h = silu(g) * u rounded to c, and sums [3, r, I] float32 =
    [z_gate^T grad_g, z_up^T grad_u, gz_down^T h] (h recomputed, never written). The three [N, r] tensors share r."""
    triton, backward_kernel = _triton()
    n, cols = g.shape
    r = z_gate.shape[1]
    z_gate, z_up, gz_down = _rows(z_gate), _rows(z_up), _rows(gz_down)
    dh = dh if dh.is_contiguous() else dh.contiguous()
    grad_g, grad_u = torch.empty_like(g), torch.empty_like(u)
    splits = max(1, triton.cdiv(n, _SPLIT_ROWS))
    partials = torch.empty(splits, 3, r, cols, dtype=torch.float32, device=g.device)
    backward_kernel[(triton.cdiv(cols, BLOCK_COLS), splits)](
        dh, g, u, z_gate, z_up, gz_down, grad_g, grad_u, partials, n, cols, _SPLIT_ROWS, dh.stride(0), g.stride(0),
        u.stride(0), z_gate.stride(0), z_up.stride(0), gz_down.stride(0), grad_g.stride(0), grad_u.stride(0),
        R=r, BM=BLOCK_ROWS, BN=BLOCK_COLS, IEEE=g.dtype == torch.float32, num_warps=WARPS,
        num_stages=STAGES)
    return grad_g, grad_u, partials.sum(0)


def _into(param: torch.Tensor, value: torch.Tensor, alpha: float) -> None:
    """``param.grad = alpha * value`` where it has none (contiguous, the master's layout), else ``+=``."""
    if param.grad is None:
        param.grad = torch.mul(value, alpha).contiguous()
    else:
        param.grad.add_(value, alpha=alpha)


def master_grads(sums: torch.Tensor, scalings, masters, into_masters: bool):
    """(dA_down, dB_gate, dB_up) from ``backward``'s sums: sums[2], s_gate sums[0]^T, s_up sums[1]^T; with
    ``into_masters`` added into the masters' ``.grad`` (``lora_grad_accumulation``'s contract) and Nones returned,
    else in the masters' dtypes. ``scalings``: (s_gate, s_up); ``masters``: (gate_b, up_b, down_a)."""
    (s_gate, s_up), (gate_b, up_b, down_a) = scalings, masters
    terms = ((down_a, sums[2], 1.0), (gate_b, sums[0].t(), s_gate), (up_b, sums[1].t(), s_up))
    if into_masters:
        for param, value, alpha in terms:
            _into(param, value, alpha)
        return None, None, None
    return tuple(torch.mul(value, alpha).to(param.dtype).contiguous() for param, value, alpha in terms)
