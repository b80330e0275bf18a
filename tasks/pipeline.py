"""The async pipeline in the flow: rollouts and scoring of later steps run as submitted tasks while a step trains.

With ``pipeline.max_off_policy_steps = k``, the rollouts of step s are sampled by policy step
``p(s) = max(0, s-1-k)`` (backends/policy/staleness.py). When the flow reaches step s, the policy of step s-1 is
published, so the rollouts of steps s..s+k can all run: they are submitted (Prefect futures on the flow's thread
pool) and the flow waits only for step s's. Each is the synchronous loop's own cached ``rollouts`` task: groups in
its own step folder, stored one by one, a cache key naming its sampling policy step; so a run killed anywhere
resumes with every stored group reused and the missing ones sampled by the same policy.

Each step's ``score`` task is submitted with its rollouts' future as its input, so it runs as soon as they are
stored, beside the training of an earlier step: scoring needs nothing but its own step's groups. On the H200 it cost a
k=1 step 0.5-0.75 s between rollouts that were already waiting and the update (benchmarks/results/async-h200.md);
with it off the path a k=1 step is the train task plus publish, the bound set by the cycle
train(s) -> publish(s) -> rollouts(s+k+1) -> score(s+k+1) -> train(s+k+1).

k = 0 submits nothing: each step's scenarios and rollouts are called in the loop, as the synchronous flow always
has. A flow that stops while rollouts run ahead (an error, SIGTERM) abandons their groups in flight
(:meth:`RolloutsAhead.stop`); the stored ones stay.
"""

from __future__ import annotations

import logging
from typing import Any

from agents.scenario import Scenario
from tasks.rollouts import run_rollouts
from tasks.run_config import RunConfig
from tasks.scenarios import sample_scenarios
from tasks.scoring import score_groups
from tasks.support.runtime import get_runtime

log = logging.getLogger("trajflow")


class RolloutsAhead:
    """The scenarios, rollouts and scores of each step, run up to k steps ahead of the trainer.

    `with_run_storage(task)` gives a task its persisted results in the run's storage (flows/train.py).
    """

    def __init__(self, config: RunConfig, with_run_storage):
        self.config = config
        self.ahead = config.pipeline.max_off_policy_steps
        self._sample = with_run_storage(sample_scenarios)
        self._rollouts = with_run_storage(run_rollouts)
        self._score = with_run_storage(score_groups)
        self._scenarios: dict[int, list[Scenario]] = {}
        self._futures: dict[int, Any] = {}
        self._scored: dict[int, Any] = {}

    def scenarios(self, step: int) -> list[Scenario]:
        """The scenarios of `step` (sampled when its rollouts were submitted, else now)."""
        if step not in self._scenarios:
            self._scenarios[step] = self._sample(self.config, step)
        return self._scenarios[step]

    def rollouts(self, step: int) -> dict[str, Any]:
        """The rollouts of `step`, once stored; the policy of step-1 is published, so steps up to step+k start."""
        if not self.ahead:
            return self._rollouts(self.config, step, self.scenarios(step))
        for later in range(step, min(step + self.ahead, self.config.steps) + 1):
            if later not in self._futures:
                self._futures[later] = self._rollouts.submit(self.config, later, self.scenarios(later))
                self._scored[later] = self._score.submit(self.config, later, self.scenarios(later),
                                                         self._futures[later])
                if later > step:
                    log.info("rollouts of step %d run ahead, beside step %d", later, step)
        self._scenarios.pop(step - 1, None)
        return self._futures.pop(step).result()

    def scored(self, step: int, rollouts: dict[str, Any]) -> dict[str, Any]:
        """The scored groups of `step` (its `rollouts`): scored in the loop at k = 0, else in the submitted task."""
        if not self.ahead:
            return self._score(self.config, step, self.scenarios(step), rollouts)
        return self._scored.pop(step).result()

    def __enter__(self) -> RolloutsAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Abandon the rollouts still running ahead (their stored groups stay) and wait until they have stopped."""
        if not self._futures and not self._scored:
            return
        get_runtime(self.config).stop_rollouts.set()  # this process's resources for the run (tasks/support/runtime.py)
        for future in [*self._futures.values(), *self._scored.values()]:
            future.wait()
        self._futures.clear()
        self._scored.clear()
