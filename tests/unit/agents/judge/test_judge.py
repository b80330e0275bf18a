"""The judge against a real local HTTP server answering like an OpenAI endpoint, through the real openai client."""

import json

import pytest

from agents import History, Trajectory, TrajectoryGroup
from agents.judge import (
    InMemoryJudgeCache,
    JudgeConfig,
    JudgeError,
    LocalFolderJudgeCache,
    judge_group,
    ruler_score_group,
)
from agents.rewards import RewardConfig
from tests.fixtures_judge import ADD_TOOL, Reply, make_group, scores_json


def config(server, **kw) -> JudgeConfig:
    return JudgeConfig(model="judge-model", base_url=server.base_url, backoff_s=0.01, **kw)


def metric(group, name):
    return [t.metrics.get(name) for t in group.trajectories]


async def test_valid_json_replaces_rewards_and_keeps_the_original(judge_server):
    judge_server.script(scores_json({"t1": 0.9, "t2": 0.1, "t3": 0.5}))
    group = make_group(["4", "5", "four"], rewards=[1.0, 0.0, 0.5])
    scored = await judge_group(group, config(judge_server))
    assert scored.rewards == [0.9, 0.1, 0.5]
    assert metric(scored, "independent_reward") == [1.0, 0.0, 0.5]
    assert metric(scored, "judge_score") == [0.9, 0.1, 0.5]
    assert metric(scored, "judge_failed") == [0, 0, 0] and metric(scored, "judge_cache_hit") == [0, 0, 0]
    assert scored.metrics["judge_failed"] == 0 and scored.metrics["judge_requests"] == 1
    assert scored.metrics["judge_prompt_tokens"] == 100
    assert "reason t2" in scored.trajectories[1].logs[-1]
    body = judge_server.chat_requests[0]["json"]
    assert body["model"] == "judge-model"
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"]["properties"]["scores"]["items"]["properties"]["id"]["enum"] == ["t1", "t2", "t3"]


async def test_permuted_ids_map_by_id_not_position(judge_server):
    judge_server.script(scores_json({"t3": 0.3, "t1": 1.0, "t2": 0.0}))
    scored = await judge_group(make_group(["a", "b", "c"]), config(judge_server))
    assert scored.rewards == [1.0, 0.0, 0.3]


async def test_code_fences_with_prose_and_out_of_range_scores_are_clamped(judge_server):
    reply = ("Here is my assessment.\n```json\n"
             + json.dumps({"scores": [{"id": "t1", "score": 7}, {"id": "t2", "score": -2}, {"id": "t3", "score": "0.4"}]})
             + "\n```\nLet me know if you need more.")
    judge_server.script(reply)
    scored = await judge_group(make_group(["a", "b", "c"]), config(judge_server))
    assert scored.rewards == [1.0, 0.0, 0.4]
    assert "judge wrote 7.0, clamped" in scored.trajectories[0].logs[-1]


@pytest.mark.parametrize(
    "bad, problem",
    [
        (scores_json({"t1": 0.5, "t2": 0.5}), r"expected 3 scores, got 2; missing ids \['t3'\]"),
        (json.dumps({"scores": [{"id": "t1", "score": 1}, {"id": "t1", "score": 0}, {"id": "t2", "score": 0}]}),
         r"missing ids \['t3'\]; duplicated ids \['t1'\]"),
        (scores_json({"t1": 0.5, "t2": 0.5, "t3": 0.5, "t4": 0.5}), r"expected 3 scores, got 4; unknown ids \['t4'\]"),
        ("I think they are all fine!", "no JSON object found"),
        (json.dumps({"scores": [{"id": "t1", "score": "high"}, {"id": "t2", "score": 0}, {"id": "t3", "score": 0}]}),
         "score of t1 is not a finite number"),
    ],
    ids=["missing", "duplicated", "extra", "garbage", "not-a-number"],
)
async def test_bad_answers_retry_then_succeed(judge_server, bad, problem):
    judge_server.script(bad, scores_json({"t1": 0.2, "t2": 0.4, "t3": 0.6}))
    scored = await judge_group(make_group(["a", "b", "c"]), config(judge_server))
    assert scored.rewards == [0.2, 0.4, 0.6]
    assert len(judge_server.chat_requests) == 2 and scored.metrics["judge_requests"] == 2


async def test_always_bad_answers_fail_with_the_reason(judge_server):
    judge_server.script(*[scores_json({"t1": 0.5, "t2": 0.5})] * 3)
    with pytest.raises(JudgeError, match=r"after 3 attempt\(s\): attempt 1: expected 3 scores, got 2; missing ids \['t3'\]"):
        await judge_group(make_group(["a", "b", "c"]), config(judge_server, on_failure="fail"))
    assert len(judge_server.chat_requests) == 3


async def test_keep_policy_keeps_rewards_and_marks_the_group(judge_server):
    judge_server.script("garbage", "more garbage")
    group = make_group(["a", "b"], rewards=[0.25, 0.75])
    kept = await judge_group(group, config(judge_server, max_attempts=2, on_failure="keep"))
    assert kept.rewards == [0.25, 0.75]
    assert metric(kept, "judge_failed") == [1, 1] and kept.metrics["judge_failed"] == 1
    assert metric(kept, "independent_reward") == [0.25, 0.75]
    assert metric(kept, "judge_score") == [None, None]
    assert "no JSON object found" in kept.logs[-1] and "judge failed" in kept.trajectories[0].logs[-1]


async def test_server_error_then_success(judge_server):
    judge_server.script(Reply(500, {"error": {"message": "overloaded"}}), Reply(503, {"error": {"message": "busy"}}),
                        scores_json({"t1": 0.1, "t2": 0.9}))
    scored = await judge_group(make_group(["a", "b"]), config(judge_server))
    assert scored.rewards == [0.1, 0.9] and len(judge_server.chat_requests) == 3


async def test_auth_error_is_not_retried(judge_server):
    judge_server.script(Reply(401, {"error": {"message": "bad key"}}), scores_json({"t1": 0.1, "t2": 0.9}))
    with pytest.raises(JudgeError, match="HTTP 401"):
        await judge_group(make_group(["a", "b"]), config(judge_server, on_failure="fail", use_json_schema=False))
    assert len(judge_server.chat_requests) == 1


async def test_json_schema_rejected_falls_back_to_plain_text_for_the_rest_of_the_call(judge_server):
    def strict_server(body):
        if "response_format" in body:
            return Reply(400, {"error": {"message": "response_format json_schema is not supported"}})
        return "garbage"

    judge_server.script(strict_server, strict_server, lambda body: Reply(400, {}) if "response_format" in body
                        else scores_json({"t1": 0.3, "t2": 0.6}))
    scored = await judge_group(make_group(["a", "b"]), config(judge_server))
    assert scored.rewards == [0.3, 0.6]
    formats = ["response_format" in r["json"] for r in judge_server.chat_requests]
    assert formats == [True, False, False]
    assert any("json_schema" in line for line in scored.logs)


@pytest.mark.parametrize("kind", ["memory", "folder"])
async def test_cache_second_scoring_makes_no_request(judge_server, tmp_path, kind):
    cache = InMemoryJudgeCache() if kind == "memory" else LocalFolderJudgeCache(tmp_path / "judge-cache")
    judge_server.script(scores_json({"t1": 0.8, "t2": 0.2}))
    first = await judge_group(make_group(["a", "b"]), config(judge_server), cache=cache)
    second = await judge_group(make_group(["a", "b"]), config(judge_server), cache=cache)
    assert len(judge_server.chat_requests) == 1  # counted at the server
    assert first.rewards == second.rewards == [0.8, 0.2]
    assert metric(first, "judge_cache_hit") == [0, 0] and metric(second, "judge_cache_hit") == [1, 1]
    assert second.metrics["judge_cache_hit"] == 1 and second.metrics["judge_requests"] == 0
    assert "reason t1" in second.trajectories[0].logs[-1] and len(cache) == 1
    # a different rubric, or a different group, is a different key: the judge is asked again
    judge_server.script(scores_json({"t1": 0.5, "t2": 0.5}), scores_json({"t1": 0.1, "t2": 0.2}))
    other = await judge_group(make_group(["a", "b"]), config(judge_server, rubric="Be terse."), cache=cache)
    changed = await judge_group(make_group(["a", "c"]), config(judge_server), cache=cache)
    assert other.rewards == [0.5, 0.5] and changed.rewards == [0.1, 0.2]
    assert len(judge_server.chat_requests) == 3 and len(cache) == 3


async def test_failed_judgment_is_not_cached(judge_server):
    cache = InMemoryJudgeCache()
    judge_server.script("garbage", scores_json({"t1": 1.0, "t2": 0.0}))
    failed = await judge_group(make_group(["a", "b"]), config(judge_server, max_attempts=1), cache=cache)
    assert failed.metrics["judge_failed"] == 1 and len(cache) == 0
    scored = await judge_group(make_group(["a", "b"]), config(judge_server, max_attempts=1), cache=cache)
    assert scored.rewards == [1.0, 0.0] and scored.metrics["judge_cache_hit"] == 0


async def test_reward_config_add_mode(judge_server):
    judge_server.script(scores_json({"t1": 0.5, "t2": 1.0}))
    scored = await judge_group(make_group(["a", "b"], rewards=[1.0, -1.0]), config(judge_server),
                               rewards=RewardConfig(mode="add", judge_weight=2.0))
    assert scored.rewards == [2.0, 1.0]


async def test_tool_calls_and_additional_histories_reach_the_judge(judge_server):
    def traj(result: str, sub_answer: str) -> Trajectory:
        return Trajectory(
            messages_and_choices=[
                {"role": "system", "content": "You add numbers with the add tool."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"b": 2, "a": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result},
                {"role": "assistant", "content": f"The answer is {result}."},
            ],
            tools=[ADD_TOOL],
            additional_histories=[History(messages_and_choices=[
                {"role": "user", "content": "Check the sum."}, {"role": "assistant", "content": sub_answer}])],
        )

    judge_server.script(scores_json({"t1": 1.0, "t2": 0.0}))
    group = TrajectoryGroup([traj("4", "verified"), traj("5", "looks wrong")], scenario_id="tools")
    scored = await judge_group(group, config(judge_server))
    assert scored.rewards == [1.0, 0.0]
    prompt = judge_server.chat_requests[0]["json"]["messages"][1]["content"]
    assert "<task>\nYou add numbers with the add tool.\n</task>" in prompt
    assert "- add(a: integer, b: integer): Add two integers." in prompt
    assert prompt.count('[assistant calls tool #call_1] add({"a":2,"b":2})') == 1  # in the shared context
    assert "[tool result add #call_1] 5" in prompt
    assert '<additional_history n="1">' in prompt and "[assistant] looks wrong" in prompt
    assert prompt.count("[user] 2+2?") == 1  # the shared prefix is sent once


async def test_ruler_score_group_is_art_compatible(judge_server):
    judge_server.script(scores_json({"t1": 0.25, "t2": 0.75}), "garbage", "garbage", "garbage")
    scored = await ruler_score_group(make_group(["a", "b"], rewards=[3.0, 4.0]), "judge-model",
                                     {"api_base": judge_server.base_url, "api_key": "sk-local-test"})
    assert scored.rewards == [0.25, 0.75]
    assert [t.metrics["ruler_score"] for t in scored.trajectories] == [0.25, 0.75]
    assert [t.metrics["independent_reward"] for t in scored.trajectories] == [3.0, 4.0]
    assert judge_server.chat_requests[0]["headers"]["authorization"] == "Bearer sk-local-test"
    cfg = JudgeConfig(backoff_s=0.0)
    assert await ruler_score_group(make_group(["a", "b"]), "judge-model", {"api_base": judge_server.base_url},
                                   swallow_exceptions=True, config=cfg) is None
    assert len(judge_server.chat_requests) == 4


async def test_key_and_url_come_from_the_environment(judge_server, monkeypatch):
    monkeypatch.setenv("TRAJFLOW_JUDGE_BASE_URL", judge_server.base_url)
    monkeypatch.setenv("TRAJFLOW_JUDGE_MODEL", "env-judge")
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-from-env-123")
    judge_server.script(scores_json({"t1": 0.5, "t2": 0.5}))
    scored = await judge_group(make_group(["a", "b"]), JudgeConfig(api_key_env="MY_JUDGE_KEY"))
    request = judge_server.chat_requests[0]
    assert request["headers"]["authorization"] == "Bearer sk-from-env-123" and request["json"]["model"] == "env-judge"
    assert "sk-from-env-123" not in json.dumps(scored.to_json_dict())


def test_config_refuses_secrets_and_bad_urls(monkeypatch):
    with pytest.raises(ValueError, match="NAME of an environment variable"):
        JudgeConfig(api_key_env="sk-abc123")
    with pytest.raises(ValueError, match="must not embed credentials"):
        JudgeConfig(base_url="https://user:secret@example.com/v1")
    with pytest.raises(ValueError, match="http"):
        JudgeConfig(base_url="example.com")
    monkeypatch.delenv("TRAJFLOW_JUDGE_MODEL", raising=False)
    with pytest.raises(JudgeError, match="no judge model"):
        JudgeConfig().resolved_model()


async def test_concurrent_groups_through_gather_after_each(judge_server):
    from agents.gather import gather_trajectory_groups
    from tests.fixtures_judge import answer_key_judge

    judge_server.script(*[answer_key_judge("4")] * 3)
    groups = [make_group(answers, scenario_id=f"g{i}") for i, answers in
              enumerate([["4", "5", "6"], ["7", "4"], ["3", "3", "4", "4"]])]
    cfg = JudgeConfig(model="judge-model", base_url=judge_server.base_url)
    scored = await gather_trajectory_groups(
        groups, pbar_desc=None, after_each=lambda g: ruler_score_group(g, config=cfg, swallow_exceptions=True))
    assert [g.rewards for g in scored] == [[1.0, 0.0, 0.0], [0.0, 1.0], [0.0, 0.0, 1.0, 1.0]]
    assert len(judge_server.chat_requests) == 3


async def test_failure_report_hides_credentials_even_when_the_server_echoes_them(judge_server, monkeypatch):
    monkeypatch.setenv("TRAJFLOW_JUDGE_BASE_URL", judge_server.base_url.replace("http://", "http://user:pw-secret-99@"))
    monkeypatch.setenv("TRAJFLOW_JUDGE_API_KEY", "sk-echoed-secret-42")
    judge_server.script(lambda body: Reply(401, {"error": {"message": "bad key sk-echoed-secret-42 for user:pw-secret-99"}}))
    kept = await judge_group(make_group(["a", "b"]), JudgeConfig(model="m", max_attempts=3))
    assert kept.metrics["judge_failed"] == 1 and len(judge_server.chat_requests) == 1
    assert judge_server.base_url in kept.logs[-1] and "401 - bad key [redacted] for user:[redacted]" in kept.logs[-1]
    dumped = json.dumps(kept.to_json_dict())
    assert "pw-secret-99" not in dumped and "sk-echoed-secret-42" not in dumped


async def test_callers_client_is_used_with_our_retry_policy(judge_server):
    import openai

    client = openai.AsyncOpenAI(base_url=judge_server.base_url, api_key="sk-caller", max_retries=5)
    judge_server.script(*[Reply(500, {"error": {"message": "down"}})] * 6)
    kept = await judge_group(make_group(["a", "b"]), config(judge_server, max_attempts=2), client=client)
    assert kept.metrics["judge_failed"] == 1 and len(judge_server.chat_requests) == 2  # not 2 x 6 client retries
    assert judge_server.chat_requests[0]["headers"]["authorization"] == "Bearer sk-caller"
    judge_server.reset()
    judge_server.script(scores_json({"t1": 0.0, "t2": 1.0}))
    assert (await judge_group(make_group(["a", "b"]), config(judge_server), client=client)).rewards == [0.0, 1.0]
    await client.close()  # the caller's client stays open until the caller closes it
