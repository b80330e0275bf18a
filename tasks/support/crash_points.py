"""Named crash points for resume tests: ``TRAJFLOW_CRASH_AT=<point>[:<step>]`` SIGKILLs this process there.

This is how the resume tests kill the flow at exact moments (mid-rollouts, mid-training, between
training and the commit) without timing races. Unset (always, in production) it costs one dict
lookup. Points: ``rollouts-group`` (after the first group of a step is stored), ``training``
(after the update, before its checkpoint is uploaded), ``before-commit`` (after publish, before
the step's manifest), ``sft-saved`` (after a save point of the supervised warm start is stored; its number is
the optimizer steps done, not a step). A process that trains for the flow (``training.mode: process``) has the flow's
pid in ``TRAJFLOW_CRASH_PID``: it kills the flow first, since the flow is what the resume tests kill.
"""

from __future__ import annotations

import os
import signal

CRASH_PID_ENV = "TRAJFLOW_CRASH_PID"


def crash_point(point: str, step: int | None = None) -> None:
    """SIGKILL the current process if TRAJFLOW_CRASH_AT names this point (and step, if given)."""
    target = os.environ.get("TRAJFLOW_CRASH_AT")
    if not target:
        return
    name, _, at_step = target.partition(":")
    if name == point and (not at_step or step is None or int(at_step) == step):
        if os.environ.get(CRASH_PID_ENV):
            os.kill(int(os.environ[CRASH_PID_ENV]), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
