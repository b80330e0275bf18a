"""Retention: which committed steps keep their heavy files.

Kept = the newest ``keep_last`` committed steps, plus the best step by ``best_metric`` (``mode``
"max" or "min"; ties go to the earliest step; steps without a finite value of the metric never
count as best), plus always the newest committed step. Every other committed step loses the files
under the prune prefixes (adapter, trainer state); its trajectories and metrics stay.
"""

from __future__ import annotations

import math

from storage.manifest import StepManifest


def steps_to_keep(
    manifests: dict[int, StepManifest], keep_last: int, best_metric: str | None = None, mode: str = "max"
) -> set[int]:
    """The committed steps retention leaves whole (see module docstring)."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"keep_last must be an integer >= 0, got {keep_last!r}")
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    steps = sorted(manifests)
    if not steps:
        return set()
    keep = set(steps[-keep_last:]) if keep_last else set()
    keep.add(steps[-1])
    if best_metric:
        scored = [
            (s, manifests[s].metrics[best_metric])
            for s in steps
            if best_metric in manifests[s].metrics and math.isfinite(manifests[s].metrics[best_metric])
        ]
        if scored:
            sign = 1.0 if mode == "max" else -1.0
            best_value = max(sign * v for _, v in scored)
            keep.add(next(s for s, v in scored if sign * v == best_value))
    return keep
