"""Connect Four rules: gravity, wins in all four directions, draws, full columns, keys, rendering."""

import numpy as np
import pytest

from earl_jax.envs import base, connect_four

C4 = connect_four.ConnectFour()

DIRECTIONS = {
  'horizontal': (0, 1),
  'vertical': (1, 0),
  'diagonal_down_right': (1, 1),
  'diagonal_up_right': (-1, 1),
}


def _windows(dr, dc):
  """Every window of four cells along (dr, dc), as lists of (row, col)."""
  out = []
  for r in range(6):
    for c in range(7):
      cells = [(r + k * dr, c + k * dc) for k in range(4)]
      if all(0 <= rr < 6 and 0 <= cc < 7 for rr, cc in cells):
        out.append(cells)
  return out


def _reference_winner(board):
  """Cell-by-cell reference: +1 if X has four in a row, else -1 if O has, else 0."""
  for player in (1, -1):
    for dr, dc in DIRECTIONS.values():
      for cells in _windows(dr, dc):
        if all(board[r, c] == player for r, c in cells):
          return player
  return 0


def _random_boards(n, seed):
  """Random cell fillings (not necessarily reachable), dense enough to hold many lines."""
  rng = np.random.default_rng(seed)
  density = rng.uniform(0.2, 0.9, size=(n, 1, 1))
  stones = rng.choice(np.array([1, -1], dtype=np.int8), size=(n, 6, 7))
  return np.where(rng.random((n, 6, 7)) < density, stones, 0).astype(np.int8)


def _random_game_boards(n, seed, plies):
  """Reachable positions: `plies` random legal moves from the empty board (may have ended)."""
  rng = np.random.default_rng(seed)
  boards = C4.empty_boards(n)
  player = base.AGENT
  for _ in range(plies):
    legal = connect_four.legal_mask(boards)
    live = legal.any(axis=1)
    moves = np.argmax(np.where(legal, rng.random(legal.shape), -1), axis=1)
    boards[live] = connect_four.play(boards[live], moves[live], player)
    player = -player
  return boards


# A full board with no four in a row: cell (r, c) is X when c + r // 2 is even.
FULL_NO_WINNER = np.array(
  [[1 if (c + r // 2) % 2 == 0 else -1 for c in range(7)] for r in range(6)], dtype=np.int8
)


@pytest.mark.parametrize('direction', list(DIRECTIONS))
@pytest.mark.parametrize('player', [base.AGENT, base.OPPONENT])
def test_winner_finds_four_in_a_row_in_every_window(direction, player):
  windows = _windows(*DIRECTIONS[direction])
  assert len(windows) == {'horizontal': 24, 'vertical': 21}.get(direction, 12)
  four = np.zeros((len(windows), 6, 7), dtype=np.int8)
  three = np.zeros((len(windows), 6, 7), dtype=np.int8)
  for i, cells in enumerate(windows):
    for k, (r, c) in enumerate(cells):
      four[i, r, c] = player
      if k != 2:
        three[i, r, c] = player
  np.testing.assert_array_equal(connect_four.winner(four), np.full(len(windows), player))
  np.testing.assert_array_equal(connect_four.winner(three), np.zeros(len(windows)))


def test_winner_matches_a_cell_by_cell_reference():
  boards = _random_boards(3000, seed=0)
  expected = np.array([_reference_winner(b) for b in boards])
  assert (
    (expected == 1).sum() > 100 and (expected == -1).sum() > 100 and (expected == 0).sum() > 100
  )
  np.testing.assert_array_equal(connect_four.winner(boards), expected)


def test_full_board_without_a_winner_is_a_draw():
  boards = FULL_NO_WINNER[None]
  assert _reference_winner(FULL_NO_WINNER) == 0
  assert connect_four.winner(boards).tolist() == [0]
  assert connect_four.is_full(boards).tolist() == [True]
  assert not connect_four.legal_mask(boards).any()
  assert connect_four.legal_moves(FULL_NO_WINNER) == []


def test_stones_fall_to_the_lowest_empty_row():
  boards = C4.empty_boards(2)
  for k in range(6):
    player = base.AGENT if k % 2 == 0 else base.OPPONENT
    boards = connect_four.play(boards, np.array([3, 0]), player)
    assert boards[0, 5 - k, 3] == player and boards[1, 5 - k, 0] == player
    assert (boards != 0).sum() == 2 * (k + 1)
  np.testing.assert_array_equal(boards[0, :, 3], [-1, 1, -1, 1, -1, 1])


def test_play_returns_new_boards_and_rejects_full_or_out_of_range_columns():
  board = C4.board_from_moves([0] * 6)
  before = board.copy()
  after = connect_four.play(board[None], np.array([1]), base.AGENT)
  np.testing.assert_array_equal(board, before)
  assert after[0, 5, 1] == base.AGENT
  with pytest.raises(ValueError, match=r'Column\(s\) \[0\] are full'):
    connect_four.play(board[None], np.array([0]), base.AGENT)
  with pytest.raises(ValueError, match=r'columns are 0\.\.6'):
    connect_four.play(board[None], np.array([7]), base.AGENT)


def test_full_columns_are_not_legal():
  board = C4.board_from_moves([0] * 6 + [6] * 6 + [3] * 5)
  assert connect_four.legal_moves(board) == [1, 2, 3, 4, 5]
  assert connect_four.legal_mask(board[None]).tolist() == [[False] + [True] * 5 + [False]]


def test_board_from_moves_alternates_players():
  board = C4.board_from_moves([3, 3, 2], first=base.OPPONENT)
  assert board[5, 3] == base.OPPONENT and board[4, 3] == base.AGENT and board[5, 2] == base.OPPONENT
  with pytest.raises(ValueError, match='full'):
    C4.board_from_moves([0] * 7)


def test_render_is_compact_and_uses_the_alphabet():
  board = C4.board_from_moves([3, 4, 3, 4, 2, 3])
  (text,) = C4.render(board[None])
  assert text == ('1234567\n.......\n.......\n.......\n...O...\n...XO..\n..XXO..\n')
  assert len(text) == 56
  assert set(text) <= set(base.ALPHABET)
  np.testing.assert_array_equal(base.grid_from_text(text), board)


def _reference_key(board):
  key = 0
  for c in range(7):
    stones = [board[r, c] for r in range(5, -1, -1) if board[r, c] != 0]
    code = 1 << len(stones)
    for i, v in enumerate(stones):
      code |= int(v == 1) << i
    key |= code << (7 * c)
  return key


def test_position_keys_are_exact_for_reachable_boards():
  boards = np.concatenate(
    [_random_game_boards(500, seed, plies) for seed, plies in enumerate(range(0, 43, 6))]
  )
  keys = connect_four.position_keys(boards)
  np.testing.assert_array_equal(keys, [_reference_key(b) for b in boards])
  distinct_boards = len(np.unique(boards.reshape(len(boards), -1), axis=0))
  assert len(np.unique(keys)) == distinct_boards


def test_heuristic_is_antisymmetric_and_likes_the_centre_and_open_threes():
  boards = _random_game_boards(400, seed=3, plies=12)
  np.testing.assert_array_equal(
    connect_four.heuristic(boards, base.AGENT), -connect_four.heuristic(boards, base.OPPONENT)
  )
  centre, edge = C4.board_from_moves([3]), C4.board_from_moves([0])
  scores = connect_four.heuristic(np.stack([centre, edge]), base.AGENT)
  assert scores[0] > scores[1]
  three = base.grid_from_text('.......\n' * 5 + 'XXX..OO\n')
  two = base.grid_from_text('.......\n' * 5 + 'XX...OO\n')
  three_score, two_score = connect_four.heuristic(np.stack([three, two]), base.AGENT)
  assert three_score > two_score
