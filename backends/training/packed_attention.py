"""The causal attention of a packed micro-batch: every row attends to itself only.

A packed forward is ONE sequence ``[1, L]`` holding rows ``r_1..r_R`` back to back (``packing.make_micro_batch``),
positions restarting at 0 in each. Token ``t`` of row ``r`` attends to the tokens ``s <= t`` of row ``r``:

    out_t = sum_s softmax_s(q_t . k_s * scale) v_s     over s in row(t), s <= t

which is what row ``r`` alone computes. Two ways to run it, each exact up to the order of float sums:

1. ``varlen``: ONE FlashAttention varlen call per layer (``torch.nn.attention.varlen.varlen_attn``) over the rows'
   cumulative offsets ``cu_seqlens`` (int32, on the device, built once per micro-batch), forward and backward one
   kernel each; grouped-query attention is native (no key/value copies). CUDA with bf16/fp16 only.
2. ``rows``: one SDPA call per row (``is_causal``), then a cat: R calls per layer. q/k/v are split into rows by one
   ``split`` each (its backward is one cat, where R slices would each scatter into a zeroed full-length gradient).
   Any device; which SDPA kernel runs is the trainer's ``attention_kernel``.
   The CPU runs this: one SDPA call per layer with a block-diagonal causal mask computes ``L^2`` scores instead of
   ``sum(n_r^2)`` and measured 3.7x slower per layer (the update 1.16x) at the main job's 512-token micro-batches
   (benchmarks/results/packed-attention-cpu.md).

Buckets (``rows`` path, ``PackedAttention.bucket`` = b > 1): each row's q/k/v of length n is zero-padded at its END
to ``m = ceil(n / b) * b`` and the SDPA output is cut back to n. cuDNN attention keys its execution plan by shapes
and strides and builds one (~1.8 ms of host time) for each it has not seen; GRPO rows are new lengths every step,
padded rows within a micro-batch budget B take ``ceil(B / b)`` shapes, which the trainer's warm-up builds before
step 0 (``build_row_plans``: one attention call per length, not a whole-model forward). Exact: with causal masking
the real tokens (positions < n) never attend to the padding after them, and the padded queries' outputs are dropped,
so their gradient is zero and so is every gradient that flows into the padding (dq of padded queries, dk and dv of
padded keys, which only padded queries see). The cost, per row and layer: the attention over the padding (at most
``b - 1`` tokens), one copy each of q, k and v in the forward and one of the output's gradient in the backward, each
with its padding zeroed (``_PadRows``, ``_CutRows``: the padding only, where ``F.pad`` and a slice's backward fill
all m positions first; and the padded q/k/v gradients reach the ``split``'s cat as views of their first n positions,
where ``F.pad``'s backward copies each). The padding must be finite, not merely ignored: a padded query's output
enters the backward's ``rowsum(dO * O)``, so uninitialized memory (a NaN pattern) could reach real dk and dv. So that
a shape maps to ONE plan, a
padded row is its own tensor ``[1, H, m, D]`` laid out as q_proj writes it (strides ``(m*H*D, D, H*D, 1)``): no
stride depends on the micro-batch's length.

Which one runs is ``attention_path`` (the trainer's ``attention_kernel`` resolved for its device and dtype), and for
'auto' on CUDA the micro-batch's row lengths (``attention_choice.py``). The
attention function, registered with transformers as ``trajflow_varlen``, gets the spans, the path, the SDPA kernel
order and the bucket as the ``trajflow_packed`` keyword (``PackedAttention``) that transformers forwards from the
decoder call to the attention function (also through gradient-checkpoint recomputation); ``packed_forward`` keeps
the model from building a mask. Without that keyword the function is plain SDPA, so a model set to it still
generates normally.

Simplifications: attention dropout and a non-default scale (torch 2.10's ``varlen_attn`` takes no ``scale``) make the
``varlen`` path run as ``rows``; sliding windows are ignored, as the SDPA path ignores them without a
mask.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

VARLEN = "trajflow_varlen"
PATHS = ("varlen", "rows")
CPU_PATH = "rows"
_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_PACKED_FORWARD = contextvars.ContextVar("trajflow_packed_forward", default=False)


@dataclass(frozen=True)
class RowSpans:
    """Where each packed row lies in the micro-batch: ``lengths`` (host), ``cu_seqlens`` = [0, n_1, n_1+n_2, ...]
    (int32, on the micro-batch's device) and ``max_len`` (host), so no layer reads anything back from the device."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_len: int

    @classmethod
    def of(cls, lengths, device) -> "RowSpans":
        lengths = tuple(int(n) for n in lengths)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        return cls(lengths, torch.tensor(offsets, dtype=torch.int32, device=device), max(lengths, default=0))


@dataclass(frozen=True)
class PackedAttention:
    """What a packed forward's attention needs, passed as the ``trajflow_packed`` keyword of the decoder call: the
    rows' spans, the path (one of ``PATHS``) and, for the ``rows`` path, SDPA's backends in priority order
    (``sdpa_backends``; None: PyTorch's own choice) and the ``bucket`` each row is zero-padded to a multiple of (1:
    no padding). A keyword, not a context, so that gradient-checkpoint recomputation (which runs in the backward,
    outside any context of the forward) computes the same thing."""

    spans: RowSpans
    path: str = "rows"
    sdpa_backends: list | None = None
    bucket: int = 1

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"packed attention path {self.path!r}: expected one of {PATHS}")
        if self.bucket < 1:
            raise ValueError(f"packed attention bucket {self.bucket}: expected >= 1")


def sdpa_backends(kernel: str) -> list | None:
    """SDPA backends in priority order for an ``attention_kernel`` setting; None = PyTorch's own choice. 'cudnn' puts
    cuDNN first, 'flash' (and 'auto' / 'varlen' where they fall back to rows) FlashAttention-2; the others follow."""
    if kernel == "sdpa-default":
        return None
    from torch.nn.attention import SDPBackend

    if kernel == "cudnn":
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def bucketed(n: int, bucket: int) -> int:
    """A row of ``n`` tokens padded to the next multiple of ``bucket``: ``ceil(n / bucket) * bucket``."""
    return -(-n // bucket) * bucket


@dataclass(frozen=True)
class VarlenCall:
    """How this torch's ``varlen_attn`` is called: its keyword for causal attention, whether it takes ``scale``, and
    whether it takes ``enable_gqa``. Its signature moved: 2.10 takes ``is_causal``; later versions
    ``window_size=(-1, 0)`` and ``scale``, then ``enable_gqa`` (before it, the flash kernel took fewer key/value heads
    than query heads as they came, its varlen backward summing their gradients)."""

    fn: object
    causal: dict
    takes_scale: bool
    takes_gqa: bool

    @classmethod
    def of(cls, fn) -> "VarlenCall | None":
        params = inspect.signature(fn).parameters
        if "window_size" in params:
            causal = {"window_size": (-1, 0)}
        elif "is_causal" in params:
            causal = {"is_causal": True}
        else:
            return None
        return cls(fn, causal, "scale" in params, "enable_gqa" in params)


@functools.cache
def varlen_function() -> VarlenCall | None:
    """This torch's ``torch.nn.attention.varlen.varlen_attn`` as a ``VarlenCall``; None where there is none (before
    2.10) or its signature is not one we know."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return VarlenCall.of(varlen_attn)


def varlen_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the ``varlen`` path cannot run for a model on ``device`` in ``dtype``; None when it can."""
    if device.type != "cuda":
        return f"FlashAttention varlen runs on CUDA only (device {device})"
    if dtype not in _FLASH_DTYPES:
        return f"FlashAttention varlen needs bfloat16 or float16 (dtype {dtype})"
    if varlen_function() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn we can call (2.10 or later has)"
    return None


def attention_path(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """The path a trainer's packed forward runs for its ``attention_kernel`` setting (``TrainerConfig``).

    Off CUDA: ``CPU_PATH`` whatever the setting. On CUDA: ``varlen`` for 'varlen' (ValueError naming the field and
    the reason where it cannot run) and for 'auto' where it can; ``rows`` otherwise ('flash', 'cudnn',
    'sdpa-default', and 'auto' on float32 or a torch without varlen attention)."""
    if device.type != "cuda":
        return CPU_PATH
    why = varlen_unavailable(device, dtype)
    if kernel == "varlen" and why:
        raise ValueError(f"attention_kernel 'varlen' cannot run here: {why}; use 'auto' or 'flash'")
    return "varlen" if kernel in ("varlen", "auto") and why is None else "rows"


def _flash_varlen(query, key, value, spans: RowSpans, scale: float | None) -> torch.Tensor:
    """[1, H, L, D] q (k, v: [1, Hkv, L, D]) -> [1, L, H, D] in one varlen call."""
    call = varlen_function()
    kwargs = dict(call.causal)
    if call.takes_scale:
        kwargs["scale"] = scale
    if call.takes_gqa and key.shape[1] != query.shape[1]:
        kwargs["enable_gqa"] = True
    # autocast casts nothing for a custom op: its dtype for all three, as it would give SDPA
    where = query.device.type
    dtype = torch.get_autocast_dtype(where) if torch.is_autocast_enabled(where) else query.dtype
    # squeeze, not [0]: indexing's backward is a zero fill and a copy into the standard [1, H, L, D] layout, which
    # the projections' reshape then copies again (``_split_rows`` alike); squeeze's backward is a view
    q, k, v = (x.squeeze(0).transpose(0, 1).to(dtype) for x in (query, key, value))  # [L, H, D]: q_proj's layout
    out = call.fn(q, k, v, spans.cu_seqlens, spans.cu_seqlens, spans.max_len, spans.max_len, **kwargs)
    return out[None]


def _varlen_fits(query, kwargs) -> bool:
    """False where this layer asks for what the varlen call cannot give: dropout, or a non-default scale on a torch
    whose varlen_attn takes none."""
    scale = kwargs.get("scaling")
    default_scale = scale is None or scale == query.shape[-1] ** -0.5
    return not kwargs.get("dropout") and (varlen_function().takes_scale or default_scale)


def _varlen_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    packed: PackedAttention | None = kwargs.pop("trajflow_packed", None)
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    spans = packed.spans
    kwargs.pop("is_causal", None)
    kwargs.pop("position_ids", None)
    if packed.path == "varlen" and _varlen_fits(query, kwargs):
        return _flash_varlen(query, key, value, spans, kwargs.get("scaling")), None
    kernels = contextlib.nullcontext()
    if packed.sdpa_backends is not None:
        from torch.nn.attention import sdpa_kernel

        kernels = sdpa_kernel(packed.sdpa_backends, set_priority=True)
    lengths = spans.lengths
    outs = []
    with kernels:
        for q, k, v, n in zip(*(_split_rows(x, lengths, packed.bucket) for x in (query, key, value)), lengths):
            out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
            # [1, m, H, D] -> its n real positions. Cut even where m == n: the gradient reaching SDPA's output is
            # then a fresh [1, m, H, D] in every row, never a view whose strides depend on the micro-batch's length
            outs.append(_CutRows.apply(out, n) if packed.bucket > 1 else out)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def _zero_padded(x: torch.Tensor, dim: int, m: int) -> torch.Tensor:
    """A new tensor of x's shape but m positions along ``dim``: x, then zeros (only the padding is filled)."""
    n = x.shape[dim]
    out = x.new_empty((*x.shape[:dim], m, *x.shape[dim + 1:]))
    out.narrow(dim, 0, n).copy_(x)
    out.narrow(dim, n, m - n).zero_()
    return out


class _PadRows(torch.autograd.Function):
    """x [n, ...] -> [m, ...]: x, then zeros (m >= n). Backward: the gradient's first n positions, a view."""

    @staticmethod
    def forward(x: torch.Tensor, m: int) -> torch.Tensor:
        return _zero_padded(x, 0, m)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.n = inputs[0].shape[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(0, 0, ctx.n), None


class _CutRows(torch.autograd.Function):
    """out [1, m, ...] -> its first n positions (a view). Backward: a fresh [1, m, ...], the gradient then zeros."""

    @staticmethod
    def forward(out: torch.Tensor, n: int) -> torch.Tensor:
        return out.narrow(1, 0, n)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.m = inputs[0].shape[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _zero_padded(grad, 1, ctx.m), None


def _split_rows(x: torch.Tensor, lengths: tuple[int, ...], bucket: int) -> list[torch.Tensor]:
    """[1, H, L, D] -> one [1, H, m_r, D] per row, m_r = ``bucketed(n_r, bucket)``, zeros after the row's tokens.

    Split along the sequence in the [L, H, D] layout q_proj wrote; ``unsqueeze`` then gives the batch dimension the
    stride ``m*H*D``, so a padded row's strides depend on m alone (a cuDNN plan is keyed by strides too)."""
    rows = []
    for piece in x.squeeze(0).transpose(0, 1).split(lengths):  # [n, H, D] each; squeeze: see _flash_varlen
        m = bucketed(piece.shape[0], bucket)
        if m > piece.shape[0]:
            piece = _PadRows.apply(piece, m)
        elif bucket > 1:
            piece = piece.contiguous()  # a no-op in q_proj's layout; elsewhere the one layout a plan is keyed by
        rows.append(piece.unsqueeze(0).transpose(1, 2))
    return rows


def build_row_plans(module, lengths: Sequence[int], sdpa_order: list | None, bucket: int, dtype: torch.dtype) -> int:
    """For each padded length m of ``lengths``: ONE causal attention forward + backward of a single row of
    ``max(1, m - bucket + 1)`` tokens (padded to m) through this decoder layer's attention function on the ``rows``
    path, in the layout q_proj writes (``[1, L, H, D]`` memory), in ``dtype``, on the module's device. Returns the
    number of calls.

    cuDNN keys its plans by shapes, strides and dtype; every decoder layer has the same head count, key/value heads
    and head dimension, and ``_split_rows`` gives a padded row strides of its own length alone, so one layer's call
    builds the forward and backward plans a step's rows of that padded length use in every layer, at the cost of
    the attention alone (no projections, MLP or logprobs). Inputs are zeros: no random draw, no RNG stream moves."""
    cfg = module.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, module.head_dim
    device = next(module.parameters()).device
    dropout = getattr(module, "attention_dropout", 0.0) if module.training else 0.0
    for m in lengths:
        n = max(1, m - bucket + 1)
        packed = PackedAttention(RowSpans.of([n], device), "rows", sdpa_order, bucket)
        q, k, v = (torch.zeros(1, n, h, dim, dtype=dtype, device=device, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))
        out, _ = _varlen_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                   trajflow_packed=packed, dropout=dropout, scaling=getattr(module, "scaling", None))
        out.backward(torch.ones_like(out))
    return len(lengths)


def prepared_mask(device) -> torch.Tensor:
    """The ``attention_mask`` of a packed decoder call: an empty 4-D tensor, which transformers takes as a mask
    already prepared and passes to the attention untouched (the packed attention ignores it: the spans are the mask).

    Why not None: with no mask and position ids given, transformers' mask preparation looks for packed rows in the
    position ids on the device (``masking_utils.find_packed_sequence_indices``: an ``.all()`` read back), a host sync
    at the start of every micro-batch's forward, which waits for the previous micro-batch's backward."""
    return torch.empty(0, 0, 0, 0, device=device)


def _varlen_mask(*args, **kwargs):
    """No mask is built for a packed forward (the spans are the mask); otherwise SDPA's mask."""
    if _PACKED_FORWARD.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def install_varlen_attention(causal_lm) -> bool:
    """Register ``trajflow_varlen`` and switch the model to it; False if the model cannot (no SDPA path)."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError:  # pragma: no cover - transformers < 4.53
        return False
    AttentionInterface.register(VARLEN, _varlen_attention)
    AttentionMaskInterface.register(VARLEN, _varlen_mask)
    if getattr(causal_lm.config, "_attn_implementation", None) not in ("sdpa", "eager", VARLEN):
        return False
    causal_lm.config._attn_implementation = VARLEN
    for sub in causal_lm.config.sub_configs if hasattr(causal_lm.config, "sub_configs") else ():
        cfg = getattr(causal_lm.config, sub, None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = VARLEN
    return True


@contextlib.contextmanager
def packed_forward():
    """Mark the enclosed decoder call as packed: no attention mask is materialised (the spans are the mask)."""
    token = _PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _PACKED_FORWARD.reset(token)
