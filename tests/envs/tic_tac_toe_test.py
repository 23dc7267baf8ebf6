"""Tic-Tac-Toe rules: cell numbering, wins on every line, draws, occupied cells, keys, rendering."""

import itertools

import numpy as np
import pytest

from earl_jax.envs import base, tic_tac_toe

TTT = tic_tac_toe.TicTacToe()


def test_cells_are_numbered_in_reading_order():
  boards = TTT.empty_boards(9)
  boards = tic_tac_toe.play(boards, np.arange(9), base.AGENT)
  for cell in range(9):
    assert boards[cell, cell // 3, cell % 3] == base.AGENT
    assert (boards[cell] != 0).sum() == 1


@pytest.mark.parametrize('line', tic_tac_toe.LINES.tolist())
@pytest.mark.parametrize('player', [base.AGENT, base.OPPONENT])
def test_every_line_of_three_wins(line, player):
  board = np.zeros(9, dtype=np.int8)
  board[line] = player
  assert tic_tac_toe.winner(board.reshape(1, 3, 3)).tolist() == [player]
  board[line[1]] = -player
  assert tic_tac_toe.winner(board.reshape(1, 3, 3)).tolist() == [0]


def test_the_eight_lines_are_the_rows_columns_and_diagonals():
  lines = {frozenset(line) for line in tic_tac_toe.LINES.tolist()}
  expected = {frozenset(range(3 * r, 3 * r + 3)) for r in range(3)}
  expected |= {frozenset(range(c, 9, 3)) for c in range(3)}
  expected |= {frozenset({0, 4, 8}), frozenset({2, 4, 6})}
  assert lines == expected


def test_winner_agrees_with_a_reference_on_every_filling():
  fillings = np.array(list(itertools.product([-1, 0, 1], repeat=9)), dtype=np.int8)
  boards = fillings.reshape(-1, 3, 3)

  def reference(cells):
    for player in (1, -1):
      if any(all(cells[i] == player for i in line) for line in tic_tac_toe.LINES.tolist()):
        return player
    return 0

  expected = np.array([reference(cells) for cells in fillings])
  np.testing.assert_array_equal(tic_tac_toe.winner(boards), expected)


def test_full_board_without_a_line_is_a_draw():
  board = base.grid_from_text('XOX\nXOO\nOXX\n')
  assert tic_tac_toe.winner(board[None]).tolist() == [0]
  assert tic_tac_toe.is_full(board[None]).tolist() == [True]
  assert tic_tac_toe.legal_moves(board) == []


def test_occupied_and_out_of_range_cells_are_rejected():
  board = TTT.board_from_moves([4, 0])
  assert tic_tac_toe.legal_moves(board) == [1, 2, 3, 5, 6, 7, 8]
  with pytest.raises(ValueError, match=r'Cell\(s\) \[4\] are occupied'):
    tic_tac_toe.play(board[None], np.array([4]), base.AGENT)
  with pytest.raises(ValueError, match=r'cells are 0\.\.8'):
    tic_tac_toe.play(board[None], np.array([9]), base.AGENT)
  with pytest.raises(ValueError, match='occupied'):
    TTT.board_from_moves([4, 4])


def test_render():
  board = TTT.board_from_moves([0, 2, 4, 8])
  (text,) = TTT.render(board[None])
  assert text == 'X.O\n.X.\n..O\n'
  assert set(text) <= set(base.ALPHABET)


def test_position_keys_are_distinct_for_distinct_boards():
  fillings = np.array(list(itertools.product([-1, 0, 1], repeat=9)), dtype=np.int8)
  keys = tic_tac_toe.position_keys(fillings.reshape(-1, 3, 3))
  assert len(np.unique(keys)) == 3**9


def test_heuristic_is_antisymmetric_and_values_open_twos():
  fillings = np.array(list(itertools.product([-1, 0, 1], repeat=9)), dtype=np.int8)[::7]
  boards = fillings.reshape(-1, 3, 3)
  np.testing.assert_array_equal(
    tic_tac_toe.heuristic(boards, 1), -tic_tac_toe.heuristic(boards, -1)
  )
  open_two = base.grid_from_text('XX.\n...\n..O\n')
  blocked_two = base.grid_from_text('XXO\n...\n...\n')
  scores = tic_tac_toe.heuristic(np.stack([open_two, blocked_two]), base.AGENT)
  assert scores[0] > scores[1]
