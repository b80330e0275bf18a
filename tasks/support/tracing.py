"""Langfuse tracing of rollouts: one trace per rollout, one generation per LLM call, scores per trajectory.

On only when ``LANGFUSE_PUBLIC_KEY`` and ``LANGFUSE_SECRET_KEY`` are set (host from ``LANGFUSE_BASE_URL``
or ``LANGFUSE_HOST``). Off, every method is a no-op and ``langfuse`` is never imported, so tracing
costs nothing on the rollout path.

Trace ids are deterministic: ``sha256("trajflow/<run>/step-<step>/<scenario>/<index>")[:16]`` as 32
hex characters (the same rule as ``Langfuse.create_trace_id(seed=...)``). The attempt number is NOT
part of the id; it goes into the trace metadata, so a retried rollout task (Prefect retry, resumed
step) adds to the same trace instead of creating a duplicate. Score ids are derived from
(trace id, score name) the same way, so a re-sent score carries the same id.

Payloads are sanitised before they leave: sampled turns become their plain message; ``token_ids``,
``prompt_token_ids``, ``logprobs`` and ``top_logprobs`` are dropped at any depth; long strings are cut;
and any string equal to or containing a credential from the environment (the Langfuse keys, any
``*API_KEY*``/``*SECRET*``/``*TOKEN*``/``*PASSWORD*`` variable of 8+ characters) is redacted. Keys are
never put in span attributes, metadata or logs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from agents.secrets import environment_secrets, redact

log = logging.getLogger(__name__)

DROPPED_KEYS = frozenset({"token_ids", "prompt_token_ids", "logprobs", "top_logprobs"})
MAX_STRING = 20_000


def _seed_id(seed: str, n_bytes: int = 16) -> str:
    return hashlib.sha256(seed.encode("utf-8")).digest()[:n_bytes].hex()


def rollout_trace_id(run: str, step: int, scenario_id: str, index: int) -> str:
    """The trace id of one rollout; stable across retries (see module docstring)."""
    return _seed_id(f"trajflow/{run}/step-{int(step)}/{scenario_id}/{int(index)}")


def score_id(trace_id: str, name: str) -> str:
    return _seed_id(f"{trace_id}/score/{name}")


def langfuse_configured(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(env.get("LANGFUSE_PUBLIC_KEY")) and bool(env.get("LANGFUSE_SECRET_KEY"))


def _environment_secrets(env: Mapping[str, str]) -> list[str]:
    return environment_secrets(env, also=(env.get("LANGFUSE_PUBLIC_KEY", ""), env.get("LANGFUSE_SECRET_KEY", "")))


class Redactor:
    """Makes a payload safe and small for a span: plain messages, no token data, no secrets."""

    def __init__(self, secrets: list[str]) -> None:
        self._secrets = [s for s in secrets if s]

    def text(self, value: str) -> str:
        value = redact(value, self._secrets)
        return value if len(value) <= MAX_STRING else value[:MAX_STRING] + f"... [{len(value) - MAX_STRING} chars cut]"

    def __call__(self, data: Any = None, **kwargs: Any) -> Any:  # also Langfuse's ``mask(data=...)``
        if "data" in kwargs:
            data = kwargs["data"]
        return self.clean(data)

    def clean(self, value: Any, depth: int = 0) -> Any:
        if depth > 20:
            return "[too deep]"
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, str):
            return self.text(value)
        message = getattr(value, "message", None)
        if hasattr(value, "token_ids") and isinstance(message, dict):  # a SampledTurn
            return self.clean(message, depth + 1)
        if hasattr(value, "messages") and callable(value.messages) and hasattr(value, "messages_and_choices"):
            return self.clean(value.messages(), depth + 1)  # a Trajectory or History
        if hasattr(value, "model_dump"):
            value = value.model_dump(mode="json")
        if isinstance(value, Mapping):
            return {self.text(str(k)): self.clean(v, depth + 1) for k, v in value.items() if k not in DROPPED_KEYS}
        if isinstance(value, (list, tuple)):
            return [self.clean(v, depth + 1) for v in value]
        return self.text(str(value))


def _usage_details(usage: Any) -> dict[str, int] | None:
    """``{"input", "output", "total"}`` token counts from an openai usage object or dict."""
    if usage is None:
        return None
    if hasattr(usage, "model_dump"):
        usage = usage.model_dump()
    if not isinstance(usage, Mapping):
        return None
    out = {}
    for src, dst in (("prompt_tokens", "input"), ("input", "input"), ("completion_tokens", "output"),
                     ("output", "output"), ("total_tokens", "total"), ("total", "total")):
        value = usage.get(src)
        if isinstance(value, int) and not isinstance(value, bool) and dst not in out:
            out[dst] = value
    return out or None


class RolloutTrace:
    """The handle of one rollout's trace: add generations, scores and the outcome to it."""

    def __init__(self, tracer: Tracer, trace_id: str, span: Any = None) -> None:
        self.tracer = tracer
        self.trace_id = trace_id
        self._span = span

    @property
    def enabled(self) -> bool:
        return self._span is not None

    def generation(self, name: str, model: str, input: Any = None, output: Any = None, usage: Any = None,
                   latency_s: float | None = None, metadata: Mapping[str, Any] | None = None) -> None:
        if self._span is not None:
            self.tracer._record_generation(self._span, name, model, input, output, usage, latency_s, metadata)

    def score(self, name: str, value: float, comment: str | None = None) -> None:
        if self._span is not None:
            self.tracer.score(self.trace_id, name, value, comment)

    def update(self, output: Any = None, metadata: Mapping[str, Any] | None = None) -> None:
        if self._span is not None:
            clean = self.tracer._redact
            self._span.update(output=clean(output), metadata=clean(dict(metadata)) if metadata else None)


class Tracer:
    """Langfuse when configured, nothing otherwise. Build with :meth:`from_env` or :func:`get_tracer`.

    ``client`` is a ready ``langfuse.Langfuse`` (tests pass one with an in-memory span exporter);
    None means disabled.
    """

    def __init__(self, client: Any = None, secrets: list[str] | None = None) -> None:
        self._client = client
        self._redact = Redactor(secrets if secrets is not None else _environment_secrets(os.environ))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **langfuse_kwargs: Any) -> Tracer:
        """Enabled iff both Langfuse keys are set; ``langfuse_kwargs`` go to ``Langfuse(...)`` (e.g. a tracer_provider)."""
        env = dict(os.environ if env is None else env)
        if not langfuse_configured(env):
            return cls(None, secrets=[])
        from langfuse import Langfuse  # imported only when tracing is on

        redact = Redactor(_environment_secrets(env))
        client = Langfuse(
            public_key=env["LANGFUSE_PUBLIC_KEY"],
            secret_key=env["LANGFUSE_SECRET_KEY"],
            base_url=env.get("LANGFUSE_BASE_URL") or env.get("LANGFUSE_HOST") or None,
            mask=redact,
            **langfuse_kwargs,
        )
        tracer = cls(client)
        tracer._redact = redact
        return tracer

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def __repr__(self) -> str:  # never shows keys
        return f"Tracer(enabled={self.enabled})"

    @contextlib.contextmanager
    def rollout_trace(self, run: str, step: int, scenario_id: str, index: int, attempt: int = 0,
                      input: Any = None, metadata: Mapping[str, Any] | None = None) -> Iterator[RolloutTrace]:
        """One trace per rollout, id from (run, step, scenario, index); ``attempt`` goes to metadata."""
        trace_id = rollout_trace_id(run, step, scenario_id, index)
        if self._client is None:
            yield RolloutTrace(self, trace_id)
            return
        from langfuse import propagate_attributes

        meta = {"run": str(run), "step": str(step), "scenario_id": str(scenario_id), "index": str(index),
                "attempt": str(attempt), **{str(k): str(v)[:200] for k, v in (metadata or {}).items()}}
        meta = self._redact(meta)
        with self._client.start_as_current_observation(
            trace_context={"trace_id": trace_id}, name="rollout", as_type="agent",
            input=self._redact(input), metadata=meta,
        ) as span, propagate_attributes(
            trace_name=f"rollout {str(scenario_id)[:150]}", session_id=f"{run}/step-{int(step)}"[:200],
            tags=[f"run:{run}"[:200], f"step:{int(step)}"], metadata=meta,
        ):
            yield RolloutTrace(self, trace_id, span)

    def _record_generation(self, parent: Any, name: str, model: str, input: Any, output: Any, usage: Any,
                           latency_s: float | None, metadata: Mapping[str, Any] | None,
                           trace_id: str | None = None) -> None:
        meta = dict(metadata or {})
        if latency_s is not None:
            meta["latency_s"] = round(float(latency_s), 6)
        kwargs: dict[str, Any] = dict(
            name=name, as_type="generation", model=model, input=self._redact(input), output=self._redact(output),
            usage_details=_usage_details(usage), metadata=self._redact(meta) or None,
        )
        if parent is not None:
            generation = parent.start_observation(**kwargs)
        elif trace_id is not None:
            generation = self._client.start_observation(trace_context={"trace_id": trace_id}, **kwargs)
        else:
            generation = self._client.start_observation(**kwargs)
        generation.end()

    def generation(self, name: str, model: str, input: Any = None, output: Any = None, usage: Any = None,
                   latency_s: float | None = None, trace_id: str | None = None,
                   metadata: Mapping[str, Any] | None = None) -> None:
        """One LLM call: policy/model name, messages in and out (no token data), token usage, latency.

        With ``trace_id`` it joins that trace; otherwise it nests under the current observation
        (inside :meth:`rollout_trace`), or starts a trace of its own.
        """
        if self._client is not None:
            self._record_generation(None, name, model, input, output, usage, latency_s, metadata, trace_id)

    def score(self, trace_id: str, name: str, value: float, comment: str | None = None) -> None:
        """A numeric score on a trace (reward, judge score, a component); same id if sent again."""
        if self._client is None:
            return
        self._client.create_score(
            trace_id=trace_id, name=name, value=float(value), data_type="NUMERIC",
            score_id=score_id(trace_id, name), comment=self._redact(comment) if comment else None,
        )

    def score_trajectory(self, trace_id: str, trajectory: Any) -> None:
        """``reward`` plus the trajectory's judge score, original reward and ``reward/*`` components."""
        if self._client is None:
            return
        self.score(trace_id, "reward", trajectory.reward)
        metrics = trajectory.metrics or {}
        judge_comment = next((line for line in reversed(trajectory.logs or []) if line.startswith("judge ")), None)
        for name, value in sorted(metrics.items()):
            if name in ("judge_score", "independent_reward") or name.startswith("reward/"):
                self.score(trace_id, name, float(value), judge_comment if name == "judge_score" else None)

    def flush(self) -> None:
        """Send what is buffered (call at the end of each task)."""
        if self._client is not None:
            self._client.flush()

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.shutdown()


_lock = threading.Lock()
_cached: tuple[tuple[str, str, str], Tracer] | None = None


def get_tracer() -> Tracer:
    """The process's tracer from the environment, rebuilt if the Langfuse settings changed."""
    global _cached
    env = os.environ
    fingerprint = (_seed_id(env.get("LANGFUSE_PUBLIC_KEY", "") + "\0" + env.get("LANGFUSE_SECRET_KEY", "")),
                   env.get("LANGFUSE_BASE_URL", ""), env.get("LANGFUSE_HOST", ""))
    with _lock:
        if _cached is None or _cached[0] != fingerprint:
            _cached = (fingerprint, Tracer.from_env())
        return _cached[1]
