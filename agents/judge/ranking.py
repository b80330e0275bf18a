"""The LLM judge: score the trajectories of one group relative to each other (RULER, done right).

One request per group to any OpenAI-compatible endpoint (the embedded server, vLLM, a hosted model).
What it fixes compared with ART's RULER:

- scores are matched by trajectory id (``t1..tN``), never by position, validated and clamped to [0, 1];
  a missing, duplicated or unknown id, a wrong count or unparseable JSON fails that attempt;
- a JSON schema is requested (``response_format``) when ``use_json_schema``; a server that rejects it
  with 400/422 is asked again in plain text for the rest of the call, and any reply is parsed robustly
  (code fences, prose around the JSON, ``<think>`` blocks);
- retries with exponential back-off, ``backoff_s * 2**(attempt-1)``, on connection errors, timeouts,
  408/409/429/5xx and bad answers; other 4xx (auth, unknown model) stop at once;
- after the last failure, ``on_failure="fail"`` raises :class:`JudgeError` naming what went wrong;
  ``"keep"`` keeps the agent's rewards and marks the group with ``judge_failed=1``;
- the verdict is cached by content hash (:func:`cache_key`), so a resumed step or a re-scored group
  makes no request (``judge_cache_hit=1``);
- ``additional_histories`` and tool-calling trajectories are rendered for the judge.

How the score becomes the reward follows :mod:`agents.rewards` (``replace`` by default); the agent's
own reward always stays in ``metrics["independent_reward"]``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import openai
from pydantic import BaseModel, ConfigDict, Field, field_validator

from agents.judge.cache import (
    InMemoryJudgeCache,
    JudgeCache,
    LocalFolderJudgeCache,
    cache_key,
    cached_scores,
)
from agents.judge.parse import JudgedScore, JudgeParseError, parse_scores
from agents.judge.prompt import DEFAULT_RUBRIC, PROMPT_VERSION, build_judge_messages, id_to_index, response_schema
from agents.rewards import INDEPENDENT_REWARD, JUDGE_SCORE, RewardConfig, apply_judge_scores, original_reward
from agents.tracking.weave_ops import traced
from agents.trajectory import TrajectoryGroup

__all__ = [
    "DEFAULT_RUBRIC",
    "InMemoryJudgeCache",
    "JudgeCache",
    "JudgeConfig",
    "JudgeError",
    "JudgeParseError",
    "LocalFolderJudgeCache",
    "cache_key",
    "judge_group",
    "ruler_score_group",
]

log = logging.getLogger(__name__)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class JudgeError(RuntimeError):
    """The judge could not score a group (after all attempts), or is misconfigured."""


class JudgeConfig(BaseModel):
    """Which judge to ask, how, and what to do when it keeps failing. Holds no secrets."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None,
        description="judge model as the endpoint names it; None reads TRAJFLOW_JUDGE_MODEL. A stronger judge "
        "ranks better but costs more per group",
    )
    base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1; None reads TRAJFLOW_JUDGE_BASE_URL, "
        "then OPENAI_BASE_URL, then the openai default",
    )
    api_key_env: str = Field(
        default="TRAJFLOW_JUDGE_API_KEY",
        description="NAME of the environment variable holding the key (never the key); unset falls back to "
        "OPENAI_API_KEY, then a placeholder for local servers",
    )
    rubric: str = Field(
        default=DEFAULT_RUBRIC,
        description="what a good trajectory is; the default favours success, then efficiency, with partial credit. "
        "Agents replace it with their own; part of the cache key",
    )
    max_attempts: int = Field(default=3, ge=1, le=20, description="requests per group before on_failure applies")
    backoff_s: float = Field(
        default=1.0, ge=0.0, le=600.0, description="wait before the 2nd attempt; doubles for each later one"
    )
    on_failure: Literal["fail", "keep"] = Field(
        default="keep",
        description="after the last failed attempt: fail raises JudgeError (the task fails, Prefect may retry it); "
        "keep trains on the agent's own rewards and marks the group judge_failed=1",
    )
    use_json_schema: bool = Field(
        default=True,
        description="ask for a JSON schema via response_format; servers that reject it get plain text prompting",
    )
    temperature: float | None = Field(
        default=None, ge=0.0, le=2.0,
        description="judge sampling temperature; None leaves the server default (some reasoning models reject others)",
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="cap on the judge's reply length; None leaves the server default"
    )
    timeout_s: float = Field(default=120.0, gt=0, description="per-request timeout in seconds")
    max_concurrency: int = Field(
        default=8, ge=1, le=256,
        description="groups judged at once within a step (one request each); higher finishes scoring sooner "
        "but may hit the judge endpoint's rate limit",
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="extra request fields passed through, e.g. {'chat_template_kwargs': {'enable_thinking': False}}",
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str) -> str:
        if not _ENV_NAME.match(v):
            raise ValueError("api_key_env must be the NAME of an environment variable (letters, digits, _), not a key")
        return v

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"judge base_url must be an http(s) URL, got {v!r}")
        if parts.username or parts.password:
            raise ValueError("judge base_url must not embed credentials; put the key in the api_key_env variable")
        return v

    def resolved_model(self) -> str:
        model = self.model or os.environ.get("TRAJFLOW_JUDGE_MODEL")
        if not model:
            raise JudgeError("no judge model: set JudgeConfig.model or the TRAJFLOW_JUDGE_MODEL environment variable")
        return model

    def resolved_base_url(self) -> str | None:
        return self.base_url or os.environ.get("TRAJFLOW_JUDGE_BASE_URL") or os.environ.get("OPENAI_BASE_URL") or None

    def make_client(self, api_key: str | None = None) -> openai.AsyncOpenAI:
        """A client for the judge endpoint; the key comes from the environment (or the argument)."""
        key = api_key or os.environ.get(self.api_key_env) or os.environ.get("OPENAI_API_KEY") or "not-needed"
        return openai.AsyncOpenAI(
            base_url=self.resolved_base_url(), api_key=key, max_retries=0, timeout=self.timeout_s
        )


@dataclass
class _Outcome:
    scores: dict[str, JudgedScore] | None = None
    errors: list[str] = field(default_factory=list)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    json_schema: bool = True
    notes: list[str] = field(default_factory=list)


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (JudgeParseError, openai.APIConnectionError)):  # includes timeouts
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    return False


def _describe(exc: BaseException, secrets: list[str]) -> str:
    """A short error text for logs, with any credential the server may have echoed replaced."""
    if isinstance(exc, openai.APIStatusError):
        text = f"HTTP {exc.status_code}: {str(exc.message)[:300]}"
    elif isinstance(exc, openai.APIConnectionError):
        text = f"{type(exc).__name__}: {exc}"
    else:
        text = str(exc)[:500]
    for secret in secrets:
        text = text.replace(secret, "[redacted]")
    return text


def _client_secrets(client: openai.AsyncOpenAI) -> list[str]:
    """The key and any URL credentials or query of the client, so error texts never carry them."""
    parts = urlsplit(str(client.base_url))
    found = [str(getattr(client, "api_key", "") or ""), parts.password or "", parts.query or ""]
    return sorted((f for f in found if len(f) >= 4), key=len, reverse=True)


async def _ask_judge(
    client: openai.AsyncOpenAI, config: JudgeConfig, model: str, messages: list[dict[str, str]], ids: list[str]
) -> _Outcome:
    out = _Outcome(json_schema=config.use_json_schema)
    secrets = _client_secrets(client)
    attempt = 0
    while attempt < config.max_attempts:
        kwargs: dict[str, Any] = {"model": model, "messages": messages}
        if config.temperature is not None:
            kwargs["temperature"] = config.temperature
        if config.max_tokens is not None:
            kwargs["max_tokens"] = config.max_tokens
        if out.json_schema:
            kwargs["response_format"] = response_schema(ids)
        if config.extra_body:
            kwargs["extra_body"] = dict(config.extra_body)
        out.requests += 1
        try:
            response = await client.chat.completions.create(**kwargs)
            if response.usage is not None:
                out.prompt_tokens += response.usage.prompt_tokens or 0
                out.completion_tokens += response.usage.completion_tokens or 0
            if not response.choices:
                raise JudgeParseError("the judge's response has no choices")
            message = response.choices[0].message
            if not message.content and getattr(message, "refusal", None):
                raise JudgeParseError(f"the judge refused: {message.refusal[:200]}")
            out.scores = parse_scores(message.content or "", ids)
            return out
        except openai.APIStatusError as exc:
            if out.json_schema and exc.status_code in (400, 422):
                out.json_schema = False  # remembered for the rest of this call; not counted as an attempt
                out.notes.append(f"judge rejected response_format json_schema ({_describe(exc, secrets)}); using plain text")
                continue
            error = exc
        except (openai.APIConnectionError, JudgeParseError) as exc:
            error = exc
        attempt += 1
        out.errors.append(f"attempt {attempt}: {_describe(error, secrets)}")
        if not _retryable(error):
            break
        if attempt < config.max_attempts and config.backoff_s > 0:
            await asyncio.sleep(config.backoff_s * 2 ** (attempt - 1))
    return out


def _display_url(url: str | None) -> str:
    """The endpoint without credentials or query (either may carry a key when it comes from the environment)."""
    if not url:
        return "the openai default URL"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


def _group_metrics(group: TrajectoryGroup, **values: float) -> None:
    group.metrics.update(values)


async def judge_group(
    group: TrajectoryGroup,
    config: JudgeConfig,
    client: openai.AsyncOpenAI | None = None,
    cache: JudgeCache | None = None,
    task_description: str | None = None,
    rewards: RewardConfig | None = None,
) -> TrajectoryGroup:
    """A copy of ``group`` with judge-based rewards (combined per ``rewards``, replace by default).

    Per trajectory: ``metrics`` gain ``judge_score`` (on success), ``independent_reward``,
    ``judge_cache_hit`` and ``judge_failed`` (0/1); the judge's explanation is appended to ``logs``.
    The group's ``metrics`` gain ``judge_cache_hit``, ``judge_failed``, ``judge_requests`` and token counts.
    """
    model = config.resolved_model()
    rewards = rewards or RewardConfig()
    if not group.trajectories:
        return group
    messages, ids = build_judge_messages(group, config.rubric, task_description)
    key = cache_key(model, config.rubric, group, task_description)

    if cache is not None:
        entry = await asyncio.to_thread(cache.get, key)
        hit = cached_scores(entry, ids)
        if hit is not None:
            return _scored(group, hit, model, rewards, cache_hit=True, outcome=_Outcome())
        if entry is not None:
            log.warning("judge cache entry %s does not fit this group; judging again", key[:12])

    own_client = client is None
    judge_client = config.make_client() if own_client else client.with_options(max_retries=0, timeout=config.timeout_s)
    started = time.perf_counter()
    try:
        outcome = await traced(_ask_judge, "judge")(judge_client, config, model, messages, ids)
    finally:
        if own_client:
            await judge_client.close()
    elapsed = time.perf_counter() - started

    if outcome.scores is None:
        where = f"judge {model!r} at {_display_url(config.resolved_base_url())}"
        reason = f"{where} failed to score group {group.scenario_id or '?'} of {len(ids)} after " \
                 f"{len(outcome.errors)} attempt(s): " + "; ".join(outcome.errors)
        if config.on_failure == "fail":
            raise JudgeError(reason)
        log.warning("%s; keeping the agent's rewards", reason)
        return _failed(group, reason, outcome)

    verdict = {id_: {"score": s.score, "raw_score": s.raw_score, "explanation": s.explanation}
               for id_, s in outcome.scores.items()}
    if cache is not None:
        entry = {"model": model, "prompt_version": PROMPT_VERSION, "scores": verdict, "judge_seconds": round(elapsed, 3)}
        try:
            await asyncio.to_thread(cache.put, key, entry)
        except Exception as exc:  # noqa: BLE001 - a cache write failure must not lose a valid verdict
            log.warning("judge cache write failed for %s: %s", key[:12], exc)
            outcome.notes.append(f"judge cache write failed: {exc}")
    return _scored(group, verdict, model, rewards, cache_hit=False, outcome=outcome)


def _scored(
    group: TrajectoryGroup, verdict: dict[str, dict[str, Any]], model: str, rewards: RewardConfig,
    cache_hit: bool, outcome: _Outcome,
) -> TrajectoryGroup:
    by_index = {id_to_index(i): float(v["score"]) for i, v in verdict.items()}
    scored = apply_judge_scores(group, by_index, rewards.mode, rewards.judge_weight)
    for k, traj in enumerate(scored.trajectories):
        entry = verdict[f"t{k + 1}"]
        traj.metrics["judge_cache_hit"] = int(cache_hit)
        traj.metrics["judge_failed"] = 0
        clamped = "" if entry.get("raw_score", entry["score"]) == entry["score"] else f" (judge wrote {entry['raw_score']}, clamped)"
        explanation = entry.get("explanation") or ""
        traj.logs.append(f"judge {model}{' [cached]' if cache_hit else ''}: score {float(entry['score']):.3f}{clamped}"
                         + (f" - {explanation}" if explanation else ""))
    scored.logs.extend(outcome.notes)
    _group_metrics(
        scored, judge_cache_hit=int(cache_hit), judge_failed=0, judge_requests=outcome.requests,
        judge_prompt_tokens=outcome.prompt_tokens, judge_completion_tokens=outcome.completion_tokens,
    )
    return scored


def _failed(group: TrajectoryGroup, reason: str, outcome: _Outcome) -> TrajectoryGroup:
    trajectories = []
    for traj in group.trajectories:
        metrics = {**traj.metrics, INDEPENDENT_REWARD: original_reward(traj), "judge_cache_hit": 0, "judge_failed": 1}
        metrics.pop(JUDGE_SCORE, None)  # a stale score from an earlier judgment would no longer match the reward
        new = traj.model_copy(update={"metrics": metrics, "logs": [*traj.logs, f"judge failed: {reason}"]})
        new.reward = original_reward(traj)
        trajectories.append(new)
    failed = group.model_copy(
        update={"trajectories": trajectories, "metrics": dict(group.metrics), "logs": [*group.logs, *outcome.notes, reason]}
    )
    _group_metrics(
        failed, judge_cache_hit=0, judge_failed=1, judge_requests=outcome.requests,
        judge_prompt_tokens=outcome.prompt_tokens, judge_completion_tokens=outcome.completion_tokens,
    )
    return failed


_LITELLM_KEYS = {"api_base": "base_url", "base_url": "base_url", "temperature": "temperature",
                 "max_tokens": "max_tokens", "timeout": "timeout_s", "num_retries": "max_attempts"}


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str | None = None,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
    client: openai.AsyncOpenAI | None = None,
    cache: JudgeCache | None = None,
    config: JudgeConfig | None = None,
) -> TrajectoryGroup | None:
    """ART's ``ruler_score_group``: the judge score replaces the reward (also in ``metrics["ruler_score"]``).

    Usable as ``gather_trajectory_groups(..., after_each=lambda g: ruler_score_group(g, "model", swallow_exceptions=True))``.
    Raises :class:`JudgeError` on failure, or returns None when ``swallow_exceptions``.
    ``extra_litellm_params`` maps ``api_base``/``temperature``/``max_tokens``/``timeout``/``num_retries`` onto
    :class:`JudgeConfig`, uses ``api_key`` for this call's client only (never stored), and passes the rest
    as extra request fields.
    """
    extra = dict(extra_litellm_params or {})
    api_key = extra.pop("api_key", None)
    updates: dict[str, Any] = {"rubric": rubric, "on_failure": "fail"}
    if judge_model:
        updates["model"] = judge_model
    for name, target in _LITELLM_KEYS.items():
        if name in extra:
            updates[target] = extra.pop(name)
    base = config or JudgeConfig()
    if extra:
        updates["extra_body"] = {**base.extra_body, **extra}
    cfg = JudgeConfig.model_validate({**base.model_dump(), **updates})
    own_client = None
    if client is None and api_key:
        client = own_client = cfg.make_client(api_key=api_key)
    try:
        scored = await judge_group(group, cfg, client=client, cache=cache)
    except JudgeError as exc:
        if debug:
            log.error("ruler_score_group: %s", exc)
        if swallow_exceptions:
            return None
        raise
    finally:
        if own_client is not None:
            await own_client.close()
    for traj in scored.trajectories:
        traj.metrics["ruler_score"] = traj.metrics[JUDGE_SCORE]
    if debug:
        for line in (t.logs[-1] for t in scored.trajectories):
            log.info("%s", line)
    return scored
