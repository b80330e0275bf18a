"""The data that flows between stages: sampled turns, trajectories and GRPO groups.

A rollout is written the ART way: ``Trajectory(messages_and_choices=[...], reward=0.0)`` and
``traj.messages_and_choices.append(choice)`` where ``choice`` is the ``Choice`` the ``openai`` client
returned. The list converts every appended ``Choice`` at once into a :class:`SampledTurn`, capturing
the exact token ids and logprobs the server sampled (the trainer learns from those, never from a
re-rendered chat). Plain message dicts stay plain dicts. The JSON round trip is exact.
"""

from __future__ import annotations

import asyncio
import math
import traceback
from collections.abc import Awaitable, Iterable
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

Message = dict[str, Any]
Scalar = float | int | bool | str | None


class SampledTurn(BaseModel):
    """One sampled assistant turn: the message and the exact tokens behind it.

    ``prompt_token_ids`` is the full prompt the server fed the model; ``token_ids`` the sampled
    completion tokens; ``logprobs[i]`` the sampler's log-probability of ``token_ids[i]`` (the
    behaviour policy). ``policy`` names the weights that produced it, ``<model>@<step>``.
    """

    model_config = ConfigDict(extra="forbid")

    message: Message = Field(description="assistant message: role, content and/or tool_calls")
    prompt_token_ids: list[int] = Field(default_factory=list, description="token ids of the rendered prompt")
    token_ids: list[int] = Field(description="sampled completion token ids")
    logprobs: list[float] = Field(default_factory=list, description="sampler logprob of each sampled token")
    finish_reason: str | None = Field(default=None, description="stop, length or tool_calls")
    policy: str | None = Field(default=None, description="served model name that sampled it, <model>@<step>")

    @model_validator(mode="after")
    def _lengths_agree(self) -> SampledTurn:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"sampled turn has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs"
            )
        return self

    @property
    def trainable(self) -> bool:
        """A turn trains only with prompt ids, sampled ids and their logprobs."""
        return bool(self.prompt_token_ids) and bool(self.token_ids) and len(self.logprobs) == len(self.token_ids)

    @classmethod
    def from_choice(cls, choice: Any) -> SampledTurn:
        """Capture an ``openai`` ``Choice`` (or its dict form) with its token ids and logprobs.

        Token ids come from vLLM's ``token_ids`` field on the choice; prompt ids from
        ``prompt_token_ids`` (our client copies the response-level field onto every choice). Where
        token ids are absent but logprob tokens read ``token_id:<n>`` (vLLM's
        ``return_tokens_as_token_ids``), the ids are parsed from those.
        """
        if isinstance(choice, Choice):
            # Read the fields off the object: dumping the whole choice would also dump one pydantic object per
            # sampled token (about 0.45 ms for 512 tokens) only to read their logprobs back.
            message = choice.message.model_dump(mode="json") if choice.message is not None else {}
            entries = (choice.logprobs.content if choice.logprobs is not None else None) or []
            logprobs = [float(e.logprob) for e in entries]

            def token(entry: Any) -> str:
                return str(entry.token)

            def field(name: str) -> Any:  # a declared field or one of the server's extra fields
                return getattr(choice, name, None)
        else:
            data = choice.model_dump(mode="json") if hasattr(choice, "model_dump") else dict(choice)
            message = data.get("message") or {}
            entries = ((data.get("logprobs") or {}).get("content")) or []
            logprobs = [float(e["logprob"]) for e in entries]

            def token(entry: Any) -> str:
                return str(entry.get("token", ""))

            field = data.get
        message = {k: v for k, v in message.items() if v is not None}
        message.setdefault("role", "assistant")
        for key in ("refusal", "audio", "annotations", "function_call", "tool_calls"):
            if not message.get(key):
                message.pop(key, None)
        token_ids = field("token_ids")
        if token_ids is None and entries and all(token(e).startswith("token_id:") for e in entries):
            token_ids = [int(token(e).split(":", 1)[1]) for e in entries]
        return cls(
            message=message,
            prompt_token_ids=list(field("prompt_token_ids") or []),
            token_ids=list(token_ids or []),
            logprobs=logprobs,
            finish_reason=field("finish_reason"),
            policy=field("policy") or field("model"),
        )


def _is_choice(item: Any) -> bool:
    """An openai Choice object or an equivalent dict (has message + finish_reason, no role)."""
    if isinstance(item, SampledTurn):
        return False
    if hasattr(item, "message") and hasattr(item, "finish_reason"):
        return True
    return isinstance(item, dict) and "message" in item and "role" not in item and "token_ids" not in item


def _normalize_item(item: Any) -> Message | SampledTurn:
    """A plain message dict stays a dict; a Choice or a SampledTurn dict becomes a SampledTurn."""
    if isinstance(item, SampledTurn):
        return item
    if _is_choice(item):
        return SampledTurn.from_choice(item)
    if isinstance(item, dict):
        if "token_ids" in item and "message" in item:
            return SampledTurn.model_validate(item)
        if "role" not in item:
            raise ValueError(f"a message needs a 'role': {str(item)[:200]}")
        return dict(item)
    if hasattr(item, "model_dump") and hasattr(item, "role"):  # ChatCompletionMessage and friends
        return {k: v for k, v in item.model_dump(mode="json").items() if v is not None}
    raise TypeError(f"messages_and_choices accepts message dicts and openai Choices, not {type(item).__name__}")


class Conversation(list):
    """A list that converts each appended item on the way in (see :func:`_normalize_item`)."""

    def __init__(self, items: Iterable[Any] = ()):
        super().__init__(_normalize_item(i) for i in items)

    def append(self, item: Any) -> None:
        super().append(_normalize_item(item))

    def extend(self, items: Iterable[Any]) -> None:
        super().extend(_normalize_item(i) for i in items)

    def insert(self, index: int, item: Any) -> None:
        super().insert(index, _normalize_item(item))

    def __setitem__(self, index, value) -> None:
        if isinstance(index, slice):
            super().__setitem__(index, [_normalize_item(v) for v in value])
        else:
            super().__setitem__(index, _normalize_item(value))

    def __iadd__(self, items: Iterable[Any]) -> Conversation:
        self.extend(items)
        return self


def _to_conversation(value: Any) -> Conversation:
    if isinstance(value, Conversation):
        return value
    if value is None:
        return Conversation()
    return Conversation(value)


class History(BaseModel):
    """A side conversation of a trajectory (e.g. a sub-agent); trained with the trajectory's advantage."""

    model_config = ConfigDict(arbitrary_types_allowed=True, validate_assignment=True)

    messages_and_choices: Any = Field(default_factory=Conversation, description="messages and sampled turns")
    tools: list[dict[str, Any]] | None = Field(default=None, description="tool schemas offered in this history")

    _norm = field_validator("messages_and_choices", mode="plain")(lambda cls, v: _to_conversation(v))

    def messages(self) -> list[Message]:
        """The conversation as plain chat messages (sampled turns give their message)."""
        return [i.message if isinstance(i, SampledTurn) else i for i in self.messages_and_choices]

    def sampled_turns(self) -> list[SampledTurn]:
        return [i for i in self.messages_and_choices if isinstance(i, SampledTurn)]



def _serialize_conversation(conv: Iterable[Any]) -> list[dict[str, Any]]:
    return [i.model_dump(mode="json") if isinstance(i, SampledTurn) else i for i in conv]


class Trajectory(History):
    """One rollout: its conversation, tools, reward, metrics and what went wrong if it failed."""

    additional_histories: list[History] = Field(default_factory=list, description="side conversations, same advantage")
    reward: float = Field(default=0.0, description="scalar reward used for the group-relative advantage")
    metrics: dict[str, float | int | bool] = Field(default_factory=dict, description="numbers to log per trajectory")
    metadata: dict[str, Scalar] = Field(default_factory=dict, description="scalars that identify the rollout")
    logs: list[str] = Field(default_factory=list, description="free-text notes from the rollout")
    error: str | None = Field(default=None, description="set when the rollout failed; such a trajectory is not trained")

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, v: float) -> float:
        if v is None or not math.isfinite(float(v)):
            raise ValueError(f"reward must be a finite number, got {v!r}")
        return float(v)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready dict; sampled turns keep their token ids and logprobs."""
        data = self.model_dump(mode="json")
        data["messages_and_choices"] = _serialize_conversation(self.messages_and_choices)
        data["additional_histories"] = [
            {**h.model_dump(mode="json"), "messages_and_choices": _serialize_conversation(h.messages_and_choices)}
            for h in self.additional_histories
        ]
        return data

    def model_dump_json(self, **kwargs) -> str:  # exact JSON round trip, ids and logprobs included
        import json

        return json.dumps(self.to_json_dict(), **({"indent": kwargs["indent"]} if "indent" in kwargs else {}))


class RecordedException(BaseModel):
    """An exception raised by a rollout, kept in its group instead of crashing the step."""

    type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> RecordedException:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(type=type(exc).__name__, message=str(exc), traceback=tb[-4000:])


class TrajectoryGroup(BaseModel):
    """The rollouts of one scenario: the GRPO group whose rewards are compared with each other.

    ``TrajectoryGroup(rollout(s) for _ in range(8))`` with awaitables gives a group to ``await``
    (or to pass to ``gather_trajectory_groups``): awaiting runs them concurrently, keeps the
    trajectories and records the exceptions.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[RecordedException] = Field(default_factory=list)
    scenario_id: str | None = Field(default=None, description="the scenario all trajectories answered")
    policy_step: int | None = Field(
        default=None, ge=0, description="the step of the policy that sampled it (`<run>@<step>`); None when unknown "
        "(a script's group, or one stored before this field existed)")
    metadata: dict[str, Scalar] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    _pending: list[Awaitable[Trajectory]] = PrivateAttr(default_factory=list)

    def __init__(self, trajectories: Iterable[Any] = (), /, **data: Any):
        items = list(trajectories if "trajectories" not in data else data.pop("trajectories"))
        pending = [i for i in items if isinstance(i, Awaitable) and not isinstance(i, Trajectory)]
        done = [i for i in items if not (isinstance(i, Awaitable) and not isinstance(i, Trajectory))]
        super().__init__(trajectories=done, **data)
        self._pending = pending

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def gather(self, on_done=None) -> TrajectoryGroup:
        """Await the pending rollouts concurrently; exceptions are recorded, never raised."""
        pending, self._pending = self._pending, []

        async def one(aw):
            try:
                result = await aw
            except Exception as exc:  # noqa: BLE001 - a rollout's failure is data, not a crash
                self.exceptions.append(RecordedException.from_exception(exc))
                if on_done:
                    on_done(None, exc)
                return
            if not isinstance(result, Trajectory):
                exc = TypeError(f"rollout returned {type(result).__name__}, expected Trajectory")
                self.exceptions.append(RecordedException.from_exception(exc))
                if on_done:
                    on_done(None, exc)
                return
            self.trajectories.append(result)
            if on_done:
                on_done(result, None)

        await asyncio.gather(*(one(aw) for aw in pending))
        return self

    def __await__(self):
        return self.gather().__await__()

    def to_json_dict(self) -> dict[str, Any]:
        # a group of unknown sampling step dumps as groups did before the field existed (stored JSON compares equal)
        data = self.model_dump(mode="json", exclude={"trajectories"} | ({"policy_step"} if self.policy_step is None
                                                                          else set()))
        data["trajectories"] = [t.to_json_dict() for t in self.trajectories]
        return data

    def model_dump_json(self, **kwargs) -> str:
        import json

        return json.dumps(self.to_json_dict())

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]
