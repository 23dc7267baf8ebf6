"""Built-in opponents for the board games: random, greedy one-ply, and depth-limited minimax.

An opponent picks one move per board for a whole stack of boards at once. Its randomness comes
from `noise`, uniform [0, 1) numbers per (board, action) that the environment draws from its
seeded generator: among the moves an opponent considers equally good it plays the one with the
largest noise, so a batch replays exactly from the reset seed and the agent's replies.

Minimax searches `depth` plies (its own move counts as one) and scores the positions at the
horizon with the game's heuristic (Connect Four: scored windows of four and a centre bonus). A win
found earlier scores higher, so it wins as fast and loses as slowly as it can see. The search
visits the full game tree level by level, vectorised over the whole batch with numpy, and
evaluates each distinct position of a level once (positions reached by transposed moves, or in
several games, are merged by `BoardGame.position_keys`). It returns the exact minimax value of
every root move, the value alpha-beta computes for the best move, which a Python alpha-beta
search would reach with far more interpreter overhead per position.
"""

import abc

import numpy as np
from jaxtyping import Bool, Float, Int8, Int64

from earl_jax.envs import base

# Score of a win found with `d` plies of search left: WIN + d, far above any heuristic value.
WIN = 1_000_000
# Value of an illegal root move in `minimax_values`.
ILLEGAL = -(2**62)


def _pick(
  candidates: Bool[np.ndarray, 'M A'], noise: Float[np.ndarray, 'M A']
) -> Int64[np.ndarray, ' M']:
  """The candidate with the largest noise in each row (uniform over candidates for iid noise)."""
  return np.argmax(np.where(candidates, noise, -1.0), axis=1).astype(np.int64)


def _check_playable(legal: Bool[np.ndarray, 'M A']) -> None:
  if not legal.any(axis=1).all():
    rows = np.flatnonzero(~legal.any(axis=1)).tolist()
    raise ValueError(f'Opponent asked to move on full board(s) at rows {rows}.')


def winning_moves(
  game: base.BoardGame, boards: Int8[np.ndarray, 'M R W'], player: int
) -> Bool[np.ndarray, 'M A']:
  """Which legal moves win on the spot for `player`."""
  legal = game.legal_mask(boards)
  parent, move = np.nonzero(legal)
  children = game.play(boards[parent], move, player)
  out = np.zeros(legal.shape, dtype=bool)
  out[parent, move] = game.winner(children) == player
  return out


class Opponent(abc.ABC):
  """Picks moves for `player` on a stack of non-terminal boards."""

  def __init__(self, game: base.BoardGame):
    self.game = game

  @abc.abstractmethod
  def select(
    self, boards: Int8[np.ndarray, 'M R W'], player: int, noise: Float[np.ndarray, 'M A']
  ) -> Int64[np.ndarray, ' M']:
    """One legal 0-based action per board.

    Args:
      boards: positions with at least one legal move and no winner.
      player: the side to move, +1 or -1.
      noise: uniform [0, 1) tie-breaking numbers per (board, action).

    Raises:
      ValueError: a board has no legal move.
    """


class RandomOpponent(Opponent):
  """Uniform over the legal moves."""

  def select(
    self, boards: Int8[np.ndarray, 'M R W'], player: int, noise: Float[np.ndarray, 'M A']
  ) -> Int64[np.ndarray, ' M']:
    legal = self.game.legal_mask(boards)
    _check_playable(legal)
    return _pick(legal, noise)


class GreedyOpponent(Opponent):
  """One ply: take an immediate win, else block the other side's immediate win, else random."""

  def select(
    self, boards: Int8[np.ndarray, 'M R W'], player: int, noise: Float[np.ndarray, 'M A']
  ) -> Int64[np.ndarray, ' M']:
    legal = self.game.legal_mask(boards)
    _check_playable(legal)
    wins = winning_moves(self.game, boards, player)
    blocks = winning_moves(self.game, boards, -player)
    candidates = np.where(
      wins.any(axis=1, keepdims=True),
      wins,
      np.where(blocks.any(axis=1, keepdims=True), blocks, legal),
    )
    return _pick(candidates, noise)


def _child_values(
  game: base.BoardGame, children: Int8[np.ndarray, 'Mc R W'], player: int, depth: int
) -> Int64[np.ndarray, ' Mc']:
  """Minimax values, for `player`, of positions `player` just moved into, `depth` plies counted
  from that move: WIN + depth if it won, 0 for a draw, else the negated value for the side to move.
  Each distinct position is evaluated once."""
  _, first, inverse = np.unique(
    game.position_keys(children), return_index=True, return_inverse=True
  )
  unique = children[first]
  won = game.winner(unique) == player
  full = game.is_full(unique)
  value = np.where(won, WIN + depth, 0).astype(np.int64)
  running = ~won & ~full
  if running.any():
    value[running] = -_negamax(game, unique[running], -player, depth - 1)
  return value[inverse.reshape(-1)]


def _negamax(
  game: base.BoardGame, boards: Int8[np.ndarray, 'Mp R W'], player: int, depth: int
) -> Int64[np.ndarray, ' Mp']:
  """Values of non-terminal positions for `player`, the side to move, searching `depth` plies."""
  if depth == 0:
    return game.heuristic(boards, player)
  parent, move = np.nonzero(game.legal_mask(boards))  # parents ascending, each at least once
  values = _child_values(game, game.play(boards[parent], move, player), player, depth)
  starts = np.flatnonzero(np.r_[True, parent[1:] != parent[:-1]])
  return np.maximum.reduceat(values, starts)


def minimax_values(
  game: base.BoardGame, boards: Int8[np.ndarray, 'M R W'], player: int, depth: int
) -> Int64[np.ndarray, 'M A']:
  """The depth-limited minimax value of every move for `player` (`ILLEGAL` where illegal).

  A move that wins at once is worth WIN + depth; one that lets the other side win at its next move
  is worth -(WIN + depth - 1); and so on, down to heuristic values at the horizon.
  """
  if not 1 <= depth <= base.MAX_MINIMAX_DEPTH:
    raise ValueError(f'minimax depth must be in [1, {base.MAX_MINIMAX_DEPTH}], got {depth}.')
  legal = game.legal_mask(boards)
  _check_playable(legal)
  parent, move = np.nonzero(legal)
  out = np.full(legal.shape, ILLEGAL, dtype=np.int64)
  out[parent, move] = _child_values(game, game.play(boards[parent], move, player), player, depth)
  return out


class MinimaxOpponent(Opponent):
  """Plays a move of best depth-limited minimax value; ties broken by the noise."""

  def __init__(self, game: base.BoardGame, depth: int):
    super().__init__(game)
    if not 1 <= depth <= base.MAX_MINIMAX_DEPTH:
      raise ValueError(f'minimax depth must be in [1, {base.MAX_MINIMAX_DEPTH}], got {depth}.')
    self.depth = depth

  def select(
    self, boards: Int8[np.ndarray, 'M R W'], player: int, noise: Float[np.ndarray, 'M A']
  ) -> Int64[np.ndarray, ' M']:
    values = minimax_values(self.game, boards, player, self.depth)
    return _pick(values == values.max(axis=1, keepdims=True), noise)


def make_opponent(name: str, game: base.BoardGame, depth: int = 4) -> Opponent:
  """The opponent called `name` ('random', 'greedy' or 'minimax' searching `depth` plies)."""
  if name == 'random':
    return RandomOpponent(game)
  if name == 'greedy':
    return GreedyOpponent(game)
  if name == 'minimax':
    return MinimaxOpponent(game, depth)
  raise ValueError(f'Unknown opponent {name!r}; known opponents: {list(base.OPPONENTS)}.')
