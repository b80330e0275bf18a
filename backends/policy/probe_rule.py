"""When the server's logprobs of the probe tokens agree with the trainer's: the tolerance, by the trainer's dtype.

Both sides compute float32 logits, but from hidden states that their own kernels rounded (bf16 on a GPU), so each
logit z_j may differ by up to some delta. The logprob of token t moves by
``d log p_t = d z_t - sum_j p_j d z_j = (1 - p_t) d z_t - sum_(j != t) p_j d z_j``, so ``|d log p_t| <= 2 (1 - p_t)
delta``: a token the model is sure of (greedy tokens mostly are) moves little, a near-tie up to 2 delta. The rule,
with p_i the trainer's probability of its token i (``exp`` of its recorded logprob):

    every compared token:   |served_i - recorded_i| <= base + 2 (1 - p_i) delta
    their median:           median_i |served_i - recorded_i| <= base

``base`` covers what the first-order bound leaves out (higher-order terms, the sampler's own float32 path); the median
bound keeps a stale or wrong adapter, which moves most tokens, from hiding under the allowance that one near-tie gets.

- float32: base 0.05, delta 0 (measured on SmolLM2: 2e-5..4e-5 between server and trainer).
- bfloat16: base 0.125, delta 0.5. On the H200 the largest difference of the publishes in flow-h200.md and
  flow-vllm-h200.md was 0.119 (means 0.002-0.058), and one probe differed by 0.2855 on one token while all 16 greedy
  tokens agreed, over the former flat tolerance of 0.25 (benchmarks/results/async-h200.md). 0.125 is the spacing of bf16 numbers between 16 and 32, the size of these
  models' logits; delta = 0.5 (four such spacings) lets a token of probability p differ by 0.125 + (1 - p): 0.2855
  passes for p <= 0.84, a near-tie of p = 0.5 up to 0.625, a certain token (p = 1) only 0.125.

A configured ``inference.probe_tolerance`` replaces the rule by a flat one: every token within it (no median bound).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# (base, delta) of the rule by the trainer's dtype; a dtype not listed gets bfloat16's (the looser).
PROBE_RULE = {"float32": (0.05, 0.0), "bfloat16": (0.125, 0.5)}


@dataclass
class ProbeVerdict:
    """The comparison of the served logprobs with the trainer's (one value per compared token)."""

    passed: bool
    max_diff: float
    mean_diff: float
    median_diff: float
    base: float  # the median bound (the flat tolerance when configured)
    worst: int  # the token whose difference is the largest share of its allowance
    worst_diff: float
    worst_allowed: float
    worst_probability: float

    def metrics(self) -> dict[str, float]:
        return {"publish/probe_max_abs_diff": self.max_diff, "publish/probe_mean_abs_diff": self.mean_diff,
                "publish/probe_median_abs_diff": self.median_diff, "publish/probe_tolerance": self.base,
                "publish/probe_worst_share": self.worst_diff / self.worst_allowed}

    def describe(self) -> str:
        """Which bound failed (or held), for an error message."""
        return (f"{self.worst_diff:.4f} at token {self.worst} (tolerance {self.worst_allowed:.4g} for a token of "
                f"probability {self.worst_probability:.2f}); median {self.median_diff:.4f} (tolerance {self.base:.4g})")


def judge(diffs: list[float], recorded: list[float], dtype: str, configured: float | None) -> ProbeVerdict:
    """Apply the rule (module docstring) to `diffs` (|served - recorded| per compared token) given the trainer's
    `recorded` logprobs of those tokens; `configured`: a flat tolerance instead."""
    if configured is not None:
        base, delta = configured, 0.0
    else:
        base, delta = PROBE_RULE.get(dtype, PROBE_RULE["bfloat16"])
    probabilities = [math.exp(min(lp, 0.0)) for lp in recorded]
    allowed = [base + 2.0 * (1.0 - p) * delta for p in probabilities]
    worst = max(range(len(diffs)), key=lambda i: diffs[i] / allowed[i])
    median = statistics.median(diffs)
    passed = all(d <= a for d, a in zip(diffs, allowed)) and (configured is not None or median <= base)
    return ProbeVerdict(passed=passed, max_diff=max(diffs), mean_diff=sum(diffs) / len(diffs), median_diff=median,
                        base=base, worst=worst, worst_diff=diffs[worst], worst_allowed=allowed[worst],
                        worst_probability=probabilities[worst])
