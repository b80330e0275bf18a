"""Micro-batches packed without padding, and the attention that keeps packed rows apart.

Rows are placed first-fit-decreasing into bins of at most ``micro_batch_tokens`` tokens (a longer row
gets a bin of its own) and each bin runs as ONE sequence of batch size 1: no padding token is ever
computed. Positions restart at 0 for every row, and the ``trajflow_varlen`` attention runs causal
attention separately on each row's span (PyTorch SDPA per span, so the flash kernel is used on GPU),
which is exactly what each row alone would compute. Which SDPA kernel runs is the trainer's
``attention_kernel`` choice, carried with the packed forward (``packed_forward(backends)``); the kernel picked at
the forward also runs the backward. The spans travel to the attention as the
``trajflow_segments`` keyword that transformers forwards from the decoder call to the attention
function (also through gradient-checkpoint recomputation). Without that keyword the implementation is
plain SDPA, so a model set to it still generates normally.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backends.training.token_rows import TrainingRow

VARLEN = "trajflow_varlen"
_PACKED_FORWARD = contextvars.ContextVar("trajflow_packed_forward", default=False)
_SDPA_BACKENDS = contextvars.ContextVar("trajflow_sdpa_backends", default=None)


def sdpa_backends(kernel: str) -> list | None:
    """SDPA backends in priority order for an ``attention_kernel`` setting; None = PyTorch's own choice."""
    if kernel == "sdpa-default":
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def _kernel_choice():
    backends = _SDPA_BACKENDS.get()
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends, set_priority=True)


def _varlen_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop("trajflow_segments", None)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    kwargs.pop("position_ids", None)
    outs, start = [], 0
    with _kernel_choice():
        for n in segments:
            end = start + n
            out, _ = sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end],
                                            value[:, :, start:end], None, is_causal=True, **kwargs)
            outs.append(out)
            start = end
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


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
def packed_forward(backends: list | None = None):
    """Mark the enclosed decoder call as packed (no attention mask is materialised); its row attention runs with
    these SDPA backends in priority order (``sdpa_backends``), or PyTorch's own choice when None."""
    token, chosen = _PACKED_FORWARD.set(True), _SDPA_BACKENDS.set(backends)
    try:
        yield
    finally:
        _SDPA_BACKENDS.reset(chosen)
        _PACKED_FORWARD.reset(token)


def plan_bins(lengths: Sequence[int], budget: int, pack: bool = True) -> list[list[int]]:
    """Row indices per micro-batch: first-fit decreasing under ``budget`` tokens (ties by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not pack:
        return [[i] for i in order]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


@dataclass
class MicroBatch:
    """One packed forward: the tokens, their positions and spans, and the trained positions' data.

    ``pred_index[j]`` is the position whose hidden state predicts trained token ``targets[j]``
    (the position just before it); ``row_index[j]`` says which of ``rows`` it belongs to.
    """

    rows: list[TrainingRow]
    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    segments: tuple[int, ...]
    pred_index: torch.Tensor  # [N]
    targets: torch.Tensor  # [N]
    sampler_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N]
    row_index: torch.Tensor  # [N]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def sources(self) -> str:
        return "; ".join(r.source for r in self.rows)


def make_micro_batch(rows: Sequence[TrainingRow], device) -> MicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    pred: list[int] = []
    tgt: list[int] = []
    lps: list[float] = []
    adv: list[float] = []
    wts: list[float] = []
    ridx: list[int] = []
    for k, row in enumerate(rows):
        offset = len(ids)
        if row.loss_mask and row.loss_mask[0]:
            raise ValueError(f"{row.source}: the first token of a row cannot be trained (no context before it)")
        for t, trained in enumerate(row.loss_mask):
            if trained:
                pred.append(offset + t - 1)
                tgt.append(row.token_ids[t])
                lps.append(row.sampler_logprobs[t])
        n = row.trained_tokens
        adv += [row.advantage] * n
        wts += [row.weight] * n
        ridx += [k] * n
        ids += row.token_ids
        pos += range(len(row))

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return MicroBatch(
        rows=list(rows),
        input_ids=t(ids, torch.long)[None],
        position_ids=t(pos, torch.long)[None],
        segments=tuple(len(r) for r in rows),
        pred_index=t(pred, torch.long),
        targets=t(tgt, torch.long),
        sampler_logprobs=t(lps, torch.float32),
        advantages=t(adv, torch.float32),
        weights=t(wts, torch.float32),
        row_index=t(ridx, torch.long),
    )
