"""The GRPO policy objectives and how token losses aggregate into one step loss.

Notation, per trained token t of row i: logp_t = log pi_theta(y_t) (with gradient), old_t the
behaviour logprob, A_t the advantage, r_t = exp(logp_t - old_t) the importance ratio, sg() stop-grad,
clip(x) = min(max(x, 1-eps), 1+eps_high).

- CISPO (default, ART's):  l_t = -sg(clip(r_t)) * A_t * logp_t
  The ratio only weighs the token; every token keeps a gradient (clipping never zeroes one).
- PPO clip:                l_t = -min(r_t * A_t, clip(r_t) * A_t)
  Tokens whose ratio left the trust region in the direction A favours get no gradient.
- GSPO:                    s_i = exp(mean_{t in i}(logp_t - old_t)),  s_it = sg(s_i) * exp(logp_t - sg(logp_t))
                           l_t = -min(s_it * A_t, clip(s_it) * A_t)
  One ratio per row (geometric mean), so one outlier token cannot clip or blow up a long row.

Behaviour policy: by default old_t is the sampler's logprob. With truncated importance sampling
(``tis_cap`` = C) old_t is the trainer's own pre-update logprob and each token is weighted by
min(exp(old_t - sampler_t), C), which corrects the sampler-vs-trainer numeric mismatch without letting
rare tokens explode. The trainer takes ONE optimizer step per batch, so the pre-update logprob is the
detached logprob of the training forward pass itself: no extra pass is needed.

Aggregation: the step loss is L = sum_t w_t * l_t over every trained token of the step, with the
weight w_t fixed before any micro-batch runs, so gradient accumulation over micro-batches gives exactly
the full-batch gradient. With T trajectories (each counted once, all its rows and histories together),
n_j trained tokens in trajectory j and N in the step:
- sequence_mean: w_t = 1 / (T * n_j)   each trajectory weighs the same, whatever its length;
- token_mean:    w_t = 1 / N           each token weighs the same (DAPO);
- dr_grpo:       w_t = 1 / (T * C)     constant normaliser C (Dr.GRPO): a token sum per trajectory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backends.training.token_rows import TrainingRow


def assign_aggregation_weights(rows: Sequence[TrainingRow], aggregation: str, norm: int | None = None) -> None:
    """Set ``row.weight`` (the per-trained-token weight w_t) for every row of the step."""
    per_traj: dict[int, int] = {}
    for r in rows:
        per_traj[r.trajectory] = per_traj.get(r.trajectory, 0) + r.trained_tokens
    n_traj = len(per_traj)
    n_tokens = sum(per_traj.values())
    for r in rows:
        if aggregation == "sequence_mean":
            r.weight = 1.0 / (n_traj * per_traj[r.trajectory])
        elif aggregation == "token_mean":
            r.weight = 1.0 / n_tokens
        elif aggregation == "dr_grpo":
            if not norm:
                raise ValueError("dr_grpo aggregation needs a constant normaliser")
            r.weight = 1.0 / (n_traj * norm)
        else:
            raise ValueError(f"unknown aggregation {aggregation!r}")


def clip_ratio(ratio: torch.Tensor, eps: float, eps_high: float) -> torch.Tensor:
    return ratio.clamp(min=1.0 - eps, max=1.0 + eps_high)


def cispo_loss(logp, old, adv, eps, eps_high):
    """l_t = -sg(clip(r_t)) * A_t * logp_t; returns (per-token loss, ratio, clipped mask)."""
    ratio = torch.exp(logp.detach() - old)
    clipped = (ratio < 1.0 - eps) | (ratio > 1.0 + eps_high)
    return -clip_ratio(ratio, eps, eps_high) * adv * logp, ratio, clipped


def ppo_loss(logp, old, adv, eps, eps_high):
    """l_t = -min(r_t*A_t, clip(r_t)*A_t); clipped = the clipped term is the active one."""
    ratio = torch.exp(logp - old)
    unclipped = ratio * adv
    clipped_obj = clip_ratio(ratio, eps, eps_high) * adv
    clipped = clipped_obj < unclipped
    return -torch.minimum(unclipped, clipped_obj), ratio.detach(), clipped


def gspo_loss(logp, old, adv, row_index, eps, eps_high, n_rows: int | None = None):
    """GSPO-token: s_i = exp(mean_row(logp - old)), s_it = sg(s_i)*exp(logp - sg(logp)), PPO clip on s_it.

    ``n_rows``: the number of rows (``row_index`` < n_rows); None reads it from ``row_index``, a host sync that a
    caller knowing it (the trainer: its micro-batch's rows) avoids."""
    if n_rows is None:
        n_rows = int(row_index.max()) + 1 if row_index.numel() else 0
    delta = (logp - old).detach().double()
    sums = torch.zeros(n_rows, dtype=torch.float64, device=logp.device).index_add_(0, row_index, delta)
    counts = torch.zeros(n_rows, dtype=torch.float64, device=logp.device).index_add_(
        0, row_index, torch.ones_like(delta)
    )
    seq_ratio = torch.exp(sums / counts.clamp(min=1)).to(logp.dtype)[row_index]
    s = seq_ratio * torch.exp(logp - logp.detach())
    unclipped = s * adv
    clipped_obj = clip_ratio(s, eps, eps_high) * adv
    clipped = clipped_obj < unclipped
    return -torch.minimum(unclipped, clipped_obj), seq_ratio, clipped


class LossResult:
    """The micro-batch loss (sum_t w_t l_t, to backward) and sums for the step's metrics.

    The metric sums stay on the device until first read (one sync for all of them), so a caller can
    launch ``loss.backward()`` before waiting for them.
    """

    NAMES = ("clipped", "ratio_sum", "ratio_min", "ratio_max", "mismatch_k3_sum", "mismatch_abs_sum",
             "tis_weight_sum")
    # mismatch_k3_sum: sum of r - 1 - log r, r = pi_theta / pi_sampler (a KL(sampler || trainer) estimate)
    # mismatch_abs_sum: sum of |logp - sampler logp|

    def __init__(self, loss: torch.Tensor, tokens: int, stats: torch.Tensor):
        self.loss, self.tokens, self._stats, self._values = loss, tokens, stats, None

    @property
    def stats(self) -> torch.Tensor:
        """The metric sums, in ``NAMES`` order, on the device (to read many micro-batches' at once)."""
        return self._stats

    def __getattr__(self, name: str) -> float:
        if name in LossResult.NAMES:
            if self._values is None:
                self._values = dict(zip(LossResult.NAMES, self._stats.tolist()))
            return self._values[name]
        raise AttributeError(name)


# Losses whose step loss is sum_t w_t l_t with l_t a function of logp_t alone: dL/dlogp_t is known as soon as logp_t is
# (backends/training/logprob_grad_in_forward.py). GSPO's l_t reads its whole row's logps.
SEPARABLE_LOSSES = ("cispo", "ppo")


def weighted_token_losses(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    adv: torch.Tensor,
    weights: torch.Tensor,
    row_index: torch.Tensor,
    *,
    loss: str = "cispo",
    eps: float = 1.0,
    eps_high: float = 4.0,
    tis_cap: float | None = None,
    n_rows: int | None = None,
):
    """w_t * tis_t * l_t for each trained token (its sum is the step loss' share of these tokens), and what the
    metrics read: (weighted losses, ratio, clipped mask, tis weights, log mismatch logp - sampler_logp)."""
    logp32 = logp.float()
    sampler = sampler_logp.float()
    log_mismatch = logp32.detach() - sampler
    if tis_cap is not None:
        old = logp32.detach()
        tis_w = torch.exp(log_mismatch).clamp(max=tis_cap)
    else:
        old = sampler
        tis_w = torch.ones_like(sampler)
    if loss == "cispo":
        per_token, ratio, clipped = cispo_loss(logp32, old, adv, eps, eps_high)
    elif loss == "ppo":
        per_token, ratio, clipped = ppo_loss(logp32, old, adv, eps, eps_high)
    elif loss == "gspo":
        per_token, ratio, clipped = gspo_loss(logp32, old, adv, row_index, eps, eps_high, n_rows)
    else:
        raise ValueError(f"unknown loss {loss!r}")
    return per_token * tis_w * weights, ratio, clipped, tis_w, log_mismatch


def policy_loss(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    adv: torch.Tensor,
    weights: torch.Tensor,
    row_index: torch.Tensor,
    **options,
) -> LossResult:
    """The weighted objective over one micro-batch's trained tokens (all 1-D tensors of equal length);
    ``options``: ``weighted_token_losses``' (``n_rows``: how many rows ``row_index`` counts, for GSPO; None: read
    from the device)."""
    weighted, ratio, clipped, tis_w, log_mismatch = weighted_token_losses(logp, sampler_logp, adv, weights, row_index,
                                                                          **options)
    total = weighted.sum()
    mismatch_ratio = torch.exp(log_mismatch)
    if logp.numel() == 0:
        raise ValueError("policy_loss needs at least one trained token")
    stats = torch.stack([
        clipped.float().sum(), ratio.float().sum(), ratio.float().min(), ratio.float().max(),
        (mismatch_ratio - 1.0 - log_mismatch).sum(), log_mismatch.abs().sum(), tis_w.sum(),
    ]).detach()
    return LossResult(total, int(logp.numel()), stats)
