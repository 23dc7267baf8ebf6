"""Tic-Tac-Toe: 3x3, three in a row wins, a full board draws.

Boards are int8 [..., 3, 3] from the agent's point of view (+1 'X', -1 'O', 0 '.'). Actions are
the cells 0..8 in reading order (row-major from the top left), written '1'..'9' in text::

  123
  456
  789

A board renders as 12 characters, 3 lines of 3 cells, top row first (no header: the cell numbers
are the reading order)::

  X.O
  .X.
  ..O
"""

import numpy as np
from jaxtyping import Bool, Int, Int8, Int64

from earl_jax.envs import base

ROWS = 3
COLS = 3
CELLS = ROWS * COLS
HEADER = ''

# The 8 lines of three, as flat cell indices: rows, columns, diagonals.
LINES = np.array(
  [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 3, 6], [1, 4, 7], [2, 5, 8], [0, 4, 8], [2, 4, 6]],
  dtype=np.intp,
)
# Heuristic value of a line holding `own` of the player's stones and `opp` of the other side's.
_LINE_SCORE = np.zeros((4, 4), dtype=np.int64)
_LINE_SCORE[1, 0], _LINE_SCORE[2, 0], _LINE_SCORE[3, 0] = 1, 10, 100
_LINE_SCORE[0, 1], _LINE_SCORE[0, 2], _LINE_SCORE[0, 3] = -1, -10, -100
_LINE_SCORE = _LINE_SCORE.reshape(-1)
_CENTRE_WEIGHT = 2
_POWERS_OF_3 = 3 ** np.arange(CELLS, dtype=np.int64)


def legal_mask(boards: Int8[np.ndarray, 'M 3 3']) -> Bool[np.ndarray, 'M 9']:
  """A cell is legal while it is empty."""
  return boards.reshape(len(boards), CELLS) == base.EMPTY


def legal_moves(board: Int8[np.ndarray, '3 3']) -> list[int]:
  """The legal 0-based cells of one board."""
  return np.flatnonzero(board.reshape(-1) == base.EMPTY).tolist()


def play(
  boards: Int8[np.ndarray, 'M 3 3'], actions: Int[np.ndarray, ' M'], player: int
) -> Int8[np.ndarray, 'M 3 3']:
  """Puts `player`'s stone on cell actions[i] of board i; returns new boards.

  Raises:
    ValueError: a cell is out of range or occupied.
  """
  actions = np.asarray(actions, dtype=np.intp)
  if actions.size and (actions.min() < 0 or actions.max() >= CELLS):
    raise ValueError(f'Tic-Tac-Toe cells are 0..{CELLS - 1}, got {actions.tolist()}.')
  out = boards.reshape(len(boards), CELLS).copy()
  m = np.arange(len(boards))
  if (out[m, actions] != base.EMPTY).any():
    taken = actions[out[m, actions] != base.EMPTY]
    raise ValueError(f'Cell(s) {np.unique(taken).tolist()} are occupied.')
  out[m, actions] = player
  return out.reshape(boards.shape)


def _line_sums(x: Int8[np.ndarray, 'M 3 3']) -> Int8[np.ndarray, 'M 8']:
  return x.reshape(len(x), CELLS)[:, LINES].sum(axis=2, dtype=np.int8)


def winner(boards: Int8[np.ndarray, 'M 3 3']) -> Int8[np.ndarray, ' M']:
  """+1 / -1 for the side with three in a row on each board, else 0."""
  sums = _line_sums(boards)
  x_wins = (sums == 3).any(axis=1)
  o_wins = (sums == -3).any(axis=1)
  return np.where(x_wins, 1, np.where(o_wins, -1, 0)).astype(np.int8)


def is_full(boards: Int8[np.ndarray, 'M 3 3']) -> Bool[np.ndarray, ' M']:
  """Whether every cell is taken."""
  return (boards != base.EMPTY).all(axis=(1, 2))


def heuristic(boards: Int8[np.ndarray, 'M 3 3'], player: int) -> Int64[np.ndarray, ' M']:
  """Open lines from `player`'s side: 1 per line with one own stone and no other, 10 with two;
  the same negative for the other side; 2 for holding the centre. Antisymmetric in `player`."""
  own = _line_sums((boards == player).astype(np.int8))
  opp = _line_sums((boards == -player).astype(np.int8))
  score = _LINE_SCORE[own.astype(np.intp) * 4 + opp].sum(axis=1)
  return score + _CENTRE_WEIGHT * (boards[:, 1, 1].astype(np.int64) * player)


def position_keys(boards: Int8[np.ndarray, 'M 3 3']) -> Int64[np.ndarray, ' M']:
  """The base-3 number of each board (exact for every board)."""
  flat = boards.reshape(len(boards), CELLS).astype(np.int64) + 1
  return flat @ _POWERS_OF_3


class TicTacToe(base.BoardGame):
  """Tic-Tac-Toe's rules as a `base.BoardGame`."""

  name = 'tic_tac_toe'
  rows = ROWS
  cols = COLS
  num_actions = CELLS
  header = HEADER

  legal_mask = staticmethod(legal_mask)
  play = staticmethod(play)
  winner = staticmethod(winner)
  is_full = staticmethod(is_full)
  heuristic = staticmethod(heuristic)
  position_keys = staticmethod(position_keys)
