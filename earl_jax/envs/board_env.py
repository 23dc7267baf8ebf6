"""A batched text environment for a two-player board game against a built-in opponent.

Each agent turn: read the reply, play it if it is legal (else the episode ends with
`invalid_penalty`), stop if it won or filled the board, else let the opponent answer and stop if
that won or filled the board. The board logic is vectorised over the batch; only parsing replies
and building the per-episode text and info dicts loop in Python.

Observations (`EnvConfig.observation`), always with the agent as 'X':
  'board': the game's compact board (Connect Four: a '1234567' header and 6 rows, 56 characters).
  'last_move': 'o:<digit>\\n', the opponent's last move in text form, or 'o:-\\n' when it has not
    moved since the agent's last reply (the agent moves first, or the agent's move ended the game).
The observation of the step that ends an episode adds one line with the outcome ('win\\n',
'loss\\n', 'draw\\n' or 'invalid\\n'), after the final board; in 'board' mode a finished Connect
Four observation is at most 64 characters. In a match (`EnvConfig.series_games`), a game that ends
while the match goes on is followed in the same observation by the next game's first one. With
`EnvConfig.think_depth`, a thinking reply ('t') is answered by its hint alone ('h2:4\\n'),
whatever the mode: the board has not changed; 'h' plays the hinted move.

Randomness: `reset(n, seed)` seeds one numpy Generator. Reset draws n coins (who moves first) and
an [n, A] noise array, and every step draws another [n, A] noise array, whatever the replies, so
episode i's opponent moves depend only on (n, seed, i, its own replies). In a match, each step's
draw is [n, 2A + 1] instead: the [n, A] noise, then a coin and an [n, A] noise for the opening
of a game that starts at that step. With `group_size=k`, the draws are made per group of k
consecutive episodes and shared inside it: the episodes of a group start alike and face the same
opponent randomness, so they differ only by the agent's replies (the groups of GRPO-style
baselines).
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from jaxtyping import Bool, Float, Int, Int8

from earl_jax.envs import base, opponents

# Games a full-column start of `EnvConfig.full_column_fill='stack'` plays before it falls back to
# the alternating column: one such game ends in a line before its column fills about 72% of the
# time, so 4 give a stacked start about 70% of the time (docs/results/tried.md).
_STACK_TRIES = 4


class _Moves(NamedTuple):
  """One step's moves on the boards (bool [B] masks, and the opponent's answers)."""

  won: np.ndarray  # the agent's move won
  filled: np.ndarray  # the agent's move filled the board without a win
  lost: np.ndarray  # the opponent's answer won
  opponent_filled: np.ndarray  # the opponent's answer filled the board without a win
  opponent_action: np.ndarray  # int64: the opponent's answer (-1: none)


class BoardGameEnv(base.TextEnv):
  """B episodes of `game` against `opponent`, as text (see the module docstring)."""

  def __init__(self, config: base.EnvConfig, game: base.BoardGame, opponent: opponents.Opponent):
    if config.game != game.name:
      raise ValueError(f'EnvConfig.game={config.game!r} does not match the game {game.name!r}.')
    if game.num_actions > 9:
      raise ValueError(f'{game.name} has {game.num_actions} actions; text moves are one digit.')
    self.config = config
    self.game = game
    self.opponent = opponent
    self._rng: np.random.Generator | None = None
    self._group_size = 1
    self._batch = 0  # n of the last reset: the draws are made for all of them
    self._rows = np.zeros(0, np.int64)  # the played episodes among the n
    self._boards: np.ndarray | None = None
    self._done = np.zeros(0, dtype=bool)
    self._turns = np.zeros(0, dtype=np.int64)
    self._last_opponent = np.zeros(0, dtype=np.int64)
    self._agent_first = np.zeros(0, dtype=bool)
    self._thoughts = np.zeros(0, dtype=np.int64)  # thinking replies since the last move
    self._hints = np.zeros(0, dtype=np.int64)  # the last thought's move (-1: none since a move)
    self._played = np.zeros((0, game.num_actions), dtype=bool)  # the moves the agent played
    self._illegal = np.zeros(0, dtype=bool)  # ended by a well-formed but illegal move
    self._games_left = np.zeros(0, dtype=np.int64)  # games of the match after the current one
    self._games_played = np.zeros(0, dtype=np.int64)  # games played to an outcome
    self._games_won = np.zeros(0, dtype=np.int64)
    self._outcomes: list[base.Outcome | None] = []

  @property
  def num_actions(self) -> int:
    return self.game.num_actions

  @property
  def max_turns(self) -> int:
    """The agent's moves in the full games of a match, each after up to `think_depth` thinking
    replies."""
    per_game = math.ceil(self.game.rows * self.game.cols / 2) * (1 + self.config.think_depth)
    return per_game * self.config.series_games

  @property
  def num_envs(self) -> int:
    return 0 if self._boards is None else len(self._boards)

  @property
  def boards(self) -> Int8[np.ndarray, 'B R W']:
    """A copy of the current boards (+1 the agent, -1 the opponent)."""
    self._check_reset()
    return self._boards.copy()

  @property
  def done(self) -> Bool[np.ndarray, ' B']:
    return self._done.copy()

  @property
  def outcomes(self) -> list[base.Outcome | None]:
    return list(self._outcomes)

  @property
  def turns(self) -> Int[np.ndarray, ' B']:
    """Agent turns played per episode."""
    return self._turns.copy()

  @property
  def thoughts(self) -> Int[np.ndarray, ' B']:
    """Thinking replies of each episode since its last move (`EnvConfig.think_depth`)."""
    return self._thoughts.copy()

  @property
  def agent_first(self) -> Bool[np.ndarray, ' B']:
    """Whether the agent made the first move of each episode."""
    return self._agent_first.copy()

  def episode_stats(self) -> dict[str, np.ndarray]:
    """Per episode (see `base.TextEnv.episode_stats`): `distinct_moves_mean`, how many distinct
    moves the agent played (Connect Four: columns; a policy that stacks one column plays 1),
    `illegal_rate`, 1 when a well-formed move the board did not allow (a full column, a
    taken cell) ended it: of the 'invalid' outcomes, those that are not a reply that does not
    parse (in a match: some game of it); `games_mean`, the games it played to an outcome (a
    match plays several: `EnvConfig.series_games`), and `games_won_mean`, how many it won."""
    return {
      'distinct_moves_mean': self._played.sum(axis=1).astype(np.float64),
      'illegal_rate': self._illegal.astype(np.float64),
      'games_mean': self._games_played.astype(np.float64),
      'games_won_mean': self._games_won.astype(np.float64),
    }

  def longest_observation(self) -> str:
    """See `base.TextEnv.longest_observation`: a running game's board with the move
    lines it can carry, a finished one's with its outcome (in a match followed by the next game's
    first observation, after at most the opponent's opening move), or a thought's hint."""
    game, config = self.game, self.config
    empty = np.zeros((1, game.rows, game.cols), dtype=np.int8)
    board = game.render(empty)[0] if config.observation == 'board' else f'o:{game.num_actions}\n'
    digits = ''.join(str(a + 1) for a in range(game.num_actions))

    def lines(legal: int) -> str:  # the move lines of a position with `legal` legal moves
      return (f'legal:{digits[:legal]}\n' if config.show_legal else '') + (
        f'illegal:{digits[legal:]}\n' if config.show_illegal and legal < len(digits) else ''
      )

    running = max((board + lines(k) for k in range(1, len(digits) + 1)), key=len)
    ended = board + 'invalid\n'
    if config.series_games > 1:
      openings = game.play(empty.repeat(len(digits), 0), np.arange(len(digits)), base.OPPONENT)
      fewest = int(game.legal_mask(openings).sum(axis=1).min())  # after any opening move
      ended += max(board + lines(len(digits)), board + lines(fewest), key=len)
    hint = f'h{config.think_depth + 1}:{game.num_actions}\n'
    return max((running, ended, hint), key=len)

  def legal_mask(self) -> Bool[np.ndarray, 'B A']:
    self._check_reset()
    return self.game.legal_mask(self._boards) & ~self._done[:, None]

  def _check_reset(self) -> None:
    if self._boards is None:
      raise RuntimeError('Call reset(n, seed) before using the environment.')

  def reset(
    self,
    n: int,
    seed: int,
    *,
    start_boards: Int8[np.ndarray, 'B R W'] | None = None,
    group_size: int = 1,
    rows: Sequence[int] | None = None,
    games: int | None = None,
  ) -> list[str]:
    """Starts n episodes (or the subset `rows` of them).

    Args:
      n: the number of episodes.
      seed: a non-negative int; the same seed and the same replies replay the same games.
      start_boards: optional positions to start from, agent to move in every episode
        (`config.agent_first` is then ignored); each must be running (no winner, not full).
        One per played episode.
      group_size: episodes per group sharing their random draws (must divide n).
      rows: play only these episodes of the n (distinct, in [0, n)); each draws what it would
        draw in the full batch, so it plays the same game (see `base.TextEnv.reset`).
      games: the games of each episode's match, in [1, `config.series_games`] (None: all of
        them); `start_boards` sets the first game's position only.

    Returns:
      The first observation of each played episode.
    """
    played = base.check_reset_args(n, seed, group_size, rows)
    most = self.config.series_games
    games = most if games is None else games
    if not isinstance(games, int) or isinstance(games, bool) or not 1 <= games <= most:
      raise ValueError(
        f'games must be an int in [1, EnvConfig.series_games={most}], got {games!r}.'
      )
    game = self.game
    rng = np.random.default_rng(seed)
    self._group_size = group_size
    self._batch = n
    self._rows = played
    coins = self._draw(rng, (n,))
    noise = self._draw(rng, (n, game.num_actions))
    n = played.size
    if start_boards is not None:
      boards = self._check_start_boards(start_boards, n)
      opponent_first = np.zeros(n, dtype=bool)
    else:
      boards = np.zeros((n, game.rows, game.cols), dtype=np.int8)
      opponent_first = self._opponent_first(coins)
    # The side to move first from here: the agent where a stacked game was played already.
    opens = opponent_first
    stacked_last = np.full(n, -1, dtype=np.int64)
    if start_boards is None and self.config.full_column_starts:
      boards, stacked_last = self._full_column(boards, opponent_first, rng)
      opens = opponent_first & (stacked_last < 0)
    if start_boards is None and self.config.opening_moves:
      boards = self._opening(boards, opens, rng)
    last_opponent = self._opponent_opens(boards, opens, noise)
    last_opponent = np.where(stacked_last >= 0, stacked_last, last_opponent)
    self._rng = rng
    self._boards = boards
    self._done = np.zeros(n, dtype=bool)
    self._turns = np.zeros(n, dtype=np.int64)
    self._last_opponent = last_opponent
    self._agent_first = ~opponent_first
    self._thoughts = np.zeros(n, dtype=np.int64)
    self._hints = np.full(n, -1, dtype=np.int64)
    self._played = np.zeros((n, game.num_actions), dtype=bool)
    self._illegal = np.zeros(n, dtype=bool)
    self._games_left = np.full(n, games - 1, dtype=np.int64)
    self._games_played = np.zeros(n, dtype=np.int64)
    self._games_won = np.zeros(n, dtype=np.int64)
    self._outcomes = [None] * n
    return self._observe(np.arange(n), [None] * n)

  def _opponent_first(self, coins: np.ndarray) -> Bool[np.ndarray, ' B']:
    """Whether the opponent moves first in each game (`EnvConfig.agent_first`; 'random':
    where its coin, uniform in [0, 1), is below 1/2)."""
    return {
      'always': np.zeros(coins.shape[0], dtype=bool),
      'never': np.ones(coins.shape[0], dtype=bool),
      'random': coins < 0.5,
    }[self.config.agent_first]

  def _opponent_opens(
    self,
    boards: Int8[np.ndarray, 'B R W'],
    opponent_first: Bool[np.ndarray, ' B'],
    noise: np.ndarray,
  ) -> Int[np.ndarray, ' B']:
    """Plays the opponent's first move on the boards where it moves first (in place, noise
    [B, A]); returns each board's move (-1: none)."""
    last_opponent = np.full(len(boards), -1, dtype=np.int64)
    first = np.flatnonzero(opponent_first)
    if first.size:
      moves = self.opponent.select(boards[first], base.OPPONENT, noise[first])
      boards[first] = self.game.play(boards[first], moves, base.OPPONENT)
      last_opponent[first] = moves
    return last_opponent

  def _full_column(
    self, boards: Int8[np.ndarray, 'B R W'], opponent_first: Bool[np.ndarray, ' B'], rng
  ) -> tuple[Int8[np.ndarray, 'B R W'], Int[np.ndarray, ' B']]:
    """One uniformly drawn column full, on a `full_column_starts` share of the boards (one
    draw shared by the episodes of a group; `EnvConfig.full_column_fill` says how it fills).

    Returns the boards and, where a stacked game filled the column (the agent to move next),
    the opponent's last move in it, else -1.
    """
    game = self.game
    draws = self._draw(rng, (self._batch, 2))
    stack = self.config.full_column_fill == 'stack'
    if stack:  # opponent noise for each ply of each try, drawn only where it is used
      plies = game.rows * game.cols
      tries = self._draw(rng, (self._batch, _STACK_TRIES, plies, game.num_actions))
    last = np.full(len(boards), -1, dtype=np.int64)
    idx = np.flatnonzero(draws[:, 0] < self.config.full_column_starts)
    columns = np.minimum((draws[idx, 1] * game.num_actions).astype(np.int64), game.num_actions - 1)
    if stack:
      games = {}  # one game per group: its episodes share the draws
      for i, column in zip(idx.tolist(), columns.tolist()):
        key = (draws[i, 1], bool(opponent_first[i]))
        if key not in games:
          games[key] = self._stacked(column, bool(opponent_first[i]), tries[i])
        if games[key] is not None:
          boards[i], last[i] = games[key]
    alternating = last[idx] < 0
    rest, rest_columns = idx[alternating], columns[alternating]
    if rest.size:
      for height in range(game.rows):
        side = base.OPPONENT if height % 2 == 0 else base.AGENT
        boards[rest] = game.play(boards[rest], rest_columns, side)
    return boards, last

  def _stacked(
    self, column: int, opponent_first: bool, tries: Float[np.ndarray, 'T P A']
  ) -> tuple[Int8[np.ndarray, 'R W'], int] | None:
    """The first of the tries' games in which the agent, stacking `column` against the
    opponent (its noise [plies, A] per try), fills the column with no line made and is then to
    move, with the opponent's last move (the opponent plays once more where the agent's stone
    filled it); None where every try's game ends first. The tries play side by side."""
    game = self.game
    t = len(tries)
    boards = np.zeros((t, game.rows, game.cols), dtype=np.int8)
    last = np.full(t, -1, dtype=np.int64)
    running, filled = np.ones(t, dtype=bool), np.zeros(t, dtype=bool)
    agent = not opponent_first
    for ply in range(tries.shape[1]):
      live = np.flatnonzero(running)
      if not live.size:
        break
      if agent:
        done = ~game.legal_mask(boards[live])[:, column]
        filled[live[done]], running[live[done]] = True, False
        live = live[~done]
        if not live.size:
          break
        boards[live] = game.play(boards[live], np.full(live.size, column), base.AGENT)
      else:
        moves = self.opponent.select(boards[live], base.OPPONENT, tries[live, ply])
        boards[live] = game.play(boards[live], moves, base.OPPONENT)
        last[live] = moves
      ended = (game.winner(boards[live]) != 0) | game.is_full(boards[live])
      running[live[ended]] = False
      agent = not agent
    if not filled.any():
      return None
    first = int(np.argmax(filled))
    return boards[first], int(last[first])

  def _opening(
    self, boards: Int8[np.ndarray, 'B R W'], opponent_first: Bool[np.ndarray, ' B'], rng
  ) -> Int8[np.ndarray, 'B R W']:
    """`opening_moves` uniformly random legal moves by each side, in turn from the side that
    moves first (one [n, 2k, A] draw, shared by the episodes of a group)."""
    game, k = self.game, self.config.opening_moves
    noise = self._draw(rng, (self._batch, 2 * k, game.num_actions))
    for ply in range(2 * k):
      opponent = opponent_first if ply % 2 == 0 else ~opponent_first
      scores = np.where(game.legal_mask(boards), noise[:, ply], -1.0)
      moves = scores.argmax(axis=1)
      for side, rows in ((base.OPPONENT, opponent), (base.AGENT, ~opponent)):
        idx = np.flatnonzero(rows)
        if idx.size:
          boards[idx] = game.play(boards[idx], moves[idx], side)
    return boards

  def _draw(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform draws of `shape` ([n, ...] for the whole batch), one per group of episodes and
    repeated over the group; the rows of the played episodes."""
    size = self._group_size
    return rng.random((shape[0] // size, *shape[1:])).repeat(size, axis=0)[self._rows]

  def _check_start_boards(self, start_boards: np.ndarray, n: int) -> np.ndarray:
    game = self.game
    want = (n, game.rows, game.cols)
    if start_boards.shape != want:
      raise ValueError(f'start_boards has shape {start_boards.shape}; expected {want}.')
    if not np.isin(start_boards, (base.OPPONENT, base.EMPTY, base.AGENT)).all():
      raise ValueError('start_boards cells must be -1, 0 or +1.')
    over = np.flatnonzero((game.winner(start_boards) != 0) | game.is_full(start_boards))
    if over.size:
      raise ValueError(f'start_boards {over.tolist()} are already won or full.')
    return start_boards.astype(np.int8, copy=True)

  def _observe(self, idx: Int[np.ndarray, ' Mc'], outcomes: Sequence[str | None]) -> list[str]:
    """The observations of episodes `idx`, with an outcome line where one is given."""
    if self.config.observation == 'board':
      texts = self.game.render(self._boards[idx])
    else:
      texts = ['o:-\n' if a < 0 else f'o:{a + 1}\n' for a in self._last_opponent[idx].tolist()]
    if self.config.show_legal or self.config.show_illegal:
      legal = self.game.legal_mask(self._boards[idx])
      moves = lambda mask: ''.join(str(a + 1) for a in np.flatnonzero(mask))  # noqa: E731
      lines = []
      for o, m in zip(outcomes, legal):
        line = ''
        if o is None and self.config.show_legal:
          line += f'legal:{moves(m)}\n'
        if o is None and self.config.show_illegal and not m.all():
          line += f'illegal:{moves(~m)}\n'
        lines.append(line)
      texts = [text + line for text, line in zip(texts, lines)]
    return [text if o is None else f'{text}{o}\n' for text, o in zip(texts, outcomes)]

  def step(self, actions: Sequence[str]) -> base.StepResult:
    """Plays one reply per episode; see `base.TextEnv.step`.

    Raises:
      RuntimeError: before `reset`.
      ValueError: `actions` is a single str or does not hold one reply per episode.
    """
    self._check_step(actions)
    # Drawn every step, whatever the replies: see the module docstring.
    return self._step(actions, self._draw(self._rng, (self._batch, self._noise_width)))

  @property
  def _noise_width(self) -> int:
    """A step's draws per episode: the opponent's noise, and in a match the next game's coin
    and opening noise."""
    actions = self.game.num_actions
    return actions if self.config.series_games == 1 else 2 * actions + 1

  # The per-episode state that `step` reads and writes (`step_many` batches it).
  _STATE = (
    '_boards',
    '_done',
    '_turns',
    '_last_opponent',
    '_agent_first',
    '_thoughts',
    '_hints',
    '_played',
    '_illegal',
    '_games_left',
    '_games_played',
    '_games_won',
  )

  @classmethod
  def step_many(
    cls, envs: Sequence['BoardGameEnv'], actions: Sequence[Sequence[str]]
  ) -> list[base.StepResult]:
    """Steps several environments of one config as one batch; see `base.TextEnv.step_many`.

    Each draws its own noise, as its `step` would, and the game logic runs once on all their
    boards, so that many small batches (a rollout's cohorts) cost about one step.
    """
    if len(envs) < 2 or any(e.config != envs[0].config for e in envs):
      return super().step_many(envs, actions)
    for env, replies in zip(envs, actions):
      env._check_step(replies)
    first = envs[0]
    noise = np.concatenate([e._draw(e._rng, (e._batch, e._noise_width)) for e in envs])
    merged = cls(first.config, first.game, first.opponent)
    for name in cls._STATE:
      setattr(merged, name, np.concatenate([getattr(e, name) for e in envs]))
    merged._outcomes = [o for e in envs for o in e._outcomes]
    result = merged._step([a for replies in actions for a in replies], noise)
    results, lo = [], 0
    for env in envs:
      hi = lo + env.num_envs
      for name in cls._STATE:
        setattr(env, name, getattr(merged, name)[lo:hi].copy())
      env._outcomes = merged._outcomes[lo:hi]
      results.append(
        base.StepResult(
          observations=result.observations[lo:hi],
          rewards=result.rewards[lo:hi],
          dones=result.dones[lo:hi],
          infos=result.infos[lo:hi],
          move_rewards=result.move_rewards[lo:hi],
        )
      )
      lo = hi
    return results

  def _check_step(self, actions: Sequence[str]) -> None:
    self._check_reset()
    num_envs = self.num_envs
    base.check_actions(actions, num_envs)

  def _step(self, actions: Sequence[str], noise: np.ndarray) -> base.StepResult:
    """`step` with the step's noise already drawn ([B, A] or, in a match, [B, 2A + 1]: the
    played episodes' rows)."""
    noise, opening = noise[:, : self.game.num_actions], noise[:, self.game.num_actions :]
    num_envs = self.num_envs
    active = ~self._done
    parsed, think, hints = self._read_replies(actions, active, noise)
    legal = active & (parsed >= 0)
    legal &= self.game.legal_mask(self._boards)[np.arange(num_envs), np.maximum(parsed, 0)]
    invalid = active & ~legal & ~think
    self._played[np.flatnonzero(legal), parsed[legal]] = True
    self._illegal |= invalid & (parsed >= 0)
    moves = self._play_moves(legal, parsed, noise)
    self._last_opponent[active] = moves.opponent_action[active]
    drawn = moves.filled | moves.opponent_filled
    rewards, move_rewards = self._rewards(moves.won, moves.lost, drawn, invalid, legal)
    for outcome, mask in (
      ('win', moves.won),
      ('loss', moves.lost),
      ('draw', drawn),
      ('invalid', invalid),
    ):
      for i in np.flatnonzero(mask).tolist():
        self._outcomes[i] = outcome
    turns = self._turns.tolist()
    self._turns[active] += 1
    self._thoughts[think] += 1
    self._thoughts[legal] = 0
    self._hints[legal] = -1
    ended = moves.won | moves.lost | drawn | invalid
    self._games_played += ended
    self._games_won += moves.won
    again = ended & (self._games_left > 0)  # the match goes on with its next game
    self._done |= ended & ~again
    infos = self._step_infos(active, parsed, legal, moves.opponent_action, turns, think, hints)
    observations = self._step_observations(active, think, hints)
    if again.any():
      self._next_game(np.flatnonzero(again), opening, observations)
    return base.StepResult(
      observations=observations,
      rewards=rewards,
      dones=self._done.copy(),
      infos=infos,
      move_rewards=move_rewards,
    )

  def _read_replies(
    self, actions: Sequence[str], active: Bool[np.ndarray, ' B'], noise: np.ndarray
  ) -> tuple[Int[np.ndarray, ' B'], Bool[np.ndarray, ' B'], Int[np.ndarray, ' B']]:
    """Each active episode's reply as a move (-1: none), whether it thinks ('t' within the
    budget), and the hints those thoughts get (-1 elsewhere); searches for the hints a reply
    plays ('h', or a thought past the budget) and records every new hint."""
    game, config = self.game, self.config
    parsed = np.full(self.num_envs, -1, dtype=np.int64)
    think = np.zeros(self.num_envs, dtype=bool)
    play_hint = np.zeros(self.num_envs, dtype=bool)
    for i in np.flatnonzero(active).tolist():
      reply = actions[i].strip() if config.think_depth and isinstance(actions[i], str) else None
      if reply == base.THINK and self._thoughts[i] < config.think_depth:
        think[i] = True
      elif reply in (base.THINK, base.PLAY_HINT):  # a thought past the budget plays its move
        play_hint[i] = True
      else:
        action = base.parse_action(actions[i], game.num_actions, config.parse)
        if action is not None:
          parsed[i] = action
    unthought = np.flatnonzero(play_hint & (self._thoughts == 0))
    self._hints[unthought] = self._search(unthought, np.ones_like(unthought), noise)[unthought]
    parsed[play_hint] = self._hints[play_hint]
    thinking = np.flatnonzero(think)
    hints = self._search(thinking, self._thoughts[thinking] + 2, noise)
    self._hints[thinking] = hints[thinking]
    return parsed, think, hints

  def _play_moves(
    self, legal: Bool[np.ndarray, ' B'], parsed: Int[np.ndarray, ' B'], noise: np.ndarray
  ) -> '_Moves':
    """Plays the legal moves on the boards, then the opponent's answers where the game goes on."""
    game, boards, num_envs = self.game, self._boards, self.num_envs
    won = np.zeros(num_envs, dtype=bool)
    filled = np.zeros(num_envs, dtype=bool)
    moved = np.flatnonzero(legal)
    if moved.size:
      boards[moved] = game.play(boards[moved], parsed[moved], base.AGENT)
      won[moved] = game.winner(boards[moved]) == base.AGENT
      filled[moved] = game.is_full(boards[moved]) & ~won[moved]

    lost = np.zeros(num_envs, dtype=bool)
    opponent_filled = np.zeros(num_envs, dtype=bool)
    opponent_action = np.full(num_envs, -1, dtype=np.int64)
    answer = np.flatnonzero(legal & ~won & ~filled)
    if answer.size:
      replies = self.opponent.select(boards[answer], base.OPPONENT, noise[answer])
      boards[answer] = game.play(boards[answer], replies, base.OPPONENT)
      opponent_action[answer] = replies
      lost[answer] = game.winner(boards[answer]) == base.OPPONENT
      opponent_filled[answer] = game.is_full(boards[answer]) & ~lost[answer]
    return _Moves(won, filled, lost, opponent_filled, opponent_action)

  def _rewards(self, won, lost, drawn, invalid, legal) -> tuple[np.ndarray, np.ndarray]:
    """f32 [B] each: the step's reward of each episode, and the part of it that the reply
    itself earned (`StepResult.move_rewards`: a legal move's bonus, an invalid reply's
    penalty) (all bool [B] masks)."""
    config = self.config
    move = np.zeros(self.num_envs, dtype=np.float32)
    move[invalid] = config.invalid_penalty
    move[legal] = config.legal_move_reward
    rewards = move.copy()
    rewards[won] += config.win_reward
    rewards[lost] += config.loss_reward
    rewards[drawn] += config.draw_reward
    return rewards, move

  def _step_observations(self, active, think, hints) -> list[str]:
    """The next observation of each episode: the board (with the outcome of a finished one),
    a thinking reply's hint, or '' for an episode that had already ended."""
    observations = [''] * self.num_envs
    shown = np.flatnonzero(active & ~think)
    if shown.size:
      texts = self._observe(shown, [self._outcomes[i] for i in shown.tolist()])
      for i, text in zip(shown.tolist(), texts):
        observations[i] = text
    for i in np.flatnonzero(think).tolist():
      observations[i] = f'h{self._thoughts[i] + 1}:{hints[i] + 1}\n'
    return observations

  def _next_game(
    self, idx: Int[np.ndarray, ' Mc'], opening: np.ndarray, observations: list[str]
  ) -> None:
    """Starts the next game of the matches `idx` (their game just ended): a fresh board, the
    coin `opening[:, 0]` for who moves first ('random'), the opponent's opening move from
    `opening[:, 1:]`; appends the game's first observation to theirs."""
    game = self.game
    boards = np.zeros((idx.size, game.rows, game.cols), dtype=np.int8)
    opponent_first = self._opponent_first(opening[idx, 0])
    self._last_opponent[idx] = self._opponent_opens(boards, opponent_first, opening[idx, 1:])
    self._boards[idx] = boards
    self._games_left[idx] -= 1
    self._thoughts[idx] = 0
    self._hints[idx] = -1
    for i in idx.tolist():
      self._outcomes[i] = None
    for i, text in zip(idx.tolist(), self._observe(idx, [None] * idx.size)):
      observations[i] += text

  def _step_infos(
    self, active, parsed, legal, opponent_action, turns, think, hints
  ) -> list[base.StepInfo]:
    parsed_list, legal_list, reply_list = parsed.tolist(), legal.tolist(), opponent_action.tolist()
    return [
      {
        'outcome': self._outcomes[i],
        'parsed_action': parsed_list[i] if parsed_list[i] >= 0 else None,
        'legal': legal_list[i],
        'turn': turns[i],
        'opponent_action': reply_list[i] if reply_list[i] >= 0 else None,
        'ignored': not is_active,
        'hint': int(hints[i]) if think[i] else None,
      }
      for i, is_active in enumerate(active.tolist())
    ]

  def _search(
    self, idx: Int[np.ndarray, ' Mc'], depths: Int[np.ndarray, ' Mc'], noise: np.ndarray
  ) -> Int[np.ndarray, ' B']:
    """The agent's best move in episodes `idx` by minimax searches of `depths` plies, ties
    broken by the noise (-1 elsewhere); one batched search per depth."""
    hints = np.full(self.num_envs, -1, dtype=np.int64)
    for depth in np.unique(depths).tolist():
      rows = idx[depths == depth]
      search = opponents.MinimaxOpponent(self.game, depth)  # plays for the agent here
      hints[rows] = search.select(self._boards[rows], base.AGENT, noise[rows])
    return hints
