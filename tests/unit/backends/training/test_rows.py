"""Rows from exact tokens: merge when the next prompt extends the row, split otherwise, masks exact."""

import math

import pytest

from agents.trajectory import History, SampledTurn, Trajectory, TrajectoryGroup
from backends.training.advantages import group_advantages
from backends.training.token_rows import build_rows, history_rows
from tests.fixtures_trainer import synthetic_group, synthetic_turn


def _rows(groups, **kw):
    kw.setdefault("max_row_tokens", 4096)
    return build_rows(groups, **kw)


def test_tool_conversation_rows_are_exact(tool_conversation):
    traj = tool_conversation["trajectory"]
    t1, t2, t3 = tool_conversation["turns"]
    p1, p2, p3 = tool_conversation["prompts"]
    # the template renders the tool call exactly as the forced sampled tokens: turn 2 extends turn 1
    assert t1.token_ids == tool_conversation["tool_call_ids"]
    assert p2[: len(p1) + len(t1.token_ids)] == p1 + t1.token_ids
    rows, untrainable = history_rows(traj.messages_and_choices, "t")
    assert untrainable == 0
    assert len(rows) == 2  # turns 1+2 merged; turn 3 (fresh prompt) starts its own row
    first, second = rows
    assert first.token_ids == p2 + t2.token_ids
    assert second.token_ids == p3 + t3.token_ids
    expected_mask = ([False] * len(p1) + [True] * len(t1.token_ids)
                     + [False] * (len(p2) - len(p1) - len(t1.token_ids)) + [True] * len(t2.token_ids))
    assert first.loss_mask == expected_mask
    assert second.loss_mask == [False] * len(p3) + [True] * len(t3.token_ids)
    # behaviour logprobs sit exactly on the sampled tokens, in order
    trained = [lp for lp, m in zip(first.sampler_logprobs, first.loss_mask) if m]
    assert trained == t1.logprobs + t2.logprobs
    assert all(lp == 0.0 for lp, m in zip(first.sampler_logprobs, first.loss_mask) if not m)
    # the masked stretch between the turns is exactly the tool result + next-turn template
    gap = first.token_ids[len(p1) + len(t1.token_ids): len(p2)]
    assert gap == p2[len(p1) + len(t1.token_ids):]


def test_merge_and_split_rules():
    a = synthetic_turn([1, 2], [3, 4])
    extends = synthetic_turn([1, 2, 3, 4, 9, 9], [5])
    diverges = synthetic_turn([1, 2, 3, 7, 9, 9], [6])  # rewrote history: token 4 -> 7
    shorter = synthetic_turn([1, 2, 3], [8])  # prompt shorter than the row: cannot extend
    rows, _ = history_rows([a, extends], "h")
    assert [r.token_ids for r in rows] == [[1, 2, 3, 4, 9, 9, 5]]
    assert rows[0].loss_mask == [False, False, True, True, False, False, True]
    rows, _ = history_rows([a, diverges], "h")
    assert [r.token_ids for r in rows] == [[1, 2, 3, 4], [1, 2, 3, 7, 9, 9, 6]]
    rows, _ = history_rows([a, shorter], "h")
    assert [r.token_ids for r in rows] == [[1, 2, 3, 4], [1, 2, 3, 8]]
    # a split row does not block a later turn that extends the newest row
    rows, _ = history_rows([a, diverges, synthetic_turn([1, 2, 3, 7, 9, 9, 6, 0], [2])], "h")
    assert [len(r) for r in rows] == [4, 9]


def test_untrainable_turns_are_counted_and_stay_as_context():
    a = synthetic_turn([1, 2], [3])
    no_logprobs = SampledTurn(message={"role": "assistant", "content": "x"}, prompt_token_ids=[1, 2, 3, 4],
                              token_ids=[5], logprobs=[])
    b = synthetic_turn([1, 2, 3, 4, 5, 6], [7])
    rows, untrainable = history_rows([a, no_logprobs, b], "h")
    assert untrainable == 1
    assert rows[0].token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert rows[0].loss_mask == [False, False, True, False, False, False, True]


def test_advantages_centre_and_scale():
    assert group_advantages([1.0, 1.0, 1.0]) is None
    assert group_advantages([2.0]) is None
    assert group_advantages([0.0, 1.0], scale=False) == [-0.5, 0.5]
    scaled = group_advantages([0.0, 1.0, 2.0, 3.0])
    std = math.sqrt((1.5**2 + 0.5**2) * 2 / 4)
    assert scaled == pytest.approx([-1.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6), 1.5 / (std + 1e-6)])


def test_build_rows_skips_equal_groups_errors_and_counts():
    equal = synthetic_group([1.0, 1.0, 1.0], scenario_id="eq")
    mixed = synthetic_group([0.0, 1.0, 0.5], scenario_id="mix")
    mixed.trajectories[2].error = "tool crashed"
    rows, stats = _rows([equal, mixed])
    assert stats.skipped_groups == 1 and stats.errored_trajectories == 1
    assert stats.trajectories == 2 and stats.rows == 2
    assert [r.advantage for r in rows] == pytest.approx([-1.0 / (0.5 + 1e-6) * 0.5, 0.5 / (0.5 + 1e-6)])
    assert [r.trajectory for r in rows] == [0, 1]
    assert "mix" in rows[0].source and "trajectory 0" in rows[0].source


def test_zero_advantage_trajectory_is_left_out():
    rows, stats = _rows([synthetic_group([0.0, 1.0, 0.5], scenario_id="z")])
    assert stats.zero_advantage_trajectories == 1
    assert len(rows) == 2


def test_additional_histories_share_the_advantage():
    group = synthetic_group([0.0, 1.0])
    group.trajectories[1].additional_histories.append(
        History(messages_and_choices=[synthetic_turn([40, 41], [42, 43])]))
    rows, stats = _rows([group])
    assert stats.rows == 3 and stats.trajectories == 2
    side = [r for r in rows if "additional history 0" in r.source]
    assert len(side) == 1 and side[0].token_ids == [40, 41, 42, 43]
    assert side[0].advantage == rows[1].advantage > 0
    assert side[0].trajectory == rows[1].trajectory


def test_overlong_rows_drop_or_truncate():
    group = TrajectoryGroup([
        Trajectory(messages_and_choices=[synthetic_turn([1, 2, 3], [4, 5, 6, 7])], reward=0.0),
        Trajectory(messages_and_choices=[synthetic_turn([1, 2, 3, 4, 5, 6], [7, 8])], reward=1.0),
        Trajectory(messages_and_choices=[synthetic_turn([1], [2])], reward=3.0),
    ])
    rows, stats = _rows([group], max_row_tokens=5, overlong="drop")
    assert stats.dropped_rows == 2 and stats.truncated_rows == 0 and len(rows) == 1
    rows, stats = _rows([group], max_row_tokens=5, overlong="truncate")
    # first row keeps 2 sampled tokens; the second keeps none after the cut and is dropped
    assert stats.truncated_rows == 1 and stats.dropped_rows == 1
    assert rows[0].token_ids == [1, 2, 3, 4, 5] and rows[0].loss_mask == [False, False, False, True, True]


def test_bad_numbers_name_the_trajectory():
    group = synthetic_group([0.0, 1.0], scenario_id="nanland")
    turn = group.trajectories[1].sampled_turns()[0]
    turn.logprobs[1] = float("nan")
    with pytest.raises(ValueError, match=r"scenario nanland\), trajectory 1.*logprob of sampled token 1 is nan"):
        _rows([group])
    group = synthetic_group([0.0, 1.0], scenario_id="r")
    object.__setattr__(group.trajectories[0], "reward", float("inf"))  # bypass validation like a corrupt file
    with pytest.raises(ValueError, match=r"trajectory 0: reward is inf"):
        _rows([group])
    with pytest.raises(ValueError, match="reward must be a finite number"):
        Trajectory(reward=float("nan"))
