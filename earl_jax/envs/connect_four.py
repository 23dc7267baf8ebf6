"""Connect Four: 6 rows x 7 columns, gravity, four in a row wins, a full board draws.

Boards are int8 [..., 6, 7], row 0 on top, from the agent's point of view (`base.AGENT` +1 'X',
`base.OPPONENT` -1 'O', 0 '.'). A stone dropped in column c lands in the lowest empty row of c.
Actions are column indices 0..6, written '1'..'7' in text.

A board renders as 56 characters: a header with the column numbers, then the 6 rows, top first::

  1234567
  .......
  .......
  .......
  ...O...
  ...XO..
  ..XXO..

Every rule is vectorised over a stack of M boards: a win is a window of four equal stones, and
the 69 windows of a 6x7 board are summed with four shifted slices per direction.
"""

import numpy as np
from jaxtyping import Bool, Int, Int8, Int64

from earl_jax.envs import base

ROWS = 6
COLS = 7
HEADER = ''.join(str(c + 1) for c in range(COLS)) + '\n'

# Heuristic weight of a window of four holding t stones of one colour and none of the other:
# (t**3 - t) / 3, i.e. 2 for two stones, 8 for three and 20 for four (negative for the other side).
_CENTRE_WEIGHT = 3
_COLUMN_SHIFT = 7 * np.arange(COLS, dtype=np.int64)


def legal_mask(boards: Int8[np.ndarray, 'M 6 7']) -> Bool[np.ndarray, 'M 7']:
  """A column is legal while its top cell is empty."""
  return boards[:, 0, :] == base.EMPTY


def legal_moves(board: Int8[np.ndarray, '6 7']) -> list[int]:
  """The legal 0-based columns of one board."""
  return np.flatnonzero(board[0] == base.EMPTY).tolist()


def play(
  boards: Int8[np.ndarray, 'M 6 7'], actions: Int[np.ndarray, ' M'], player: int
) -> Int8[np.ndarray, 'M 6 7']:
  """Drops `player`'s stone into column actions[i] of board i; returns new boards.

  Raises:
    ValueError: a column is out of range or full.
  """
  actions = np.asarray(actions, dtype=np.intp)
  if actions.size and (actions.min() < 0 or actions.max() >= COLS):
    raise ValueError(f'Connect Four columns are 0..{COLS - 1}, got {actions.tolist()}.')
  m = np.arange(len(boards))
  column = boards[m, :, actions]  # [M, R]
  row = (column == base.EMPTY).sum(axis=1) - 1
  if (row < 0).any():
    raise ValueError(f'Column(s) {np.unique(actions[row < 0]).tolist()} are full.')
  out = boards.copy()
  out[m, row, actions] = player
  return out


def _cells_last(boards: Int8[np.ndarray, 'M 6 7']) -> Int8[np.ndarray, '6 7 M']:
  """The boards with the position axis last, so that the window sums below run over long
  contiguous rows of positions instead of 4-7 cells at a time (faster: see
  docs/results/from-docstrings.md, "Connect Four's window sums")."""
  return np.ascontiguousarray(boards.transpose(1, 2, 0))


def _window_sums(x: Int8[np.ndarray, '6 7 M']) -> list[Int8[np.ndarray, 'W M']]:
  """Sums of x over every window of four: horizontal, vertical, and both diagonals (69 in all)."""
  m = x.shape[-1]
  sums = [
    x[:, 0:4] + x[:, 1:5] + x[:, 2:6] + x[:, 3:7],
    x[0:3] + x[1:4] + x[2:5] + x[3:6],
    x[0:3, 0:4] + x[1:4, 1:5] + x[2:5, 2:6] + x[3:6, 3:7],
    x[3:6, 0:4] + x[2:5, 1:5] + x[1:4, 2:6] + x[0:3, 3:7],
  ]
  return [s.reshape(-1, m) for s in sums]


def winner(boards: Int8[np.ndarray, 'M 6 7']) -> Int8[np.ndarray, ' M']:
  """+1 / -1 for the side with four in a row on each board, else 0 (+1 if, impossibly, both)."""
  x = _cells_last(boards)
  x_wins = np.zeros(len(boards), dtype=bool)
  o_wins = np.zeros(len(boards), dtype=bool)
  for sums in _window_sums(x):
    x_wins |= (sums == 4).any(axis=0)
    o_wins |= (sums == -4).any(axis=0)
  return np.where(x_wins, 1, np.where(o_wins, -1, 0)).astype(np.int8)


def is_full(boards: Int8[np.ndarray, 'M 6 7']) -> Bool[np.ndarray, ' M']:
  """Whether every column is full."""
  return (boards[:, 0, :] != base.EMPTY).all(axis=1)


def heuristic(boards: Int8[np.ndarray, 'M 6 7'], player: int) -> Int64[np.ndarray, ' M']:
  """Scored windows of four plus a centre-column bonus, from `player`'s side.

  A window holding t of the player's stones and none of the other side's scores (t**3 - t) / 3:
  2 for two stones, 8 for three (20 for four); the other side's windows count negative, mixed
  windows 0. Each stone in the centre column is worth 3. Antisymmetric:
  heuristic(b, p) == -heuristic(b, -p).
  """
  x = _cells_last(boards)
  if player != base.AGENT:
    x = -x
  stones = (x != base.EMPTY).view(np.int8)
  score = np.zeros(len(boards), dtype=np.int64)
  for total, count in zip(_window_sums(x), _window_sums(stones)):
    pure = np.where(np.abs(total) == count, total, np.int8(0))  # +-t in one-colour windows
    score += (pure * (pure * pure - 1)).sum(axis=0, dtype=np.int64)  # <= 60: fits int8
  centre = x[:, COLS // 2].sum(axis=0, dtype=np.int64)
  return score // 3 + _CENTRE_WEIGHT * centre


def position_keys(boards: Int8[np.ndarray, 'M 6 7']) -> Int64[np.ndarray, ' M']:
  """A 49-bit key per board, exact for boards that obey gravity (every reachable board).

  Column c contributes 7 bits at bit 7c: a leading 1 above its h stones, whose bits say which are
  +1 (the bottom stone is bit 0).
  """
  x = _cells_last(boards)
  code = np.zeros(x.shape[1:], dtype=np.uint8)  # [W, M]
  for row in range(ROWS):
    occupied = (x[row] != base.EMPTY).view(np.uint8)
    # A stone in this row is the (ROWS - 1 - row)-th from the bottom; the leading 1 sits just
    # above the top stone, so the top row (row 0) may set bit 6.
    code |= (x[row] == base.AGENT).view(np.uint8) << np.uint8(ROWS - 1 - row)
    if row == 0:
      code |= occupied << np.uint8(ROWS)
    else:
      above_empty = (x[row - 1] == base.EMPTY).view(np.uint8)
      code |= (occupied & above_empty) << np.uint8(ROWS - row)
  empty_column = (x[ROWS - 1] == base.EMPTY).view(np.uint8)
  code |= empty_column  # an empty column's code is 1 (just the leading bit)
  return (code.astype(np.int64) << _COLUMN_SHIFT[:, None]).sum(axis=0)


class ConnectFour(base.BoardGame):
  """Connect Four's rules as a `base.BoardGame`."""

  name = 'connect_four'
  rows = ROWS
  cols = COLS
  num_actions = COLS
  header = HEADER

  legal_mask = staticmethod(legal_mask)
  play = staticmethod(play)
  winner = staticmethod(winner)
  is_full = staticmethod(is_full)
  heuristic = staticmethod(heuristic)
  position_keys = staticmethod(position_keys)
