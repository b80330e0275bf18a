"""Weave tracing: once ``tracking.weave`` is configured, rollouts and judge calls are Weave ops.

``init_weave(project)`` calls ``weave.init``; from then on :func:`traced` wraps a function with ``weave.op`` (its
inputs and outputs sent without token ids and logprobs, with credentials redacted), and before it (or when Weave is
not configured) returns the function itself, so untraced code pays nothing. A script can also decorate its own
rollout with ``@weave.op``, as ART's examples do. Weave needs a W&B login and has no offline mode, so its tests check
the calls trajflow makes against a recording stand-in (README, "Experiment tracking").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agents.secrets import environment_secrets, redact

DROPPED = frozenset({"token_ids", "prompt_token_ids", "logprobs", "top_logprobs"})
_weave: Any = None
_project: str | None = None
_ops: dict[tuple[Callable, str], Callable] = {}


def init_weave(project: str) -> None:
    """``weave.init(project)``, once per process and project."""
    global _weave, _project
    if _weave is not None and _project == project:
        return
    import weave

    weave.init(project)
    _weave, _project = weave, project
    _ops.clear()


def weave_active() -> bool:
    return _weave is not None


def clean(value: Any, secrets: list[str] | None = None) -> Any:
    """`value` as JSON-like data without token ids, logprobs or credentials."""
    secrets = environment_secrets() if secrets is None else secrets
    if hasattr(value, "to_json_dict"):
        value = value.to_json_dict()
    elif hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: clean(v, secrets) for k, v in value.items() if k not in DROPPED}
    if isinstance(value, (list, tuple)):
        return [clean(v, secrets) for v in value]
    if isinstance(value, str):
        return redact(value, secrets)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return redact(repr(value), secrets)


def traced(fn: Callable, name: str) -> Callable:
    """`fn` as the Weave op `name` when Weave is on, else `fn` unchanged."""
    if _weave is None:
        return fn
    key = (fn, name)
    if key not in _ops:
        _ops[key] = _weave.op(fn, name=name, postprocess_inputs=clean, postprocess_output=clean)
    return _ops[key]
