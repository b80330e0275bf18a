"""Tic-tac-toe against a scripted opponent: a multi-turn agent whose moves are text.

Each model turn gets the board as text and must answer ``<move>B2</move>`` (column A-C, row 1-3,
case-insensitive; the first ``<move>`` tag of the reply counts, prose around it is allowed). X moves
first; a scenario says whether the model plays X or O. The conversation keeps every turn (so each
prompt extends the previous one token for token and the trainer can concatenate the turns). With
``few_shot`` (default) two worked turns precede the game as earlier user/assistant messages.

Opponent: deterministic per scenario. Before each of its moves it draws from
``random.Random(f"{seed}:{board}")``: with probability ``opponent_skill`` it plays the heuristic move
(win if it can, else block the model's win, else the centre, else a corner, else any cell; ties broken
by the draw), otherwise a uniformly random empty cell. The same scenario and the same model moves
always give the same game, which is what lets :meth:`TicTacToeAgent.reward` replay a stored trajectory.

Reward (defaults, all configurable)::

    win 1.0   draw 0.5   loss 0.0   illegal -1.0

"illegal" ends the game at once: a reply without a parseable ``<move>`` (metric ``unparseable``), or a
move onto an occupied cell (metric ``illegal_move``; both count in ``illegal``). Per game the metrics are
``won``/``drawn``/``lost``/``illegal`` (one of them 1; an unfinished game has none) and ``turns`` (replies); over many
games the illegal-move rate is sum(illegal) / sum(turns), illegal replies per reply (``illegal_move_rate`` in
:func:`agents.group_metrics.summarize`), beside the mean of ``illegal``, the share of games lost that way.

Baseline (SmolLM2-135M-Instruct, 64 val games, embedded server; ``benchmarks/results/agent_baselines.md``):
greedy mean reward -0.94 (1.6% won, 3% lost, 95% illegal: it repeats the example's C3), sampled at
temperature 1 -0.98 (98% illegal, 0.16 legal moves per game). Without the worked examples it never
wrote a ``<move>`` tag (reward -1.0 for every game). The 135M model barely plays; this agent is here to
exercise the multi-turn path and for larger models.

Scenarios: ``n_train``/``n_val``/``n_test`` games per split, ids ``ttt-<split>-<i>``, seeds hashed from the
split and index (so the splits never share a game); the model plays X in even and O in odd games
unless ``model_plays`` fixes it.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from openai import AsyncOpenAI
from pydantic import BaseModel, ConfigDict, Field

from agents.agent import ConfiguredAgent
from agents.examples.turn_sampling import ContextExhausted, ordered, sample_turn
from agents.scenario import Scenario, Split
from agents.trajectory import Trajectory

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
CORNERS = (0, 2, 6, 8)
_MOVE_TAG = re.compile(r"<move>(.*?)</move>", re.DOTALL | re.IGNORECASE)
_CELL = re.compile(r"\s*([A-Ca-c])\s*([1-3])\s*")

SYSTEM_PROMPT = (
    "You are playing tic-tac-toe on a 3x3 board. Columns are A, B, C (left to right) and rows are 1, 2, 3 "
    "(top to bottom). Empty cells are shown as '.'. On your turn reply with one empty cell in the form "
    "<move>B2</move>. Three of your marks in a row, column or diagonal wins. Moving onto an occupied cell "
    "or replying without a <move> loses the game."
)

Outcome = Literal["win", "draw", "loss", "illegal", "unfinished"]


def cell_name(i: int) -> str:
    return "ABC"[i % 3] + str(i // 3 + 1)


def parse_move(text: str | None) -> int | None:
    """The cell index of the first ``<move>..</move>`` in ``text``, or None if there is none or it is not a cell."""
    tag = _MOVE_TAG.search(text or "")
    if not tag:
        return None
    cell = _CELL.fullmatch(tag.group(1))
    if not cell:
        return None
    return (int(cell.group(2)) - 1) * 3 + "abc".index(cell.group(1).lower())


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: list[str]) -> str:
    rows = ["   A B C"] + [f"{r + 1}  " + " ".join(board[3 * r: 3 * r + 3]) for r in range(3)]
    return "\n".join(rows)


def turn_prompt(board: list[str], mark: str, last_opponent: int | None) -> str:
    """The user message of one turn: the opponent's last move, the model's mark and the board."""
    head = f"The opponent played {cell_name(last_opponent)}. " if last_opponent is not None else ""
    return f"{head}You are {mark}.\n{render(board)}\nYour move?"


# Two worked turns shown before the game (as earlier user/assistant messages) when few_shot is on.
EXAMPLES: tuple[tuple[str, str], ...] = (
    (turn_prompt(list("........."), "X", None), "<move>B2</move>"),
    (turn_prompt(list("O...X...."), "X", 0), "<move>C3</move>"),
)


def _winning_cells(board: list[str], mark: str) -> list[int]:
    out = []
    for line in LINES:
        values = [board[i] for i in line]
        if values.count(mark) == 2 and values.count(".") == 1:
            out.append(line[values.index(".")])
    return sorted(set(out))


def opponent_move(board: list[str], mark: str, seed: int, skill: float) -> int:
    """The scripted opponent's move (see the module docstring); deterministic in (seed, board)."""
    rng = random.Random(f"{seed}:{''.join(board)}")
    empty = [i for i, v in enumerate(board) if v == "."]
    if rng.random() >= skill:
        return rng.choice(empty)
    other = "O" if mark == "X" else "X"
    for candidates in (_winning_cells(board, mark), _winning_cells(board, other), [4] if 4 in empty else [],
                       [c for c in CORNERS if c in empty], empty):
        if candidates:
            return rng.choice(candidates)
    raise ValueError("opponent asked to move on a full board")


@dataclass
class Game:
    """One game in progress: the board, whose mark the model plays, and the outcome once decided."""

    seed: int
    model_mark: str
    skill: float
    board: list[str] = field(default_factory=lambda: ["."] * 9)
    outcome: Outcome | None = None
    detail: str = ""
    model_moves: int = 0
    last_opponent: int | None = None

    @property
    def opponent_mark(self) -> str:
        return "O" if self.model_mark == "X" else "X"

    def start(self) -> None:
        if self.model_mark == "O":
            self._opponent_turn()

    def prompt(self) -> str:
        return turn_prompt(self.board, self.model_mark, self.last_opponent)

    def play(self, text: str | None) -> None:
        """Apply the model's reply, then the opponent's answer; sets ``outcome`` when the game ends."""
        cell = parse_move(text)
        if cell is None:
            self.outcome, self.detail = "illegal", "unparseable"
            return
        if self.board[cell] != ".":
            self.outcome, self.detail = "illegal", f"occupied {cell_name(cell)}"
            return
        self.board[cell] = self.model_mark
        self.model_moves += 1
        if self._decided():
            return
        self._opponent_turn()

    def _opponent_turn(self) -> None:
        cell = opponent_move(self.board, self.opponent_mark, self.seed, self.skill)
        self.board[cell] = self.opponent_mark
        self.last_opponent = cell
        self._decided()

    def _decided(self) -> bool:
        w = winner(self.board)
        if w is not None:
            self.outcome = "win" if w == self.model_mark else "loss"
        elif "." not in self.board:
            self.outcome = "draw"
        return self.outcome is not None


class TicTacToeConfig(BaseModel):
    """Settings of the tic-tac-toe agent."""

    model_config = ConfigDict(extra="forbid")

    n_train: int = Field(default=256, ge=0, description="training games (distinct opponent seeds)")
    n_val: int = Field(default=64, ge=1, description="validation games")
    n_test: int = Field(default=64, ge=0, description="held-out test games")
    opponent_skill: float = Field(default=0.5, ge=0, le=1, description="chance the opponent plays its heuristic "
                                  "move instead of a random one: 0 is a random player, 1 never misses a win or block")
    model_plays: Literal["X", "O", "both"] = Field(default="both", description="the model's mark; X moves first")
    few_shot: bool = Field(default=True, description="show two worked turns before the game; without them "
                           "SmolLM2-135M never answers with a <move> tag")
    max_tokens: int = Field(default=24, ge=1, description="completion budget per move")
    temperature: float = Field(default=1.0, ge=0, description="sampling temperature of rollouts")
    win_reward: float = Field(default=1.0, description="reward of a won game")
    draw_reward: float = Field(default=0.5, description="reward of a drawn game")
    loss_reward: float = Field(default=0.0, description="reward of a lost game")
    illegal_reward: float = Field(default=-1.0, description="reward when the model's reply is unparseable or "
                                  "takes an occupied cell (the game ends there)")


class TicTacToeAgent(ConfiguredAgent):
    """Plays tic-tac-toe with ``<move>`` replies against the scripted opponent; see the module docstring."""

    name = "tictactoe"
    system_prompt = SYSTEM_PROMPT

    config_class = TicTacToeConfig

    def scenarios(self, split: Split, seed: int) -> list[Scenario]:
        cfg = self.settings
        n = {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}[split]
        out = []
        for i in range(n):
            game_seed = int.from_bytes(hashlib.sha256(f"tictactoe/{split}/{i}".encode()).digest()[:6], "big")
            mark = cfg.model_plays if cfg.model_plays != "both" else ("X" if i % 2 == 0 else "O")
            out.append(Scenario(id=f"ttt-{split}-{i:04d}", split=split,
                                payload={"seed": game_seed, "model_mark": mark, "opponent_skill": cfg.opponent_skill}))
        return ordered(out, seed)

    def new_game(self, scenario: Scenario) -> Game:
        p = scenario.payload
        game = Game(seed=int(p["seed"]), model_mark=p["model_mark"], skill=float(p["opponent_skill"]))
        game.start()
        return game

    def prefix(self) -> list[dict[str, Any]]:
        """The messages before the game: the system prompt and, with ``few_shot``, the worked turns."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
        if self.settings.few_shot:
            for user, reply in EXAMPLES:
                msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return msgs

    def replay(self, scenario: Scenario, messages: list[dict[str, Any]]) -> Game:
        """Replay the assistant replies of a conversation (after :meth:`prefix`) against the scenario's opponent."""
        game = self.new_game(scenario)
        for m in messages[len(self.prefix()):]:
            if game.outcome is not None:
                break
            if m.get("role") == "assistant":
                content = m.get("content")
                game.play(content if isinstance(content, str) else None)
        if game.outcome is None:
            game.outcome = "unfinished"
        return game

    def outcome_reward(self, outcome: Outcome) -> float:
        cfg = self.settings
        return {"win": cfg.win_reward, "draw": cfg.draw_reward, "loss": cfg.loss_reward,
                "illegal": cfg.illegal_reward, "unfinished": cfg.loss_reward}[outcome]

    async def rollout(self, client: AsyncOpenAI, policy: str, scenario: Scenario) -> Trajectory:
        game = self.new_game(scenario)
        traj = Trajectory(messages_and_choices=self.prefix(),
                          metadata={"agent": self.name, "scenario_id": scenario.id, "model_mark": game.model_mark})
        context_exhausted = 0
        while game.outcome is None:
            traj.messages_and_choices.append({"role": "user", "content": game.prompt()})
            try:
                turn = await sample_turn(client, policy, traj, max_tokens=self.settings.max_tokens,
                                         temperature=self.settings.temperature)
            except ContextExhausted as exc:  # unfinished: scored as a loss, like replay() does
                traj.messages_and_choices.pop()
                game.outcome, context_exhausted = "unfinished", 1
                traj.log(f"{scenario.id}: game unfinished, the conversation outgrew the context ({exc})")
                break
            content = turn.message.get("content")
            game.play(content if isinstance(content, str) else None)
        traj.reward = self.outcome_reward(game.outcome)
        traj.metrics.update(self._metrics(game), turns=len(traj.sampled_turns()), context_exhausted=context_exhausted)
        traj.metadata["outcome"] = game.outcome
        traj.log(f"{scenario.id}: {game.outcome}{' (' + game.detail + ')' if game.detail else ''} after "
                 f"{game.model_moves} legal moves as {game.model_mark}; final board {''.join(game.board)}")
        return traj

    @staticmethod
    def _metrics(game: Game) -> dict[str, int]:
        # won/drawn/lost, not win/draw/loss: the flow logs metrics as train/<name> and train/loss is the GRPO loss
        return {"won": int(game.outcome == "win"), "drawn": int(game.outcome == "draw"),
                "lost": int(game.outcome == "loss"), "illegal": int(game.outcome == "illegal"),
                "unparseable": int(game.detail == "unparseable"),
                "illegal_move": int(game.detail.startswith("occupied")), "model_moves": game.model_moves}

    def reward(self, scenario: Scenario, trajectory: Trajectory) -> float:
        """Replays the stored game (see the module docstring for the values)."""
        return self.outcome_reward(self.replay(scenario, trajectory.messages()).outcome)
