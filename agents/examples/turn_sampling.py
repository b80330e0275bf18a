"""Sampling one assistant turn into a trajectory, and splitting scenarios into train/val/test.

The example agents share these two small pieces: every model call goes through :func:`sample_turn`
(``temperature`` 1.0 by default: what GRPO trains on), and every scenario universe is split with
:func:`split_of`, a hash of a canonical key, so a problem lands in the same split in every process
and never in two.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from openai import AsyncOpenAI

from agents.scenario import Scenario, Split
from agents.trajectory import SampledTurn, Trajectory


class ContextExhausted(RuntimeError):
    """The conversation no longer fits the model's context: the episode ends here (a scored outcome)."""


def _is_context_overflow(exc: Exception) -> bool:
    return getattr(exc, "status_code", None) == 400 and "context length" in str(exc).lower()


async def sample_turn(client: AsyncOpenAI, policy: str, traj: Trajectory, *, max_tokens: int,
                      temperature: float = 1.0, tools: list[dict[str, Any]] | None = None) -> SampledTurn:
    """Ask ``policy`` to continue ``traj`` and append its choice (captured as a :class:`SampledTurn`).

    Logprobs, token ids and seeds are not requested here: trajflow's client layer adds them. Errors of
    the server (unreachable, 5xx) propagate: they are infrastructure failures, not model outcomes. A
    conversation grown past the model's context raises :class:`ContextExhausted`, which multi-turn
    agents turn into the end of the episode.
    """
    kwargs: dict[str, Any] = {"model": policy, "messages": traj.messages(), "max_tokens": max_tokens,
                              "temperature": temperature}
    if tools:
        kwargs["tools"] = tools
    try:
        response = await client.chat.completions.create(**kwargs)
    except Exception as exc:
        if _is_context_overflow(exc):
            raise ContextExhausted(str(exc)) from exc
        raise
    if not response.choices:
        raise RuntimeError(f"the inference server returned no choices for {policy!r}")
    traj.messages_and_choices.append(response.choices[0])
    return traj.messages_and_choices[-1]


def split_of(key: str, val_fraction: float, test_fraction: float) -> Split:
    """The split of a canonical scenario key: sha256(key) as a uniform number u in [0, 1);
    ``u < val_fraction`` is val, ``u < val_fraction + test_fraction`` is test, the rest train."""
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    if u < val_fraction:
        return "val"
    if u < val_fraction + test_fraction:
        return "test"
    return "train"


def ordered(scenarios: list[Scenario], seed: int) -> list[Scenario]:
    """Scenarios sorted by id, then shuffled by ``seed``: the same list for the same seed everywhere."""
    out = sorted(scenarios, key=lambda s: s.id)
    random.Random(seed).shuffle(out)
    return out


def last_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last assistant message of a conversation, or None."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return m
    return None
