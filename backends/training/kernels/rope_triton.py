"""The rotary embedding of q and k, forward and backward, as one Triton kernel launch each way (``fused_rope``'s op).

With x1, x2 the halves of the head dim D, c1, c2 and s1, s2 those of cos and sin (all in float32):

    forward:   x'1 = x1 c1 - x2 s1,   x'2 = x2 c2 + x1 s2          (x' = x cos + R(x) sin,  R(x) = cat(-x2, x1))
    backward:  g'1 = g1 c1 + g2 s2,   g'2 = g2 c2 - g1 s1          (g' = g cos - R(g sin),  R^T = -R)

The backward is the forward with (s1, s2) replaced by (-s2, -s1), so one kernel serves both, a constexpr picking which
sines it uses. Each result is rounded to the output dtype once; the halves of cos (and of sin) need not be equal
(stock Qwen2 makes them so; the formula holds for any).

Why a kernel of our own: ``torch.compile`` of ``fused_rope._rotate_grad_pair`` ran 0.23 ms per call on an H200 at the
Qwen2.5-1.5B shape (q [1, 24576, 12, 128], k [1, 24576, 2, 128], bf16), ~4x what reading and writing q and k once
(~180 MB) takes at the card's bandwidth, 168 calls each way per training step. Measured (``benchmarks/rope_check.py``,
``results/rope-check-h200.json``): at that shape the compiled forward / backward 0.219 / 0.237 ms, this kernel 0.093 /
0.093 ms (2.0 TB/s), the outputs identical (max |diff| 0 each way); the trainer went from 49,011 to 50,030 and 50,205
tokens/s steady in one call (``results/training-fresh-eleventh-h200.json``), its warm-up 8-10 s shorter (8 fewer graphs
to compile).

Choices:

- A program per block of ``BLOCK_TOKENS`` tokens of one sequence (grid: token blocks x batch) loads that block's
  cos and sin once, then q's heads, then k's, each tensor as ONE [tokens, heads, D/2] tile per half (heads padded to
  a power of two, masked): one launch for both tensors, cos and sin read once per token instead of once per head,
  and all of a tensor's loads issued before its first store (in a loop over heads each head's loads would wait for
  the previous head's stores: the compiler does not move a load above a store it cannot prove disjoint from it, as
  the sm_90 PTX of that first version showed). k's loads still follow q's stores: k is 1/7 of the bytes at 12 / 2.
- Inputs are the ``[B, L, H, D]`` views ``fused_rope._FusedRope`` hands its kernels, any strides but a contiguous last
  dim (q may be a slice of a grouped qkv projection's output); cos and sin ``[B or 1, L, 1, D]``, broadcast over
  heads (and over the batch where B is 1). Outputs are new contiguous ``[B, L, H, D]`` tensors: q_proj's layout, the
  one packed attention reads without a copy.
- D need not be a power of two: each half is a ``next_power_of_2(D / 2)``-wide tile, masked.
- Offsets are int64 (B L H D passes 2^31 at ~1.4M tokens of q at 12 x 128). The token count is not specialized on
  (``do_not_specialize``: one compile whatever a micro-batch's length); the strides are, since Triton's "divisible by
  16" for each is what lets a thread load and store 16 bytes at a time (a batch stride not known to divide would
  make every access of a sequence a 2-byte one: seen in the sm_90 PTX), and q_proj's strides (L H D, H D, D) keep
  their divisibility at every length.
- ``BLOCK_TOKENS`` 4 and ``WARPS`` 4: q's half-tiles are 4 x 16 x 64, 32 elements a thread, four 16-byte loads. The
  H200 sweep (1-16 tokens x 1-8 warps at 24,576 tokens) put most tiles within 3% of each other, 0.090-0.093 ms each
  way, these at 0.091 / 0.091 ms, 0.5% from the fastest. No autotune: it would run in the trainer's cold start.
  The trainer's warm-up runs the op, so the JIT compile happens there.
- ``runs`` says where it can run: CUDA tensors (or CPU ones under the Triton interpreter, ``TRITON_INTERPRET=1``,
  which the tests use), triton importable, q and k of one dtype in ``DTYPES`` (bf16/fp16), cos and sin of that dtype
  or float32, D even, shapes that broadcast as above, a contiguous last dim everywhere. Anywhere else ``fused_rope``
  keeps its compiled (CUDA) or eager path, the same function up to the order of float32 operations.
"""

from __future__ import annotations

import functools

import torch

from backends.training.kernels.triton_device import launchable

DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
BLOCK_TOKENS, WARPS = 4, 4


@functools.cache
def _triton():
    """The triton module and the kernel, or None where triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["n_tokens"])
    def rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, n_tokens, stride_qb, stride_ql, stride_qh,
                    stride_kb, stride_kl, stride_kh, stride_cb, stride_cl, stride_sb, stride_sl,
                    HEADS_Q: tl.constexpr, HEADS_K: tl.constexpr, HEADS_Q_TILE: tl.constexpr,
                    HEADS_K_TILE: tl.constexpr, HALF: tl.constexpr, HALF_TILE: tl.constexpr, BT: tl.constexpr,
                    BACKWARD: tl.constexpr):
        b = tl.program_id(1).to(tl.int64)
        tokens = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        halves = tl.arange(0, HALF_TILE)
        token_ok = (tokens < n_tokens)[:, None, None]
        half_ok = (halves < HALF)[None, None, :]
        # cos and sin of this block as [tokens, 1, D/2] tiles, loaded once for all of q's and k's heads
        cs = cos_ptr + b * stride_cb + tokens[:, None, None] * stride_cl + halves[None, None, :]
        sn = sin_ptr + b * stride_sb + tokens[:, None, None] * stride_sl + halves[None, None, :]
        c1 = tl.load(cs, mask=token_ok & half_ok, other=0.0).to(tl.float32)
        c2 = tl.load(cs + HALF, mask=token_ok & half_ok, other=0.0).to(tl.float32)
        s1 = tl.load(sn, mask=token_ok & half_ok, other=0.0).to(tl.float32)
        s2 = tl.load(sn + HALF, mask=token_ok & half_ok, other=0.0).to(tl.float32)
        if BACKWARD:  # g' = g cos - R(g sin) is the forward with (s1, s2) -> (-s2, -s1)
            first = s1
            s1 = -s2
            s2 = -first
        for part in tl.static_range(2):  # q, then k: one body, its tensor picked at compile time
            if part == 0:
                x_ptr, out_ptr, stride_b, stride_l, stride_h = q_ptr, q_out_ptr, stride_qb, stride_ql, stride_qh
            else:
                x_ptr, out_ptr, stride_b, stride_l, stride_h = k_ptr, k_out_ptr, stride_kb, stride_kl, stride_kh
            heads = tl.arange(0, HEADS_Q_TILE if part == 0 else HEADS_K_TILE)
            count = HEADS_Q if part == 0 else HEADS_K
            ok = token_ok & (heads < count)[None, :, None] & half_ok
            src = (x_ptr + b * stride_b + tokens[:, None, None] * stride_l + heads[None, :, None] * stride_h
                   + halves[None, None, :])
            # the output: contiguous [B, L, heads, D]
            dst = out_ptr + ((b * n_tokens + tokens[:, None, None]) * count + heads[None, :, None]) * (2 * HALF)
            dst += halves[None, None, :]
            x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
            tl.store(dst, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=ok)

    return triton, rope_kernel


def _fits(x: torch.Tensor, batch: int, tokens: int, dim: int) -> bool:
    """[batch, tokens, H, dim] with a contiguous last dim."""
    return x.dim() == 4 and x.shape[0] == batch and x.shape[1] == tokens and x.shape[3] == dim and x.stride(3) == 1


def _angles_fit(t: torch.Tensor, q: torch.Tensor) -> bool:
    """cos or sin as [B or 1, L, 1, D] with a contiguous last dim, in q's dtype or float32."""
    batch, tokens, _, dim = q.shape
    return (t.dim() == 4 and t.shape[0] in (1, batch) and t.shape[1:] == (tokens, 1, dim) and t.stride(3) == 1
            and t.dtype in (q.dtype, torch.float32) and t.device == q.device)


def runs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rotate`` can take this call (module docstring): device, triton, dtypes, D even, shapes, strides."""
    device_ok = launchable(q)
    if not (device_ok and q.dim() == 4 and q.dtype in DTYPES and k.dtype == q.dtype and k.device == q.device):
        return False
    batch, tokens, _, dim = q.shape
    return (dim % 2 == 0 and _fits(q, batch, tokens, dim) and _fits(k, batch, tokens, dim)
            and _angles_fit(cos, q) and _angles_fit(sin, q) and _triton() is not None)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False):
    """(q', k') = (q cos + R(q) sin, k cos + R(k) sin), or with ``backward`` (q and k being the gradients of q' and
    k') (q cos - R(q sin), k cos - R(k sin)); new contiguous [B, L, H, D] tensors. Where ``runs`` holds."""
    triton, rope_kernel = _triton()
    batch, tokens, heads_q, dim = q.shape
    heads_k = k.shape[2]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    # a cos of one sequence broadcast over the batch: batch stride 0
    cos, sin = cos.expand(batch, -1, -1, -1), sin.expand(batch, -1, -1, -1)
    if q_out.numel() == 0:  # an empty grid is no launch
        return q_out, k_out
    rope_kernel[(triton.cdiv(tokens, BLOCK_TOKENS), batch)](
        q, k, cos, sin, q_out, k_out, tokens, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), HEADS_Q=heads_q, HEADS_K=heads_k,
        HEADS_Q_TILE=triton.next_power_of_2(heads_q), HEADS_K_TILE=triton.next_power_of_2(heads_k), HALF=dim // 2,
        HALF_TILE=triton.next_power_of_2(dim // 2), BT=BLOCK_TOKENS, BACKWARD=backward, num_warps=WARPS)
    return q_out, k_out
