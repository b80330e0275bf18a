"""The scripted experts are right: each expert conversation, scored again by the agent's own reward from the stored
messages, is a full-reward research episode or a tic-tac-toe game that is never lost; the conversations have the
agent's real shape (its prompts, tool schemas and the results of its real tools); the experts refuse what is not
theirs to play (val/test questions, prompts that are not a game)."""

from __future__ import annotations

import json

import pytest

from agents.examples.demonstrations import EXPERTS, DemoError, demonstrations, score
from agents.examples.research import NUDGE, SYSTEM_PROMPT, TOOL_SCHEMAS, ResearchAgent
from agents.examples.research_expert import ResearchExpert
from agents.examples.scripted_policy import ExpertError, ScriptedPolicy
from agents.examples.tictactoe import TicTacToeAgent, cell_name, turn_prompt, winner
from agents.examples.tictactoe_expert import TicTacToeExpert, read_prompt
from agents.group_metrics import summarize
from agents.trajectory import TrajectoryGroup


@pytest.fixture(scope="module")
def research_lines():
    return demonstrations("research")  # every train question


def test_research_expert_gets_full_reward_on_every_train_question(research_lines):
    agent = ResearchAgent()
    train = {s.id: s for s in agent.scenarios("train", 0)}
    assert len(research_lines) == len(train) > 600
    for line in research_lines:
        scenario = train[line["metadata"]["scenario_id"]]
        assert score(agent, scenario, line) == 1.0 == line["metadata"]["reward"], scenario.id
        episode = agent.replay(line["messages"])
        assert (episode.tool_calls, episode.format_errors, episode.answer_doc) == (3, 0, scenario.payload["doc_id"])


def test_research_demonstrations_have_the_agents_shape_and_real_tool_results(research_lines):
    agent = ResearchAgent()
    corpus, box = agent.corpus, agent.toolbox()
    questions = {s.id: s.payload for s in agent.scenarios("train", 0)}
    for line in research_lines[::23]:
        m, payload = line["messages"], questions[line["metadata"]["scenario_id"]]
        assert line["tools"] == TOOL_SCHEMAS
        assert m[:2] == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": payload["question"]}]
        assert [x["role"] for x in m[2:]] == ["assistant", "tool"] * 3 and NUDGE not in json.dumps(m)
        calls = [box.calls(x) for x in m[2::2]]
        assert [len(c) for c in calls] == [1, 1, 1] and all(x["content"] is None for x in m[2::2])  # one call a turn
        (search,), (read,), (answer,) = calls
        assert (search.name, read.name, answer.name) == ("search", "read", "answer")
        assert search.arguments["query"] in payload["question"]  # the entity's name, copied from the question
        assert json.loads(m[3]["content"]) == corpus.search(search.arguments["query"], agent.settings.search_k)
        doc = corpus.read(payload["doc_id"])
        assert read.arguments == {"doc_id": doc.id} and m[5]["content"] == f"{doc.title}\n{doc.text}"
        assert answer.arguments == {"text": payload["answer"], "doc_id": doc.id}
        assert [x["tool_call_id"] for x in m[3::2]] == [c[0].id for c in calls]


async def test_research_expert_refuses_questions_it_was_not_given():
    agent = ResearchAgent()
    expert = ResearchExpert(agent, agent.scenarios("train", 0))
    val = agent.scenarios("val", 0)[0]
    with pytest.raises(ExpertError, match="does not know the question"):
        await agent.rollout(ScriptedPolicy(expert.act), "expert", val)


@pytest.mark.parametrize("split", ["val", "test"])
def test_no_demonstrations_of_val_or_test(split):
    for name in EXPERTS:
        with pytest.raises(DemoError, match="train split only"):
            demonstrations(name, split=split, count=1)


def _never_loses(expert: TicTacToeExpert, board: str, to_move: str, mark: str, seen: dict) -> None:
    """Every line of play from `board`: the expert's move on its turns, every empty cell on the opponent's."""
    if board in seen or winner(list(board)) or "." not in board:
        assert winner(list(board)) in (None, mark), board
        return
    seen[board] = True
    other = "O" if to_move == "X" else "X"
    if to_move == mark:
        cell = expert.move(board, mark)
        assert board[cell] == "."
        _never_loses(expert, board[:cell] + mark + board[cell + 1:], other, mark, seen)
    else:
        for cell in (i for i, v in enumerate(board) if v == "."):
            _never_loses(expert, board[:cell] + to_move + board[cell + 1:], other, mark, seen)


@pytest.mark.parametrize("mark", ["X", "O"])
def test_tictactoe_expert_never_loses_against_any_opponent(mark):
    seen: dict = {}
    _never_loses(TicTacToeExpert(seed=3), "." * 9, "X", mark, seen)
    assert len(seen) > 100  # the whole game tree of the opponent's choices


def test_tictactoe_expert_games_are_never_lost_or_illegal():
    agent = TicTacToeAgent()
    lines = demonstrations("tictactoe")
    train = {s.id: s for s in agent.scenarios("train", 0)}
    assert len(lines) == len(train) == agent.settings.n_train
    outcomes = []
    for line in lines:
        scenario = train[line["metadata"]["scenario_id"]]
        game = agent.replay(scenario, line["messages"])
        outcomes.append(game.outcome)
        assert game.outcome in ("win", "draw") and score(agent, scenario, line) == line["metadata"]["reward"]
        assert "tools" not in line and line["messages"][:5] == agent.prefix()
        played = [m["content"] for m in line["messages"][5:] if m["role"] == "assistant"]
        assert len(played) == game.model_moves  # every reply a legal move, none after the end
    assert outcomes.count("win") > len(lines) / 2  # it punishes the opponent's random moves


async def test_tictactoe_expert_holds_a_perfect_opponent_to_a_draw():
    agent = TicTacToeAgent(opponent_skill=1.0)
    policy = ScriptedPolicy(TicTacToeExpert(seed=0).act)
    trajs = [await agent.rollout(policy, "expert", s) for s in agent.scenarios("train", 0)[:24]]
    assert {t.metadata["outcome"] for t in trajs} <= {"win", "draw"}
    assert all(t.metrics["illegal"] == 0 for t in trajs)


def test_tictactoe_expert_reads_the_agents_prompt():
    board = list("X.O.X....")
    assert read_prompt(turn_prompt(board, "O", 4)) == ("X.O.X....", "O")
    assert TicTacToeExpert().act([{"role": "user", "content": turn_prompt(board, "O", 4)}]) == {
        "content": f"<move>{cell_name(8)}</move>"}  # blocks the diagonal
    with pytest.raises(ExpertError, match="not a tic-tac-toe turn prompt"):
        read_prompt("What is 2 + 2?")


async def test_group_metrics_ratios_over_expert_and_broken_episodes():
    """tool_call_validity and illegal_move_rate are ratios of sums over the group, not means of ratios."""
    agent = ResearchAgent()
    expert = ResearchExpert(agent, agent.scenarios("train", 0))
    broken = ScriptedPolicy(lambda messages, tools: {"content": '<tool_call>{"name": "read", "arguments": '
                                                     '{"doc_id": 7}}</tool_call>'})
    s = agent.scenarios("train", 0)[0]
    good = await agent.rollout(ScriptedPolicy(expert.act), "expert", s)
    bad = await agent.rollout(broken, "broken", s)
    assert (good.metrics["tool_calls"], good.metrics["valid_tool_calls"]) == (3, 3)
    assert (bad.metrics["tool_calls"], bad.metrics["valid_tool_calls"]) == (6, 0)
    out = summarize([TrajectoryGroup([good, bad], scenario_id=s.id)], "val")
    assert out["val/tool_call_validity"] == 3 / 9 and out["val/tool_calls"] == 4.5
    assert "val/illegal_move_rate" not in out

    ttt = TicTacToeAgent()
    game = next(x for x in ttt.scenarios("train", 0) if x.payload["model_mark"] == "X")
    won = await ttt.rollout(ScriptedPolicy(TicTacToeExpert().act), "expert", game)
    lost = await ttt.rollout(ScriptedPolicy(lambda messages, tools: {"content": "<move>A1</move>"}), "a1", game)
    assert (lost.metrics["turns"], lost.metrics["illegal"]) == (2, 1)
    out = summarize([TrajectoryGroup([won, lost], scenario_id=game.id)], "val")
    assert out["val/illegal_move_rate"] == 1 / (won.metrics["turns"] + 2) and out["val/illegal"] == 0.5
