"""How stale a group's sampling policy may be: the pipeline's schedule and the trainer's bound.

Step s trains the policy of step s-1 into that of step s. A group it trains on was sampled by ``<run>@p``; its
staleness is ``(s - 1) - p``. With ``max_off_policy_steps = k``:

- the bound: every group of step s has ``s-1-k <= p <= s-1`` (staleness in ``[0, k]``); the trainer refuses a
  group outside it (:func:`check_staleness`), never trains on it silently;
- the schedule: the rollouts of step s are sampled by ``p(s) = max(0, s-1-k)`` (:func:`sampling_step`), the
  stalest policy the bound allows, so they can start as soon as that policy is published, k steps before the
  trainer needs them. k = 0 is the synchronous loop: p(s) = s-1.

Choices: the schedule is a pure function of (s, k), so a resumed run samples a missing group with the same
policy as the killed run would have, and a rerun reaches the same result wherever it was killed; the gap is
corrected for by the loss with what it has (the sampler's behaviour logprobs in the CISPO/TIS ratio, logged as
``train/ratio_*``, ``train/clip_fraction``, ``train/mismatch_kl``).

A group's sampling step is its ``policy_step``; a group stored before that field existed gives it through its
metadata's policy name ``<run>@<step>`` (what the flow's rollouts have always recorded); a script's group may
have neither, and is then not counted.
"""

from __future__ import annotations

import re

from agents.trajectory import TrajectoryGroup

_POLICY_STEP = re.compile(r"@(\d+)$")


class StaleGroupError(ValueError):
    """A group was sampled by a policy outside the bound of the step that would train on it."""


def sampling_step(step: int, max_off_policy_steps: int) -> int:
    """The policy step whose rollouts step `step` trains on: ``max(0, step-1-k)``."""
    return max(0, step - 1 - max_off_policy_steps)


def sampled_by(group: TrajectoryGroup) -> int | None:
    """The policy step that sampled `group` (module docstring), or None when unknown."""
    if group.policy_step is not None:
        return group.policy_step
    match = _POLICY_STEP.search(str(group.metadata.get("policy") or ""))
    return int(match.group(1)) if match else None


def check_staleness(groups: list[TrajectoryGroup], step: int, max_off_policy_steps: int | None) -> dict[str, float]:
    """Staleness metrics of the groups step `step` trains on; StaleGroupError when one is outside the bound.

    `max_off_policy_steps` None checks nothing (a script's loop, ART's semantics) and only measures. Metrics
    (over groups whose sampling step is known): ``pipeline/staleness_mean``, ``pipeline/staleness_max``,
    ``pipeline/stale_groups`` (how many were sampled by an older policy than step-1).
    """
    known = [(i, p) for i, p in ((i, sampled_by(g)) for i, g in enumerate(groups)) if p is not None]
    if max_off_policy_steps is not None:
        for i, p in known:
            staleness = step - 1 - p
            if 0 <= staleness <= max_off_policy_steps:
                continue
            where = f"step {step} cannot train on group {i} (scenario {groups[i].scenario_id!r}): it was sampled by"
            if staleness < 0:
                raise StaleGroupError(f"{where} policy step {p}, newer than the policy it trains (step {step - 1})")
            raise StaleGroupError(
                f"{where} policy step {p}, {staleness} steps stale, more than pipeline.max_off_policy_steps="
                f"{max_off_policy_steps} allows (policy step {step - 1 - max_off_policy_steps} or newer); resume with "
                "the max_off_policy_steps the run was sampled with, or delete the step's stored groups to sample "
                "them again")
    if not known:
        return {}
    stale = [step - 1 - p for _, p in known]
    return {"pipeline/staleness_mean": sum(stale) / len(stale), "pipeline/staleness_max": float(max(stale)),
            "pipeline/stale_groups": float(sum(1 for s in stale if s > 0))}
