"""The tic-tac-toe agent's scripted expert: a perfect (minimax) player answering ``<move>B2</move>``.

Each turn it reads the agent's own prompt (``You are X.`` and the rendered board, :func:`tictactoe.render`) and
replies with a move of the best negamax value for its mark::

    value(board, m) = max over empty cells c of   1 + empty cells left     if placing m on c wins
                                                  0                        if it fills the board
                                                  -value(board + c, other) otherwise

so a win is worth more the sooner it comes and a loss less the later it comes: the expert wins when the opponent
errs, wins fast, and otherwise draws; it never loses and never plays an occupied cell. Moves of equal value are
chosen by ``random.Random(f"{seed}:{board}")``, so demonstrations vary across positions and are the same every time.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any

from agents.examples.scripted_policy import ExpertError
from agents.examples.tictactoe import cell_name, winner

_MARK = re.compile(r"You are ([XO])\.")
_ROW = re.compile(r"^([1-3])  ([.XO]) ([.XO]) ([.XO])$", re.MULTILINE)


def read_prompt(text: str) -> tuple[str, str]:
    """(board as 9 characters, the mark to play) from a turn prompt of the tic-tac-toe agent."""
    mark, rows = _MARK.search(text or ""), _ROW.findall(text or "")
    if not mark or [r[0] for r in rows] != ["1", "2", "3"]:
        raise ExpertError(f"not a tic-tac-toe turn prompt: {str(text)[:120]!r}")
    return "".join(cell for row in rows for cell in row[1:]), mark.group(1)


@functools.cache
def value(board: str, mark: str) -> int:
    """The negamax value of ``board`` for ``mark`` to move (see the module docstring)."""
    return max(move_values(board, mark).values())


@functools.cache
def move_values(board: str, mark: str) -> dict[int, int]:
    """Each empty cell's value for ``mark``."""
    other = "O" if mark == "X" else "X"
    out = {}
    for cell in (i for i, v in enumerate(board) if v == "."):
        after = board[:cell] + mark + board[cell + 1:]
        if winner(list(after)) == mark:
            out[cell] = 1 + after.count(".")
        elif "." not in after:
            out[cell] = 0
        else:
            out[cell] = -value(after, other)
    return out


def best_moves(board: str, mark: str) -> list[int]:
    values = move_values(board, mark)
    if not values:
        raise ExpertError(f"no empty cell on board {board!r}")
    top = max(values.values())
    return [cell for cell, v in values.items() if v == top]


class TicTacToeExpert:
    """Plays :class:`TicTacToeAgent` games perfectly; ``seed`` picks among equally good moves."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def move(self, board: str, mark: str) -> int:
        return random.Random(f"{self.seed}:{board}").choice(best_moves(board, mark))

    def act(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        board, mark = read_prompt(messages[-1].get("content") if messages else "")
        return {"content": f"<move>{cell_name(self.move(board, mark))}</move>"}
