"""The publish probe: proof that a server answers with the adapter the trainer wrote for a step.

The probe record (``training.json["probe"]``, written with every checkpoint, step 0 included, wherever the
trainer runs): prompt token ids the server itself rendered (the shortest prompt among the step's trainable
turns, else PROBE_MESSAGES through the server's chat-template code), the trainer's greedy continuation of
PROBE_TOKENS tokens and its raw logprob of each (`GRPOTrainer.greedy_tokens`, which verifies the step's sampled
completions of that prompt as drafts: fewer forwards, the same tokens), and the trainer's dtype.

Checks, strongest first:

1. **Against the record** (:func:`check_record`), with or without a trainer in this process: the server
   continues the record's ids greedily (``POST /v1/completions``, token-id prompt, temperature 0,
   ``ignore_eos``); logprobs are compared over the common prefix of the two continuations, plus the position
   where they first differ (same context there: both answers are the argmax of the same distribution, and the
   server's top logprobs give its logprob of the trainer's token; when they do not hold it, its logprob is below
   the least of them, which bounds the difference from below). Greedy argmax may flip on a near-tie in bf16;
   after that the contexts differ and nothing more is comparable. Passes by the rule of
   ``backends/policy/probe_rule.py``: each token within base + 2 (1 - p) delta and the median within base, by
   the trainer's dtype (or a configured flat tolerance).
2. **Against a trainer in this process** (:func:`check_with_trainer`), for a ``training.json`` without a
   record: the server's greedy chat answer is scored by ``trainer.sequence_logprobs`` (the same rule).
3. **Changed answers** (:func:`check_changed`), without record or trainer: the new policy must answer
   differently from the previous one. Weak: a stale adapter after a small update passes.
"""

from __future__ import annotations

from typing import Any

from backends.policy.probe_rule import judge

PROBE_MESSAGES = [{"role": "user", "content": "Say something."}]
PROBE_USER = "trajflow-publish-probe"  # marks probe requests in server logs
PROBE_RECORD = "probe"  # the key of the probe record in training.json
PROBE_TOKENS = 16
PROBE_TOP_LOGPROBS = 5  # top logprobs asked of the server: its logprob of the trainer's token where they differ
PROBE_SEED = 1234  # chat probes (checks 2 and 3) sample with seed PROBE_SEED + step: reproducible per step



class StaleAdapterError(RuntimeError):
    """The server does not answer with the adapter the trainer wrote."""


# ---- the record, written by the trainer's side ---------------------------------------------------------
def probe_prompt_ids(groups) -> list[int] | None:
    """The shortest prompt among the trainable turns of `groups` (ids the server rendered), or None.

    Shortest, not first: the trainer's prefill and scoring pass cost least on it, and a short prompt leaves
    room for PROBE_TOKENS more tokens in the server's context."""
    prompts = [turn.prompt_token_ids for group in groups for traj in group.trajectories if not traj.error
               for turn in traj.sampled_turns() if turn.trainable and turn.prompt_token_ids]
    return list(min(prompts, key=len)) if prompts else None


def render_probe_messages(tokenizer) -> list[int]:
    """PROBE_MESSAGES as the embedded server renders a chat request (its own code and chat template)."""
    from backends.serving.chat import ChatRequest, render_prompt

    return render_prompt(tokenizer, ChatRequest(model="probe", messages=PROBE_MESSAGES))


def dtype_name(trainer) -> str:
    return str(getattr(trainer, "dtype", "torch.float32")).removeprefix("torch.")


def probe_drafts(groups, prompt_ids: list[int] | None) -> list[list[int]]:
    """The sampled completions of `prompt_ids` in `groups` (turns of trajectories without error): drafts that the
    greedy continuation verifies a chunk per forward instead of decoding a token per forward."""
    if not prompt_ids:
        return []
    prompt = list(prompt_ids)
    return [list(turn.token_ids) for group in groups for traj in group.trajectories if not traj.error
            for turn in traj.sampled_turns() if turn.token_ids and list(turn.prompt_token_ids) == prompt]


def probe_record(trainer, prompt_ids: list[int] | None = None,
                 drafts: list[list[int]] = ()) -> tuple[dict[str, Any], int]:
    """What the publisher checks the server against: the trainer's greedy continuation of `prompt_ids`; and the
    decoder forwards it took (the greedy tokens, `drafts` and the context's repeats verified a chunk per forward,
    then one scoring pass)."""
    source = "trained-turn"
    if not prompt_ids:
        prompt_ids, source, drafts = render_probe_messages(trainer.tokenizer), "probe-messages", ()
    tokens, forwards = trainer.greedy_tokens(list(prompt_ids), PROBE_TOKENS, drafts, lookup=True)
    logprobs = trainer.sequence_logprobs(list(prompt_ids), tokens)
    record = {"prompt_token_ids": list(prompt_ids), "token_ids": tokens, "logprobs": logprobs,
              "dtype": dtype_name(trainer), "source": source}
    return record, forwards + 1


# ---- 1. against the record -------------------------------------------------------------------------------
async def _continue_ids(client, model: str, prompt_ids: list[int], max_tokens: int):
    """The server's greedy continuation of exact token ids: (token ids, raw logprobs, per-token {id: logprob})."""
    resp = await client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0.0, logprobs=PROBE_TOP_LOGPROBS,
        user=PROBE_USER, extra_body={"return_token_ids": True, "ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = resp.choices[0]
    lp = choice.logprobs
    tops = [{int(k[len("token_id:"):]): v for k, v in (top or {}).items() if k.startswith("token_id:")}
            for top in (lp.top_logprobs or [] if lp else [])]
    served = list(lp.token_logprobs or []) if lp else []
    return list((choice.model_extra or {}).get("token_ids") or []), served, tops


def compare_with_record(record: dict[str, Any], token_ids: list[int], served: list[float],
                        tops: list[dict[int, float]]) -> tuple[list[float], list[float], int]:
    """|served - recorded| over the common prefix and the first differing position; returns (diffs, the recorded
    logprob each diff is taken against, prefix length)."""
    expected_ids, expected = record["token_ids"], record["logprobs"]
    n = min(len(token_ids), len(served), len(expected_ids))
    same = 0
    while same < n and token_ids[same] == expected_ids[same]:
        same += 1
    compared = range(min(same + 1, n))
    diffs, against = [abs(served[i] - expected[i]) for i in compared], [expected[i] for i in compared]
    if same < n and same < len(tops) and tops[same]:
        top = tops[same]
        # the server's logprob of the trainer's token; not among its top ones: below the least of them
        diffs.append(abs(top[expected_ids[same]] - expected[same]) if expected_ids[same] in top
                     else max(0.0, expected[same] - min(top.values())))
        against.append(expected[same])
    return diffs, against, same


async def check_record(client, name: str, record: dict[str, Any], tolerance: float | None) -> dict[str, float]:
    """Check 1 (module docstring); StaleAdapterError if it fails."""
    token_ids, served, tops = await _continue_ids(client, name, record["prompt_token_ids"], len(record["token_ids"]))
    diffs, against, same = compare_with_record(record, token_ids, served, tops)
    if not diffs:
        raise StaleAdapterError(f"probe of {name} returned no token ids/logprobs; the server does not speak the "
                                "dialect (/v1/completions with token-id prompts, return_token_ids + logprobs)")
    verdict = judge(diffs, against, record.get("dtype", "bfloat16"), tolerance)
    if not verdict.passed:
        raise StaleAdapterError(f"server logprobs for {name} differ from the trainer's probe record by "
                                f"{verdict.describe()}; {same} of {len(record['token_ids'])} greedy tokens agree; "
                                "the served adapter is not the one trained at this step")
    return {**verdict.metrics(), "publish/probe_common_prefix": float(same)}


# ---- 2. and 3.: chat probes ------------------------------------------------------------------------------
async def _sample(client, model: str, messages, seed: int) -> tuple[list[int], list[int], list[float]]:
    """Greedy probe answer: (prompt ids, token ids, raw logprobs). Greedy tokens are likely ones, whose
    logprobs move least under bf16 rounding (dlogp ~ (1 - p) dz): on an H200, temperature-1 probes of 8
    tokens differed from the trainer by up to 0.24 in bf16, which no useful tolerance separates from a
    stale adapter."""
    resp = await client.chat.completions.create(model=model, messages=messages, max_tokens=PROBE_TOKENS,
                                                temperature=0.0, seed=seed, logprobs=True, user=PROBE_USER)
    choice = resp.choices[0]
    extra = choice.model_extra or {}
    prompt_ids = list(extra.get("prompt_token_ids") or (resp.model_extra or {}).get("prompt_token_ids") or [])
    token_ids = list(extra.get("token_ids") or [])
    content = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    if not token_ids or len(content) != len(token_ids):
        raise StaleAdapterError(f"probe of {model} returned no token ids/logprobs; the server does not speak "
                                "the dialect (return_token_ids + logprobs)")
    return prompt_ids, token_ids, [e.logprob for e in content]


async def check_with_trainer(client, name: str, messages, seed: int, trainer,
                             tolerance: float | None) -> dict[str, float]:
    """Check 2 (module docstring); StaleAdapterError if it fails."""
    prompt_ids, token_ids, served = await _sample(client, name, messages, seed)
    expected = trainer.sequence_logprobs(prompt_ids, token_ids)
    diffs = [abs(a - b) for a, b in zip(served, expected)]
    verdict = judge(diffs, expected, dtype_name(trainer), tolerance)
    if not verdict.passed:
        raise StaleAdapterError(f"server logprobs for {name} differ from the trainer's by {verdict.describe()}; "
                                "the served adapter is not the one just trained")
    return verdict.metrics()


async def check_answers(client, name: str, messages, seed: int) -> dict[str, float]:
    """The dialect alone, when no change is expected (step 0, an update that did not move the policy)."""
    await _sample(client, name, messages, seed)
    return {}


async def check_changed(client, name: str, previous: str, messages, seed: int) -> dict[str, float]:
    """Check 3 (module docstring); StaleAdapterError if `name` answers exactly like `previous`."""
    _, token_ids, served = await _sample(client, name, messages, seed)
    _, prev_ids, prev_lp = await _sample(client, previous, messages, seed)
    changed = prev_ids != token_ids or any(abs(a - b) > 1e-5 for a, b in zip(served, prev_lp))
    if not changed:
        raise StaleAdapterError(f"{name} answers exactly like {previous}: the new adapter is not being served")
    return {"publish/probe_changed": float(changed)}
