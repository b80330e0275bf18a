"""Group-relative advantages and their optional KL shaping.

GRPO compares each trajectory with the others that answered the same scenario:

    A_i = r_i - mean(r)                    (scale_rewards=False, Dr.GRPO)
    A_i = (r_i - mean(r)) / (std(r) + 1e-6) (scale_rewards=True, GRPO; population std, as ART)

A group whose rewards are all equal carries no signal and contributes nothing (the caller counts it).
Every token of a trajectory, in all its rows and additional histories, gets that trajectory's A_i.

KL shaping (ART's replacement for a KL loss term) moves each token's advantage by how far the policy
drifted from the reference at that token, zero-mean over the step:

    k_t = sg(logp_policy(t) - logp_ref(t));   A_t <- A_t + kl_coef * (mean_step(k) - k_t)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], scale: bool = True) -> list[float] | None:
    """Advantages of one group, or None when every reward is equal (no signal)."""
    if len(rewards) < 2 or max(rewards) == min(rewards):
        return None
    mean = math.fsum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / len(rewards))
    return [c / (std + STD_EPS) for c in centred]


def kl_shaping(kl_per_row: Sequence[torch.Tensor], coef: float,
               reduce: Callable[[list[float]], list[float]] | None = None) -> tuple[list[torch.Tensor], float]:
    """Per-token advantage deltas coef*(mean(k) - k_t) for each row's trained tokens, and mean(k).

    ``kl_per_row[i]`` holds k_t = logp_policy - logp_ref for row i's trained tokens; the mean is
    over every trained token of the step, so the shaping sums to zero over the step. Data-parallel, each rank
    holds some of the rows: `reduce` sums [sum(k), count] over the ranks.
    """
    flat = torch.cat([k.detach().double().flatten() for k in kl_per_row]) if kl_per_row else torch.zeros(0)
    total, count = float(flat.sum()), float(flat.numel())
    if reduce is not None:
        total, count = reduce([total, count])
    mean_k = total / count if count else 0.0
    return [coef * (mean_k - k.detach()) for k in kl_per_row], mean_k
