"""Data-parallel GRPO steps: the step's rows split across the ranks of a torchrun job, the LoRA gradients summed.

The rule that makes N processes take the one-process step: the step loss is L = sum_t w_t * l_t over every trained
token of the step, with each weight w_t fixed from the WHOLE step's rows before they are split
(``losses.assign_aggregation_weights``). With rank k holding the rows R_k,

    grad L = sum_k grad( sum_{t in R_k} w_t * l_t )

so each rank backpropagates its own rows, one all-reduce SUM of the LoRA gradients gives every rank the full-batch
gradient, and every rank then clips it and takes the same AdamW step from the same state: the adapters stay equal
without ever sending weights (they are broadcast from rank 0 once, when a trainer is built). On float32 the result
differs from one process's only by the order of the sums (rounding).

Choices and simplifications:

1. Rows are split by token budget, the same way on every rank: longest first, each to the rank with the fewest
   tokens so far (ties: the lower rank). Whole rows move, never parts, so packing and GSPO's per-row ratio are
   unchanged; a rank may get no row (fewer rows than ranks) and then contributes zeros.
2. Only the trainable (LoRA) parameters are reduced, in ONE flat float32 buffer after the backward passes, instead
   of torch's DDP wrapper and its buckets overlapping the backward: LoRA gradients are small (1.5B Qwen2.5 at r16:
   18M floats, ~1 ms on NVLink) and the frozen base needs no communication at all.
3. The step's metric sums are reduced right after the gradients, so every rank sees the same loss and the same
   non-finite verdict and all of them stop together (one rank raising alone would leave the others waiting).
4. Every rank builds the rows of every group (cheap: token ids only), so advantages and weights need no
   communication; the KL shaping's step mean is a reduced (sum, count).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch


class PeerLostError(RuntimeError):
    """A collective failed because another rank of the job stopped (killed, out of memory, or it raised)."""


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Name a failed collective for what it is: the other rank's death, not this rank's error (gloo and NCCL
    raise a bare RuntimeError, e.g. 'Connection closed by peer')."""
    try:
        yield
    except RuntimeError as exc:
        raise PeerLostError(f"{what}: another rank of this job stopped ({exc})") from exc


def world() -> tuple[int, int]:
    """(rank, world size) of this process's default process group; (0, 1) when there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_torchrun(device: str) -> str:
    """Join the torchrun job this process is a rank of and return the device it trains on.

    `device` is the configured one, resolved ('cpu', 'cuda', 'cuda:K'): on the CPU every rank trains on the CPU
    over gloo; on CUDA rank r trains on ``cuda:<LOCAL_RANK>`` over NCCL (the launcher's CUDA_VISIBLE_DEVICES picks
    which GPUs those are).
    """
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("not started by torchrun: RANK and WORLD_SIZE are not set")
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")
    return device


def close() -> None:
    """Leave the process group, if this process is in one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def split_rows(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Row indices per rank: longest row first, each to the rank with the fewest tokens so far (ties: lower rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(world_size), key=lambda k: (load[k], k))
        shares[k].append(i)
        load[k] += lengths[i]
    return [sorted(s) for s in shares]


def broadcast_parameters(params: Sequence[torch.Tensor]) -> None:
    """Make every rank's trainable parameters rank 0's (one flat broadcast)."""
    import torch.distributed as dist

    if world()[1] == 1 or not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    with _collective("broadcasting the adapter"):
        dist.broadcast(flat, src=0)
    _unflatten_into(flat, [p.data for p in params])


def all_reduce_step(params: Sequence[torch.Tensor], sums: Sequence[float], maxima: Sequence[float]
                    ) -> tuple[list[float], list[float]]:
    """Sum the gradients of `params` over the ranks, in place (a missing gradient counts as zeros), and reduce the
    step's metric `sums` (SUM, float64) and `maxima` (MAX); returns the reduced (sums, maxima)."""
    import torch.distributed as dist

    device = params[0].device
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    top = torch.tensor(list(maxima), dtype=torch.float64, device=device)
    with _collective("summing the LoRA gradients"):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    _unflatten_into(flat, [p.grad for p in params])
    return all_reduce_sum(sums, device), top.tolist()


def all_reduce_sum(values: Sequence[float], device) -> list[float]:
    """`values` summed over the ranks (float64)."""
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    with _collective("summing the step's statistics"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _unflatten_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in targets:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
