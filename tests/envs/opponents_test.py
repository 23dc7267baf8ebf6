"""Opponents: random is uniform and legal, greedy wins and blocks, minimax sees further."""

import numpy as np
import pytest

from earl_jax.envs import base, connect_four, opponents, tic_tac_toe

C4 = connect_four.ConnectFour()
TTT = tic_tac_toe.TicTacToe()
OPP = base.OPPONENT


def _grid(text):
  return base.grid_from_text(text)


def _choices(opponent, board, seeds=range(40)):
  """The moves `opponent` (playing O) makes on `board` under different tie-breaking noise."""
  boards = np.repeat(board[None], len(seeds), axis=0)
  noise = np.stack([np.random.default_rng(s).random(opponent.game.num_actions) for s in seeds])
  return set(opponent.select(boards, OPP, noise).tolist())


def _reference_values(game, board, player, depth):
  """Per-move minimax values by a plain recursive alpha-beta search, one board at a time."""

  def after_move(child, mover, depth, alpha, beta):
    """The value, for `mover`, of the position it just moved into."""
    if game.winner(child[None])[0] == mover:
      return opponents.WIN + depth
    if game.is_full(child[None])[0]:
      return 0
    return -search(child, -mover, depth - 1, -beta, -alpha)

  def search(b, p, depth, alpha, beta):
    if depth == 0:
      return int(game.heuristic(b[None], p)[0])
    best = -np.inf
    for move in np.flatnonzero(game.legal_mask(b[None])[0]):
      child = game.play(b[None], np.array([move]), p)[0]
      best = max(best, after_move(child, p, depth, alpha, beta))
      alpha = max(alpha, best)
      if alpha >= beta:
        break
    return best

  values = np.full(game.num_actions, opponents.ILLEGAL, dtype=np.int64)
  for move in np.flatnonzero(game.legal_mask(board[None])[0]):
    child = game.play(board[None], np.array([move]), player)[0]
    values[move] = after_move(child, player, depth, -np.inf, np.inf)  # exact: full window
  return values


def _random_positions(game, n, seed, plies):
  """Running positions reached by random play (no winner, not full)."""
  rng = np.random.default_rng(seed)
  out = []
  while len(out) < n:
    board = game.empty_boards(1)
    player = base.AGENT
    for _ in range(plies):
      legal = np.flatnonzero(game.legal_mask(board)[0])
      board = game.play(board, np.array([rng.choice(legal)]), player)
      player = -player
      if game.winner(board)[0] or game.is_full(board)[0]:
        break
    else:
      out.append((board[0], player))
  return out


def test_random_opponent_is_uniform_over_legal_moves():
  board = C4.board_from_moves([0] * 6 + [5] * 6)  # columns 1 and 6 are full
  opponent = opponents.RandomOpponent(C4)
  noise = np.random.default_rng(0).random((7000, 7))
  moves = opponent.select(np.repeat(board[None], 7000, axis=0), OPP, noise)
  counts = np.bincount(moves, minlength=7)
  assert counts[0] == counts[5] == 0
  legal_counts = counts[[1, 2, 3, 4, 6]]
  # 1400 expected each; the binomial standard deviation is 34, so +-200 is about 6 sigma.
  assert np.abs(legal_counts - 1400).max() < 200, counts


def test_opponents_are_deterministic_given_the_noise():
  board = C4.board_from_moves([3, 3])
  noise = np.random.default_rng(1).random((5, 7))
  for opponent in (
    opponents.RandomOpponent(C4),
    opponents.GreedyOpponent(C4),
    opponents.MinimaxOpponent(C4, 3),
  ):
    boards = np.repeat(board[None], 5, axis=0)
    first = opponent.select(boards, OPP, noise)
    np.testing.assert_array_equal(opponent.select(boards, OPP, noise), first)


CONNECT_FOUR_O_WINS = """
  .......
  .......
  .......
  .......
  X......
  XOOO.X.
"""
CONNECT_FOUR_X_THREATENS = """
  .......
  .......
  .......
  .......
  O......
  OXXX.O.
"""
CONNECT_FOUR_BOTH = """
  .......
  .......
  .......
  O......
  O......
  OXXX...
"""


@pytest.mark.parametrize(
  ('name', 'game', 'text', 'move'),
  [
    ('takes_a_win', C4, CONNECT_FOUR_O_WINS, 4),
    ('blocks_a_loss', C4, CONNECT_FOUR_X_THREATENS, 4),
    ('prefers_winning_to_blocking', C4, CONNECT_FOUR_BOTH, 0),
    ('takes_a_win_ttt', TTT, 'OO.\nXX.\nX..', 2),
    ('blocks_a_loss_ttt', TTT, 'XX.\nO..\n...', 2),
  ],
)
def test_greedy_opponent(name, game, text, move):
  del name
  assert _choices(opponents.GreedyOpponent(game), _grid(text)) == {move}


def test_greedy_is_random_without_immediate_wins_or_threats():
  board = C4.board_from_moves([3, 3])
  assert _choices(opponents.GreedyOpponent(C4), board) == set(range(7))


# O to move. O playing column 5 (index 4) makes an open three (cols 3-5 with 2 and 6 empty): a
# double threat that wins on O's next move whatever X does. No move wins at once, so greedy
# plays at random.
FORCED_WIN_FOR_O = """
  .......
  .......
  .......
  .......
  ......X
  X.OO..X
"""

# O to move. X threatens to make an open three in the bottom row (X at index 1 or 4 leaves two
# empty ends). Only O at index 1 or 4 stops both; any other move loses by O's fourth ply.
DOUBLE_THREAT_BY_X = """
  .......
  .......
  .......
  ......O
  ......X
  ..XX..O
"""


def test_minimax_finds_a_forced_win_that_greedy_misses():
  board = _grid(FORCED_WIN_FOR_O)
  assert _choices(opponents.MinimaxOpponent(C4, 3), board) == {4}
  greedy = _choices(opponents.GreedyOpponent(C4), board)
  assert len(greedy) > 1 and 4 in greedy
  values = opponents.minimax_values(C4, board[None], OPP, 3)[0]
  assert values[4] == opponents.WIN + 1  # a win on the third ply, with one ply of depth left
  assert (np.delete(values, 4) < opponents.WIN).all()


def test_minimax_blocks_a_double_threat_that_greedy_ignores():
  board = _grid(DOUBLE_THREAT_BY_X)
  assert _choices(opponents.MinimaxOpponent(C4, 4), board) <= {1, 4}
  assert len(_choices(opponents.GreedyOpponent(C4), board) - {1, 4}) > 0
  values = opponents.minimax_values(C4, board[None], OPP, 4)[0]
  losing = [0, 2, 3, 5, 6]
  np.testing.assert_array_equal(values[losing], -(opponents.WIN + 1))
  assert values[1] > -opponents.WIN and values[4] > -opponents.WIN


def test_minimax_prefers_faster_wins():
  board = _grid(FORCED_WIN_FOR_O)
  board[2:5, 0] = OPP  # three O above the X in column 1: O now also wins at once there
  values = opponents.minimax_values(C4, board[None], OPP, 5)[0]
  assert values[0] == opponents.WIN + 5
  assert values[4] == opponents.WIN + 3
  assert _choices(opponents.MinimaxOpponent(C4, 5), board) == {0}


@pytest.mark.parametrize('depth', [1, 2, 3])
def test_minimax_values_match_a_plain_alpha_beta_search_on_connect_four(depth):
  positions = _random_positions(C4, 6, seed=depth, plies=10)
  boards = np.stack([b for b, _ in positions])
  for player in (base.AGENT, OPP):
    got = opponents.minimax_values(C4, boards, player, depth)
    for board, row in zip(boards, got):
      np.testing.assert_array_equal(row, _reference_values(C4, board, player, depth))


@pytest.mark.parametrize('depth', [1, 4, 9])
def test_minimax_values_match_a_plain_alpha_beta_search_on_tic_tac_toe(depth):
  positions = _random_positions(TTT, 8, seed=depth, plies=3)
  boards = np.stack([b for b, _ in positions])
  players = [p for _, p in positions]
  for board, player in zip(boards, players):
    got = opponents.minimax_values(TTT, board[None], player, depth)[0]
    np.testing.assert_array_equal(got, _reference_values(TTT, board, player, depth))


def test_tic_tac_toe_is_a_draw_under_perfect_play():
  values = opponents.minimax_values(TTT, TTT.empty_boards(1), base.AGENT, 9)
  np.testing.assert_array_equal(values, np.zeros((1, 9)))
  # After a corner opening, only the centre reply holds the draw.
  values = opponents.minimax_values(TTT, TTT.board_from_moves([0])[None], OPP, 9)[0]
  assert values[4] == 0
  assert (np.delete(values, [0, 4]) < -opponents.WIN).all()


def test_opponents_reject_boards_without_legal_moves():
  full = base.grid_from_text('XOX\nXOO\nOXX\n')[None]
  for opponent in (
    opponents.RandomOpponent(TTT),
    opponents.GreedyOpponent(TTT),
    opponents.MinimaxOpponent(TTT, 2),
  ):
    with pytest.raises(ValueError, match='full board'):
      opponent.select(full, OPP, np.zeros((1, 9)))


def test_make_opponent():
  assert isinstance(opponents.make_opponent('random', C4), opponents.RandomOpponent)
  assert isinstance(opponents.make_opponent('greedy', C4), opponents.GreedyOpponent)
  assert opponents.make_opponent('minimax', C4, depth=3).depth == 3
  with pytest.raises(ValueError, match=r"known opponents: \['random', 'greedy', 'minimax'\]"):
    opponents.make_opponent('mcts', C4)
  with pytest.raises(ValueError, match='depth must be in'):
    opponents.make_opponent('minimax', C4, depth=0)
