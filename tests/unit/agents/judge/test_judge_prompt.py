"""Judge prompt rendering, answer parsing and the cache key (pure functions, no server)."""

import os
import subprocess
import sys

import pytest

from agents import History, SampledTurn, Trajectory, TrajectoryGroup
from agents.judge.cache import LocalFolderJudgeCache, cache_key
from agents.judge.parse import JudgeParseError, extract_json, parse_scores
from agents.judge.prompt import DEFAULT_RUBRIC, build_judge_messages, shared_prefix_length
from tests.fixtures_judge import ADD_TOOL, SYSTEM_PROMPT, make_group
from tests.paths import REPO

IDS = ["t1", "t2", "t3"]


def test_parse_tolerates_think_blocks_bare_lists_and_numeric_ids():
    text = '<think>{"scores": "not this"}</think> Sure: [{"id": 3, "score": 0.1}, {"id": "2", "score": 1}, {"id": "T1", "score": 0}] ok'
    scores = parse_scores(text, IDS)
    assert {k: v.score for k, v in scores.items()} == {"t1": 0.0, "t2": 1.0, "t3": 0.1}


def test_parse_prefers_the_object_with_scores_after_prose_braces():
    text = 'Note {this is not json}. {"meta": 1} Then {"scores": [{"id": "t1", "score": 0.5, "explanation": "fine"}]} end'
    assert parse_scores(text, ["t1"])["t1"].explanation == "fine"


@pytest.mark.parametrize("text, problem", [
    ("", "empty"),
    ('{"results": []}', "no 'scores' list"),
    ('{"scores": {"t1": 1}}', "must be a list"),
    ('{"scores": [{"id": "t1", "score": NaN}, {"id": "t2", "score": 1}, {"id": "t3", "score": 1}]}', "score of t1 is not a finite number"),
    ('{"scores": [{"id": "t1", "score": true}, {"id": "t2", "score": 1}, {"id": "t3", "score": 1}]}', "score of t1"),
    ('{"scores": [1, {"id": "t2", "score": 1}, {"id": "t3", "score": 1}]}', "entry 0 is not an object"),
])
def test_parse_errors_name_the_problem(text, problem):
    with pytest.raises(JudgeParseError, match=problem):
        parse_scores(text, IDS)


def test_extract_json_from_fence_without_language():
    assert extract_json('```\n{"scores": []}\n```') == {"scores": []}


def test_identical_trajectories_each_keep_their_answer():
    group = make_group(["4", "4", "4"])
    messages, ids = build_judge_messages(group, DEFAULT_RUBRIC)
    prompt = messages[1]["content"]
    assert ids == IDS
    assert prompt.count("[assistant] 4") == 3 and prompt.count("[user] What is 2 + 2?") == 1
    assert f"<task>\n{SYSTEM_PROMPT}\n</task>" in prompt and prompt.count(SYSTEM_PROMPT) == 1
    same = build_judge_messages(group, DEFAULT_RUBRIC, task_description=SYSTEM_PROMPT)[0][1]["content"]
    assert same == prompt  # the agent's system prompt passed as the task is not repeated either
    assert shared_prefix_length([[{"a": 1}], [{"a": 1}]]) == 0  # one-message conversations share nothing


def test_diverging_system_prompts_and_explicit_task():
    a = Trajectory(messages_and_choices=[{"role": "system", "content": "Prompt A"}, {"role": "user", "content": "q"}])
    b = Trajectory(messages_and_choices=[{"role": "system", "content": "Prompt B"}, {"role": "user", "content": "q"}])
    prompt = build_judge_messages(TrajectoryGroup([a, b]), "r")[0][1]["content"]
    assert "<task>\nPrompt A\n</task>" in prompt and "[system] Prompt B" in prompt and "<shared_context>" not in prompt
    prompt = build_judge_messages(TrajectoryGroup([a, b]), "r", task_description="Answer q.")[0][1]["content"]
    assert "<task>\nAnswer q.\n</task>" in prompt and "[system] Prompt A" in prompt


def test_token_ids_and_logprobs_never_enter_the_prompt():
    turn = SampledTurn(message={"role": "assistant", "content": "4"}, prompt_token_ids=[101, 102],
                       token_ids=[987654], logprobs=[-0.123456])
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"}, turn], tools=[ADD_TOOL])
    prompt = build_judge_messages(TrajectoryGroup([traj]), DEFAULT_RUBRIC)[0][1]["content"]
    assert "[assistant] 4" in prompt and "987654" not in prompt and "0.123456" not in prompt


def test_cache_key_ignores_dict_order_rewards_and_tokens_but_not_content():
    base = make_group(["4", "5"], rewards=[0.0, 1.0])
    key = cache_key("m", "r", base)
    reordered = TrajectoryGroup([
        Trajectory(messages_and_choices=[{"content": m["content"], "role": m["role"]} for m in t.messages()], reward=9.0)
        for t in base.trajectories
    ])
    assert cache_key("m", "r", reordered) == key
    sampled = make_group(["4", "5"])
    for t in sampled.trajectories:
        t.messages_and_choices[-1] = SampledTurn(message=t.messages_and_choices[-1], token_ids=[1, 2], logprobs=[-0.1, -0.2])
    assert cache_key("m", "r", sampled) == key
    assert cache_key("m2", "r", base) != key and cache_key("m", "r2", base) != key
    assert cache_key("m", "r", make_group(["5", "4"])) != key  # order of trajectories matters: scores are per index
    assert cache_key("m", "r", base, task_description="t") != key
    with_history = make_group(["4", "5"])
    with_history.trajectories[0].additional_histories = [History(messages_and_choices=[{"role": "user", "content": "x"}])]
    assert cache_key("m", "r", with_history) != key
    with_tools = make_group(["4", "5"])
    with_tools.trajectories[1].tools = [ADD_TOOL]
    assert cache_key("m", "r", with_tools) != key


def test_cache_key_is_the_same_in_another_process_with_another_hash_seed():
    code = ("import json,sys; sys.path.insert(0, '.'); from tests.fixtures_judge import make_group; "
            "from agents.judge.cache import cache_key; print(cache_key('m', 'r', make_group(['4', '5'])))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=REPO)
    assert out.stdout.strip() == cache_key("m", "r", make_group(["4", "5"]))


def test_folder_cache_refuses_path_keys_and_survives_corrupt_entries(tmp_path):
    cache = LocalFolderJudgeCache(tmp_path)
    with pytest.raises(ValueError, match="sha256"):
        cache.put("../../etc/passwd", {"scores": {}})
    key = "a" * 64
    cache.put(key, {"scores": {"t1": {"score": 1.0}}})
    assert cache.get(key) == {"scores": {"t1": {"score": 1.0}}}
    (tmp_path / f"{key}.json").write_text("{not json")
    assert cache.get(key) is None
    assert [p.name for p in tmp_path.iterdir()] == [f"{key}.json"]  # no temp files left behind
    assert cache.get("b" * 64) is None
