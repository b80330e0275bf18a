"""Small agents for flow tests, referenced by RunConfig as 'tests.flow_agents:<Class>'."""

from __future__ import annotations

import math

from agents import BaseAgent, Scenario, Trajectory


class EchoAgent(BaseAgent):
    """One question per scenario; reward = length of the answer mod 3, halved (noise on tiny-random)."""

    name = "echo"
    system_prompt = "Answer briefly."

    def __init__(self, n_train: int = 6, n_val: int = 3, fail_every: int = 0, nan_every: int = 0):
        self.n_train, self.n_val, self.fail_every, self.nan_every = n_train, n_val, fail_every, nan_every
        self.calls = 0

    def scenarios(self, split, seed):
        n = self.n_train if split == "train" else self.n_val
        return [Scenario(id=f"{split}-{i}", split=split, payload={"q": f"Question {i}?"}) for i in range(n)]

    async def rollout(self, client, policy, scenario):
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError(f"simulated tool crash in rollout {self.calls}")
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": scenario.payload["q"]}]
        traj = Trajectory(messages_and_choices=list(messages))
        resp = await client.chat.completions.create(model=policy, messages=messages, max_tokens=5)
        traj.messages_and_choices.append(resp.choices[0])
        traj.reward = (len(resp.choices[0].message.content or "") % 3) / 2
        traj.metrics["length"] = len(resp.choices[0].message.content or "")
        return traj

    def reward(self, scenario, trajectory):
        if self.nan_every and trajectory.metadata.get("index", 0) % self.nan_every == 0:
            return math.nan
        return trajectory.reward


class AlwaysFails(EchoAgent):
    async def rollout(self, client, policy, scenario):
        raise ValueError(f"this agent cannot answer {scenario.id}")


class KillsServerOnce(EchoAgent):
    """EchoAgent that, in the first rollout sampled by `at_policy`, SIGKILLs the inference server processes of this
    process's runtimes (tasks/support/runtime.py) and writes their pids to `marker`, once (the marker says it did)."""

    def __init__(self, marker: str, at_policy: str, **kw):
        super().__init__(**kw)
        self.marker, self.at_policy = marker, at_policy

    async def rollout(self, client, policy, scenario):
        import os
        import signal

        from tasks.support.runtime import _RUNTIMES

        if policy == self.at_policy and not os.path.exists(self.marker):
            pids = [s.process.pid for rt in _RUNTIMES.values() for s in rt._servers if s.process is not None]
            with open(self.marker, "w") as f:  # noqa: ASYNC230 - at once, before another rollout looks
                f.write(" ".join(map(str, pids)))
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        return await super().rollout(client, policy, scenario)
