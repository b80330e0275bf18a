"""Tic-tac-toe agent: scenarios, the scripted opponent, rewards replayed from hand-written games, HTTP rollouts."""

from __future__ import annotations

import functools
import re

import pydantic
import pytest

from agents import Trajectory
from agents.examples.tictactoe import LINES, Game, TicTacToeAgent, cell_name, opponent_move, parse_move, winner
from agents.registry import get_agent


@pytest.fixture
def agent() -> TicTacToeAgent:
    return TicTacToeAgent()


@functools.lru_cache(maxsize=None)
def _value(board: str, to_move: str, me: str) -> int:
    """Minimax value of `board` for `me` (+1 win, 0 draw, -1 loss)."""
    w = winner(list(board))
    if w:
        return 1 if w == me else -1
    if "." not in board:
        return 0
    nxt = "O" if to_move == "X" else "X"
    vals = [_value(board[:i] + to_move + board[i + 1:], nxt, me) for i, c in enumerate(board) if c == "."]
    return max(vals) if to_move == me else min(vals)


def best_move(board: list[str], me: str) -> int:
    other = "O" if me == "X" else "X"
    b = "".join(board)
    return max((i for i, c in enumerate(b) if c == "."), key=lambda i: (_value(b[:i] + me + b[i + 1:], other, me), -i))


def first_empty(board: list[str], me: str) -> int:
    return board.index(".")


def play_messages(agent, scenario, strategy) -> tuple[list[dict], Game]:
    """A hand-written conversation: the strategy's moves as assistant replies, built on a live Game."""
    game = agent.new_game(scenario)
    msgs = agent.prefix()
    while game.outcome is None:
        msgs.append({"role": "user", "content": game.prompt()})
        reply = f"<move>{cell_name(strategy(game.board, game.model_mark))}</move>"
        msgs.append({"role": "assistant", "content": reply})
        game.play(reply)
    return msgs, game


def test_scenarios_deterministic_and_split_separated(agent):
    val = agent.scenarios("val", seed=0)
    assert [s.model_dump() for s in val] == [s.model_dump() for s in TicTacToeAgent().scenarios("val", seed=0)]
    assert [s.id for s in agent.scenarios("val", seed=1)] != [s.id for s in val]
    splits = {sp: agent.scenarios(sp, seed=0) for sp in ("train", "val", "test")}
    assert [len(v) for v in splits.values()] == [256, 64, 64]
    ids = [s.id for v in splits.values() for s in v]
    seeds = [s.payload["seed"] for v in splits.values() for s in v]
    assert len(set(ids)) == len(ids) and len(set(seeds)) == len(seeds)
    assert {s.payload["model_mark"] for s in val} == {"X", "O"}
    assert {s.payload["model_mark"] for s in get_agent("tictactoe", model_plays="O").scenarios("val", 0)} == {"O"}


@pytest.mark.parametrize("text, cell", [
    ("<move>A1</move>", 0), ("<move>c3</move>", 8), ("I'll take the centre: <move> B2 </move>", 4),
    ("<MOVE>b1</MOVE> <move>C3</move>", 1), ("<move>D1</move>", None), ("<move>B4</move>", None),
    ("<move>2B</move>", None), ("B2", None), ("<move>B2", None), ("", None), (None, None),
])
def test_parse_move(text, cell):
    assert parse_move(text) == cell


def test_opponent_is_deterministic_and_sensible():
    board = list("XX.OO....")
    assert opponent_move(board, "O", seed=5, skill=1.0) == 5          # takes its win
    assert opponent_move(list("XX.O....."), "O", seed=5, skill=1.0) == 2  # blocks X
    assert opponent_move(list("X........"), "O", seed=5, skill=1.0) == 4  # centre
    moves = {opponent_move(list("X........"), "O", seed=s, skill=0.0) for s in range(50)}
    assert moves == set(range(1, 9))                                    # random player: any empty cell
    assert all(opponent_move(list("X...O...."), "X", s, 0.5) == opponent_move(list("X...O...."), "X", s, 0.5)
               for s in range(20))


def _find(agent, strategy, outcome, mark):
    for s in agent.scenarios("train", seed=0):
        if s.payload["model_mark"] != mark:
            continue
        msgs, game = play_messages(agent, s, strategy)
        if game.outcome == outcome:
            return s, msgs, game
    raise AssertionError(f"no {outcome} for {mark} found")


@pytest.mark.parametrize("skill, strategy, outcome, mark, reward", [
    (0.0, best_move, "win", "X", 1.0),
    (1.0, best_move, "draw", "O", 0.5),
    (1.0, first_empty, "loss", "X", 0.0),
])
def test_reward_replays_hand_written_games(skill, strategy, outcome, mark, reward):
    agent = TicTacToeAgent(opponent_skill=skill)
    scenario, msgs, game = _find(agent, strategy, outcome, mark)
    assert agent.reward(scenario, Trajectory(messages_and_choices=msgs)) == reward
    final = game.board
    if outcome == "draw":
        assert "." not in final and winner(final) is None
    else:
        expected = mark if outcome == "win" else ("O" if mark == "X" else "X")
        assert any(all(final[i] == expected for i in line) for line in LINES)


def test_illegal_and_unparseable_moves_lose_with_penalty(agent):
    scenario = next(s for s in agent.scenarios("val", 0) if s.payload["model_mark"] == "X")
    base = agent.prefix() + [{"role": "user", "content": "board"}]
    game = agent.new_game(scenario)
    game.play("<move>A1</move>")
    taken = next(i for i, v in enumerate(game.board) if v == "O")
    occupied = base + [{"role": "assistant", "content": "<move>A1</move>"}, {"role": "user", "content": "board"},
                       {"role": "assistant", "content": f"<move>{cell_name(taken)}</move>"}]
    replay = agent.replay(scenario, occupied)
    assert (replay.outcome, replay.detail) == ("illegal", f"occupied {cell_name(taken)}")
    assert agent.reward(scenario, Trajectory(messages_and_choices=occupied)) == -1.0
    for garbage in ("I move to the middle", "<move>Z9</move>", ""):
        traj = Trajectory(messages_and_choices=base + [{"role": "assistant", "content": garbage}])
        assert agent.reward(scenario, traj) == -1.0
    tool_call = {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "move", "arguments": "{}"}}]}
    assert agent.reward(scenario, Trajectory(messages_and_choices=base + [tool_call])) == -1.0
    custom = TicTacToeAgent(illegal_reward=-2.0)
    assert custom.reward(scenario, Trajectory(messages_and_choices=base + [{"role": "assistant", "content": "x"}])) == -2
    with pytest.raises(pydantic.ValidationError, match="opponent_skill"):
        TicTacToeAgent(opponent_skill=1.5)


def _board_of(prompt: str) -> tuple[list[str], str]:
    rows = re.findall(r"^([123])  ([XO.]) ([XO.]) ([XO.])$", prompt, re.M)
    mark = re.search(r"You are ([XO])", prompt).group(1)
    return [c for _, *cells in rows for c in cells], mark


async def test_rollout_plays_a_full_game_over_http(scripted_server, scripted_client):
    agent = TicTacToeAgent(opponent_skill=1.0)

    def responder(body):
        board, mark = _board_of(body["messages"][-1]["content"])
        return f"Let me think. <move>{cell_name(best_move(board, mark))}</move>"

    scripted_server.responder = responder
    scenario = next(s for s in agent.scenarios("val", 0) if s.payload["model_mark"] == "O")
    traj = await agent.rollout(scripted_client, "agent@1", scenario)
    assert traj.metadata["outcome"] == "draw" and traj.reward == 0.5 == agent.reward(scenario, traj)
    assert traj.metrics["drawn"] == 1 and traj.metrics["illegal"] == 0 and traj.metrics["model_moves"] == 4
    assert traj.metrics["turns"] == len(scripted_server.requests) == 4
    for earlier, later in zip(scripted_server.requests, scripted_server.requests[1:]):
        assert later["messages"][: len(earlier["messages"])] == earlier["messages"]  # each prompt extends the last
    assert all(t.trainable for t in traj.sampled_turns())
    assert "opponent played" in scripted_server.requests[0]["messages"][-1]["content"]  # O: the opponent opened
    assert scripted_server.requests[0]["messages"][:5] == agent.prefix()


def test_worked_examples_are_not_replayed_as_moves():
    plain, shots = TicTacToeAgent(few_shot=False), TicTacToeAgent()
    scenario = next(s for s in shots.scenarios("val", 0) if s.payload["model_mark"] == "X")
    assert len(plain.prefix()) == 1 and len(shots.prefix()) == 5
    assert shots.replay(scenario, shots.prefix()).outcome == "unfinished"      # B2, C3 in the examples
    assert "B2" in shots.prefix()[2]["content"] and "O . ." in shots.prefix()[3]["content"]


async def test_rollout_illegal_reply_ends_game(agent, scripted_server, scripted_client):
    scripted_server.replies = ["<move>B2</move>", "<move>B2</move>"]
    scenario = next(s for s in agent.scenarios("val", 0) if s.payload["model_mark"] == "X")
    traj = await agent.rollout(scripted_client, "agent@1", scenario)
    assert traj.reward == -1.0 and traj.metrics["illegal_move"] == 1 and traj.metrics["unparseable"] == 0
    assert traj.metrics["turns"] == 2 and "illegal (occupied B2)" in traj.logs[-1]
    scripted_server.replies = ["\ufffd\x00 nonsense"]
    traj = await agent.rollout(scripted_client, "agent@1", scenario)
    assert traj.reward == -1.0 and traj.metrics["unparseable"] == 1 and traj.metrics["turns"] == 1


async def test_rollout_on_embedded_tiny_random_server(agent, tiny_server):
    from agents.client import policy_client
    from tests.fixtures_server import API_KEY

    client = policy_client(tiny_server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        for s in agent.scenarios("val", seed=0)[:2]:
            traj = await agent.rollout(client, "tiny-random", s)
            assert traj.reward in (-1.0, 0.0, 0.5, 1.0) and traj.reward == agent.reward(s, traj)
            assert traj.metrics["turns"] >= 1 and traj.error is None
    finally:
        await client.close()
