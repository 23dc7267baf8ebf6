"""Batched multi-turn text environments: the API, its config, and the pieces games share.

An environment runs B episodes side by side. Each agent turn it hands out one text observation per
episode and takes one reply text per episode::

  env = registry.make_env(EnvConfig(game='connect_four', opponent='random'))
  observations = env.reset(n=256, seed=0)      # list[str], one per episode
  result = env.step(replies)                   # replies: one str per episode
  result.observations, result.rewards, result.dones, result.infos

Episodes end at different times. Stepping an episode that has already ended is allowed: its reply
is ignored and it returns reward 0, done True and the observation ''.

Two families share this API. The code tasks (`CodeEnvConfig`; `code_env`, `repo_repair`) take
free-text replies: a function to write, or commands for a small repository; they have no finite
action set (`TextEnv.num_actions` is None). The board games (`EnvConfig`) are played by the agent
against a built-in opponent. Boards are int8 arrays seen from the agent: `AGENT` (+1, rendered
'X') for its stones, `OPPONENT` (-1, 'O') for the opponent's, `EMPTY` (0, '.') for free cells.
Actions are 0-based indices (a column or a cell) in the Python API and the digits '1'..'9'
(index + 1) in text.

Every board-game observation uses only the characters of `ALPHABET`, the vocabulary of the
built-in character-level game tokenizer; every code observation is printable ASCII, tab and
newline (the code tokenizer's alphabet).

Dimension letters (the package alphabet of `earl_jax.config`): B episodes of a batch, M positions
(any stack of boards; Mc, Mp for the children and parents of a search), R board rows, W board
columns, A actions.
"""

import abc
import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any, Literal, TypedDict, get_args

import numpy as np
from jaxtyping import Bool, Float, Int, Int8, Int64

from earl_jax.config import check_float32
from earl_jax.errors import ConfigError
from earl_jax.sandbox import SandboxConfig

# Every character an observation may contain (the built-in tokenizer is character level).
ALPHABET = '0123456789abcdefghijklmnopqrstuvwxyzXO .\n|:-'

# Cell values of a board, always from the agent's point of view.
AGENT = 1
OPPONENT = -1
EMPTY = 0

GameName = Literal['connect_four', 'tic_tac_toe']
OpponentName = Literal['random', 'greedy', 'minimax']
AgentFirst = Literal['always', 'never', 'random']
ObservationMode = Literal['board', 'last_move']
ParseMode = Literal['strict', 'lenient']
Outcome = Literal['win', 'loss', 'draw', 'invalid']

GAMES: tuple[str, ...] = get_args(GameName)
OPPONENTS: tuple[str, ...] = get_args(OpponentName)
AGENT_FIRST: tuple[str, ...] = get_args(AgentFirst)
OBSERVATION_MODES: tuple[str, ...] = get_args(ObservationMode)
FullColumnFill = Literal['alternating', 'stack']
FULL_COLUMN_FILLS: tuple[str, ...] = get_args(FullColumnFill)
PARSE_MODES: tuple[str, ...] = get_args(ParseMode)
OUTCOMES: tuple[str, ...] = get_args(Outcome)

# The search is exponential in depth (about 7**depth positions per Connect Four move); past 9
# plies Tic-Tac-Toe is already solved and Connect Four far too slow.
MAX_MINIMAX_DEPTH = 9
# Thoughts before a move; the last searches one ply more (a few batched searches per step; a
# 6-ply search of 64 Connect Four boards takes about 0.1-0.5 s).
MAX_THINK_DEPTH = 5
# Random opening moves per side, one fewer than a winning line has stones.
MAX_OPENING_MOVES = {'connect_four': 3, 'tic_tac_toe': 2}
MAX_SERIES_GAMES = 256
# The replies that think instead of moving, and that play the move thought of
# (`EnvConfig.think_depth`).
THINK = 't'
PLAY_HINT = 'h'


def _check_choice(field: str, value: Any, known: tuple[str, ...]) -> None:
  if value not in known:
    raise ValueError(f'EnvConfig.{field}={value!r} is unknown; known values: {list(known)}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
  """What game, against whom, and how text maps to moves.

  Attributes:
    game: 'connect_four' (6x7, columns '1'..'7') or 'tic_tac_toe' (3x3, cells '1'..'9').
    opponent: 'random' (uniform over legal moves), 'greedy' (takes an immediate win, else blocks
      the agent's immediate win, else random) or 'minimax' (depth-limited search).
    minimax_depth: plies searched by the minimax opponent, counting its own move (1..9).
    win_reward: reward of the agent's last step when it wins.
    draw_reward: ... when the board fills up without a winner.
    loss_reward: ... when the opponent wins.
    invalid_penalty: reward for a reply that does not parse or names an illegal move (full
      column, occupied cell, out of range). That episode ends with outcome 'invalid'.
    legal_move_reward: reward for every legal move the agent plays (a format bonus; 0 by
      default). A small value gives an untrained policy a learning signal long before it can
      finish a game: episodes that keep playing legal moves score higher.
    agent_first: who moves first in each episode: 'always' the agent, 'never' (the opponent's first
      move is already on the board in the first observation), or 'random': a fair coin per
      episode, drawn from the reset seed. The default is 'random' so that a policy learns both
      sides and a random agent scores about 50% against the random opponent; use 'always' for
      the easier, first-player-only task.
    observation: 'board' shows the whole board every turn (the default); 'last_move' shows only
      the opponent's last move ('o:4' or 'o:-' when it has not moved), for long-context runs in
      which the agent must track the game from its own history.
    show_legal: end every observation of a running episode with a line listing the legal moves
      ('legal:1237'), as text-game environments for LLM agents usually do. The policy then finds
      out whether a column is full from a short list next to its reply, instead of from one cell
      of the board far back in the context.
    show_illegal: end every observation of a running episode in which some move is illegal with
      a line listing those moves ('illegal:4' once column 4 is full; no line while every move is
      legal). The line appears exactly when it matters, so a policy that favours one move learns
      to leave it once that move is gone from a salient cue, not from a digit missing in a list.
    parse: 'strict' accepts a reply only if, stripped of surrounding whitespace, it is exactly one
      in-range digit; 'lenient' takes the last in-range digit that stands alone (no ASCII letter
      or digit right before or after it) anywhere in the reply, for chatty LLM replies.
    think_depth: how many times a policy may think before a move (0: no thinking). Two more
      replies exist then. `THINK` ('t') plays no move: the k-th thought since the episode's last
      move searches k + 1 plies and answers with the observation 'h<k+1>:<digit>\\n', the move
      that minimax search found (ties broken by the step's noise); the opponent does not move
      and the reward is 0. `PLAY_HINT` ('h') plays the move of a search one ply deeper than the
      thoughts so far, like the digit it names: without a thought a 1-ply search, after k
      thoughts the move the last one showed. A thought past `think_depth` plays that move too:
      the budget is spent, and the search stops where it is. So a policy turns tokens into better moves: every thought is one more
      round of context and one more ply, and the episodes of a policy that learns to think grow
      inside each move, as an LLM's reasoning grows inside its turn.
    opening_moves: uniformly random legal moves each side plays before the agent's first reply
      (exploring starts: the episodes start from varied positions, so a policy meets full
      columns and blocked lines in more ways than its own play would lead it to). Drawn from
      the reset seed, after the first-move coin and in turn from the side that moves first;
      0 (the default) draws nothing. At most `MAX_OPENING_MOVES`, fewer than any line needs,
      so an opening never ends a game. For training episodes; an evaluation's config keeps 0.
    full_column_starts: the share of episodes (drawn per group from the reset seed) that start
      with one column, drawn uniformly, already full of alternating stones (Connect Four only):
      the state in which a policy that stacks one column loses by playing into it, met from the
      first step in every column rather than only once the policy has collapsed onto one, when
      the gradient that would move it off has vanished (docs/results/main-job.md, "Where the
      default plateaus"). A column of alternating stones makes no line. Drawn after the
      first-move coins and before `opening_moves`; 0 draws nothing (the `default` preset: 0.5).
      For training episodes; an evaluation's config keeps 0.
    full_column_fill: how a full-column start fills its column. 'alternating' (the default):
      alternating stones, the opponent's at the bottom, on an empty board. 'stack': the game a
      policy that stacks that column plays against the opponent, from the episode's first-move
      coin, until the column is full and the agent is to move: the agent's stones in the column
      under the opponent's interruptions, the opponent's other stones on the board, the state
      in which the stacking policy's evaluation games are lost. Where that game ends first (a
      line of four) in each of 4 tries (about 30% of the starts), the alternating column.
      Tried on the default and not kept (docs/results/tried.md).
    series_games: the games of one episode, played one after the other in one context (a
      match, 1 by default): when a game ends and the match goes on, the observation is the
      final board with its outcome line followed by the next game's first observation (a fresh
      board, a new coin for who moves first, the opponent's opening move when it starts). Each
      game's reward comes at the step that ends it; an invalid reply forfeits its game
      (`invalid_penalty`), and the match goes on. The agent's context grows with every game, as
      an agent's grows with every tool call it reads: a long-context task on the same game, its
      evaluation unchanged. `reset(..., games=g)` plays g <= series_games of them
      (`ExperimentConfig.series_schedule`).
      At most `MAX_SERIES_GAMES`.
  """

  game: GameName = 'connect_four'
  opponent: OpponentName = 'random'
  minimax_depth: int = 4
  win_reward: float = 1.0
  draw_reward: float = 0.0
  loss_reward: float = -1.0
  invalid_penalty: float = -1.0
  legal_move_reward: float = 0.0
  agent_first: AgentFirst = 'random'
  observation: ObservationMode = 'board'
  show_legal: bool = False
  show_illegal: bool = False
  parse: ParseMode = 'strict'
  think_depth: int = 0
  opening_moves: int = 0
  full_column_starts: float = 0.0
  full_column_fill: FullColumnFill = 'alternating'
  series_games: int = 1

  def __post_init__(self):
    _check_choice('game', self.game, GAMES)
    _check_choice('opponent', self.opponent, OPPONENTS)
    _check_choice('agent_first', self.agent_first, AGENT_FIRST)
    _check_choice('observation', self.observation, OBSERVATION_MODES)
    _check_choice('parse', self.parse, PARSE_MODES)
    _check_choice('full_column_fill', self.full_column_fill, FULL_COLUMN_FILLS)
    for field in ('show_legal', 'show_illegal'):
      if not isinstance(getattr(self, field), bool):
        raise ConfigError(f'EnvConfig.{field} must be a bool, got {getattr(self, field)!r}.')
    depth = self.minimax_depth
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_MINIMAX_DEPTH:
      raise ConfigError(
        f'EnvConfig.minimax_depth must be an int in [1, {MAX_MINIMAX_DEPTH}], got {depth!r}.'
      )
    think = self.think_depth
    if not isinstance(think, int) or isinstance(think, bool) or not 0 <= think <= MAX_THINK_DEPTH:
      raise ConfigError(
        f'EnvConfig.think_depth must be an int in [0, {MAX_THINK_DEPTH}], got {think!r}.'
      )
    opening = self.opening_moves
    most = MAX_OPENING_MOVES[self.game]
    if not isinstance(opening, int) or isinstance(opening, bool) or not 0 <= opening <= most:
      raise ConfigError(
        f'EnvConfig.opening_moves must be an int in [0, {most}] for {self.game} (a side that '
        f'plays more could win in the opening), got {opening!r}.'
      )
    share = self.full_column_starts
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share <= 1:
      raise ConfigError(f'EnvConfig.full_column_starts must be in [0, 1], got {share!r}.')
    if share and self.game != 'connect_four':
      raise ConfigError(
        f'EnvConfig.full_column_starts is for connect_four (a column game), got {share!r} '
        f'for {self.game}.'
      )
    games = self.series_games
    if not isinstance(games, int) or isinstance(games, bool) or not 1 <= games <= MAX_SERIES_GAMES:
      raise ConfigError(
        f'EnvConfig.series_games must be an int in [1, {MAX_SERIES_GAMES}], got {games!r}.'
      )
    check_float32(
      self, 'win_reward', 'draw_reward', 'loss_reward', 'invalid_penalty', 'legal_move_reward'
    )

  def replace(self, **changes: Any) -> 'EnvConfig':
    return dataclasses.replace(self, **changes)


CodeTaskName = Literal['functions', 'humaneval', 'repo_repair', 'swe']
ToolFormat = Literal['plain', 'qwen']
CodeSplit = Literal['train', 'heldout']
CodeReward = Literal['fraction', 'all']

CODE_TASKS: tuple[str, ...] = get_args(CodeTaskName)
CODE_SPLITS: tuple[str, ...] = get_args(CodeSplit)
CODE_REWARDS: tuple[str, ...] = get_args(CodeReward)
TOOL_FORMATS: tuple[str, ...] = get_args(ToolFormat)
SWE_FORMATS = ('earl', 'swebench', 'swesmith')  # earl_jax.swe.instances.FORMATS
# Agent turns of an episode when `CodeEnvConfig.max_turns` is None.
DEFAULT_CODE_TURNS = {'functions': 1, 'humaneval': 1, 'repo_repair': 8, 'swe': 12}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeEnvConfig:
  """A code task: what to write, how many turns, how it is rewarded, and the sandbox's limits.

  The board games' `EnvConfig` and this config are the two families of one registry
  (`registry.make_env` takes either; `ExperimentConfig.env` holds either).

  Attributes:
    task: 'functions' (the generated one-line functions of `code_tasks`, for the tiny model),
      'humaneval' (the 164 HumanEval problems), 'repo_repair' (fix a planted bug in a small
      generated repository with text tools; `repo_repair`) or 'swe' (fix a bug in a real
      project, from `swe_tasks`, with tools; `swe_env`).
    split: the generated tasks played: 'train' or 'heldout' (disjoint; 'functions' and
      'repo_repair'; HumanEval has one set of 164 and ignores it).
    split_seed: the shuffle that splits the generated tasks; the same seed, the same split.
    heldout_fraction: the share of the generated tasks held out, in (0, 1).
    max_turns: agent turns per episode. For 'functions' and 'humaneval', attempts: after a
      failed attempt the next observation shows the failing public tests, until they pass or the
      turns run out (1: single turn). For 'repo_repair', commands, the last of which submits.
      None: 1, 1 and 8.
    reward: 'fraction' of the hidden tests passed by the final attempt, or 'all' (1 when every
      hidden test passes, else 0). None: 'fraction' for 'functions' and 'humaneval', 'all' for
      'repo_repair' (whose hidden tests also cover the functions without the bug, so a
      repository left as it was would keep most of a fraction).
    invalid_reward: the reward of an episode ended by a reply that does not parse (no code, an
      unknown command) or is longer than `max_reply_chars`.
    max_reply_chars: the longest reply read; a longer one ends the episode as invalid.
    feedback_tests: failing public tests shown after a failed attempt.
    feedback_chars: each feedback line is cut to this many characters.
    output_chars: the characters of a command's output kept ('repo_repair': half from the head,
      half from the tail).
    sandbox: the limits and workers of the sandbox that runs the programs ('swe' raises each
      limit to what a project's test suite needs: `swe_env.suite_sandbox`).
    swe_tasks: 'swe': the instances' JSONL (built by experiments/build_swe_tasks.py; the trees
      in `repos/` beside it, or `swe_repos`).
    swe_format: 'swe': the JSONL's format, 'earl' (ours), 'swebench' (SWE-bench, SWE-Gym,
      R2E-Gym) or 'swesmith' (`earl_jax.swe.instances`); check foreign instances first with
      experiments/swe_agents.py.
    swe_repos: 'swe': the directory of the repositories ('' = `repos/` beside `swe_tasks`).
    swe_python: 'swe': the interpreter that runs the tests ('' = a virtualenv with each
      instance's requirements, made once under `swe_cache`).
    swe_cache: 'swe': where those virtualenvs are cached (not under /tmp, which the sandbox
      hides).
    tool_format: 'swe': how replies call tools: 'plain' commands or 'qwen' (Qwen2.5's
      <tool_call> JSON; the tools are declared in the system prompt).
  """

  task: CodeTaskName = 'functions'
  split: CodeSplit = 'train'
  split_seed: int = 0
  heldout_fraction: float = 0.2
  max_turns: int | None = None
  reward: CodeReward | None = None
  invalid_reward: float = 0.0
  max_reply_chars: int = 2048
  feedback_tests: int = 2
  feedback_chars: int = 200
  output_chars: int = 1200
  sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
  swe_tasks: str = 'runs/swe_tasks/instances.jsonl'
  swe_format: str = 'earl'
  swe_repos: str = ''
  swe_python: str = ''
  swe_cache: str = '.earl_cache/swe/venvs'
  tool_format: ToolFormat = 'plain'

  def __post_init__(self):
    checks = (
      ('task', CODE_TASKS), ('split', CODE_SPLITS), ('reward', CODE_REWARDS),
      ('tool_format', TOOL_FORMATS), ('swe_format', SWE_FORMATS),
    )  # fmt: skip
    for field, known in checks:
      value = getattr(self, field)
      if value not in known and not (field == 'reward' and value is None):
        raise ConfigError(
          f'CodeEnvConfig.{field}={value!r} is unknown; known values: {list(known)}.'
        )
    least = {
      'split_seed': 0,
      'max_reply_chars': 1,
      'feedback_tests': 1,
      'feedback_chars': 20,
      'output_chars': 80,
    }
    for field, low in least.items():
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f'CodeEnvConfig.{field} must be an int >= {low}, got {value!r}.')
    turns = self.max_turns
    low = 2 if self.task == 'repo_repair' else 1
    if turns is not None and (not isinstance(turns, int) or isinstance(turns, bool) or turns < low):
      raise ConfigError(
        f'CodeEnvConfig.max_turns must be None or an int >= {low} for task {self.task!r}, '
        f'got {turns!r}.'
      )
    fraction = self.heldout_fraction
    if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0 < fraction < 1:
      raise ConfigError(f'CodeEnvConfig.heldout_fraction must be in (0, 1), got {fraction!r}.')
    check_float32(self, 'invalid_reward')
    for field in ('swe_tasks', 'swe_repos', 'swe_python', 'swe_cache'):
      if not isinstance(getattr(self, field), str):
        raise ConfigError(f'CodeEnvConfig.{field} must be a str, got {getattr(self, field)!r}.')
    if self.task == 'swe' and not self.swe_tasks:
      raise ConfigError('CodeEnvConfig.swe_tasks is empty: expected the instances JSONL.')
    if not isinstance(self.sandbox, SandboxConfig):
      raise ConfigError(f'CodeEnvConfig.sandbox must be a SandboxConfig, got {self.sandbox!r}.')

  @property
  def turns(self) -> int:
    """`max_turns`, or the task's default when it is None."""
    return DEFAULT_CODE_TURNS[self.task] if self.max_turns is None else self.max_turns

  def reward_of(self, passed: int, total: int) -> float:
    """The reward of a final attempt that passed `passed` of `total` hidden tests."""
    mode = self.reward or ('all' if self.task == 'repo_repair' else 'fraction')
    if not total:
      return 0.0
    return passed / total if mode == 'fraction' else float(passed == total)

  def replace(self, **changes: Any) -> 'CodeEnvConfig':
    return dataclasses.replace(self, **changes)


# The configuration of any environment family (`registry.make_env` takes either).
AnyEnvConfig = EnvConfig | CodeEnvConfig


class StepInfo(TypedDict):
  """Per-episode facts about one step.

  Keys:
    outcome: None while the episode runs, else 'win', 'loss', 'draw' or 'invalid'. An episode
      that had already ended keeps reporting its outcome.
    parsed_action: the 0-based action read from the reply (text '4' -> 3), or None if the reply
      did not parse or was ignored.
    legal: whether the reply was a legal move that got played.
    turn: the 0-based index of the agent turn this step played (for an ignored step: the number
      of turns the episode took).
    opponent_action: the opponent's 0-based reply to this move, or None if it did not move.
    ignored: True when the episode had ended before this step (its reply was ignored).
    hint: for a thinking reply (`EnvConfig.think_depth`), the 0-based move its search found, else
      None.
  """

  outcome: Outcome | None
  parsed_action: int | None
  legal: bool
  turn: int
  opponent_action: int | None
  ignored: bool
  hint: int | None


class CodeStepInfo(TypedDict):
  """Per-episode facts about one step of a code environment.

  Keys:
    outcome: None while the episode runs; at its end 'win' (every hidden test passed), 'loss'
      (some failed; the reward is their fraction or 0, `CodeEnvConfig.reward`) or 'invalid' (the
      reply did not parse or was too long). An episode that had already ended keeps it.
    turn: the 0-based index of the agent turn this step played (for an ignored step: the number
      of turns the episode took).
    ignored: True when the episode had ended before this step (its reply was ignored).
    task_id: the episode's task.
    status: the sandbox's verdict of the program this step ran ('pass', 'fail', 'timeout',
      'memory', 'crash', 'error'), or None if it ran none.
    passed / total: hidden tests passed and run (0 / 0 until a program is judged on them).
    public_passed / public_total: the same for the public tests.
  """

  outcome: Outcome | None
  turn: int
  ignored: bool
  task_id: str
  status: str | None
  passed: int
  total: int
  public_passed: int
  public_total: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepResult:
  """What `TextEnv.step` returns for a batch of B episodes.

  Attributes:
    observations: the next observation of each episode; a finished episode's last observation ends
      with a line naming its outcome, and an episode that had already finished gets ''.
    rewards: float32 [B]; the step's reward: where the episode got to (nonzero on the step that
      ends it) plus what the reply itself earned (`move_rewards`).
    dones: bool [B]; True once an episode has ended, and from then on.
    infos: one `StepInfo` (board games) or `CodeStepInfo` (code tasks) per episode.
    move_rewards: float32 [B], the part of `rewards` that judges the reply itself rather than
      where the episode went: a legal move's bonus (`EnvConfig.legal_move_reward`), an invalid
      reply's penalty (`invalid_penalty`; the episode, or a match's game, then ends with neither
      a win nor a loss). None: zeros, the whole reward is the episode's. With turn credit it
      counts for its own turn alone (`AdvantageConfig.move_credit`).
  """

  observations: list[str]
  rewards: Float[np.ndarray, ' B']
  dones: Bool[np.ndarray, ' B']
  infos: list[StepInfo] | list[CodeStepInfo]
  move_rewards: Float[np.ndarray, ' B'] | None = None

  def __post_init__(self):
    n = len(self.observations)
    if self.rewards.shape != (n,) or self.dones.shape != (n,) or len(self.infos) != n:
      raise ValueError(
        f'StepResult for {n} observations got rewards {self.rewards.shape}, dones '
        f'{self.dones.shape} and {len(self.infos)} infos.'
      )
    if self.rewards.dtype != np.float32 or self.dones.dtype != np.bool_:
      raise ValueError(
        f'StepResult wants float32 rewards and bool dones, got {self.rewards.dtype} and '
        f'{self.dones.dtype}.'
      )
    if self.move_rewards is None:
      object.__setattr__(self, 'move_rewards', np.zeros(n, np.float32))
    elif self.move_rewards.shape != (n,) or self.move_rewards.dtype != np.float32:
      raise ValueError(
        f'StepResult for {n} observations wants float32 move_rewards of shape ({n},), got '
        f'{self.move_rewards.dtype} {self.move_rewards.shape}.'
      )


class TextEnv(abc.ABC):
  """A batch of B multi-turn text episodes: `reset`, then `step` until every episode is done.

  Environments with a finite action set (the board games) override `num_actions` and
  `legal_mask`; those whose replies are free text (the code tasks) keep the defaults:
  `num_actions` is None and the action methods raise TypeError.
  """

  config: AnyEnvConfig

  @property
  def num_actions(self) -> int | None:
    """A, the number of distinct actions (columns or cells), text '1'..str(A); None when
    replies are free text."""
    return None

  @property
  @abc.abstractmethod
  def max_turns(self) -> int:
    """The most agent turns an episode can take."""

  @property
  @abc.abstractmethod
  def num_envs(self) -> int:
    """B, the batch size of the last `reset` (0 before it)."""

  @abc.abstractmethod
  def reset(
    self, n: int, seed: int, *, group_size: int = 1, rows: Sequence[int] | None = None
  ) -> list[str]:
    """Starts n episodes, deterministically given `seed`; returns their first observations.

    Consecutive groups of `group_size` episodes share their random draws (start and opponent
    randomness), so they differ only by the agent's replies. With `rows`, only those episodes
    of the n are played (in that order; `num_envs` is then len(rows)), and each plays exactly
    the game it would play in the full batch: the random draws are those of all n. One process
    of a multi-process run plays the rows its devices hold this way.
    """

  @abc.abstractmethod
  def step(self, actions: Sequence[str]) -> StepResult:
    """Plays one agent reply per episode (and a board game's opponent answer); never raises on
    bad text."""

  def episode_stats(self) -> dict[str, Float[np.ndarray, ' B']]:
    """Numbers the environment reports per episode of the last `reset` for the run's metrics
    (e.g. a code task's programs run), each a float per played episode; the same names for
    every reset of one environment class (default: none).

    Every step record holds each as `env/<name>`, over the whole batch (`metrics.env_record`):
    a name ending in '_rate' or '_mean' is averaged over the episodes, any other summed (a
    count, or seconds when it ends in '_s').
    """
    return {}

  def longest_observation(self) -> str | None:
    """A text as long as the longest observation a step can return, which the largest prompt
    bucket must hold (`ExperimentConfig.check_tokenizer`); None (the default) where the
    environment cannot bound it (a code task's feedback is cut by its own limits)."""
    return None

  @classmethod
  def step_many(
    cls, envs: Sequence['TextEnv'], actions: Sequence[Sequence[str]]
  ) -> list[StepResult]:
    """`env.step(replies)` for each environment and its replies, with the same results and
    states; an environment may batch them (the rollout engine steps its cohorts this way)."""
    return [env.step(replies) for env, replies in zip(envs, actions)]

  def legal_mask(self) -> Bool[np.ndarray, 'B A']:
    """Which actions are legal now, per episode; all False for a finished episode.

    Raises:
      TypeError: the environment takes free-text replies (`num_actions` is None).
    """
    raise self._no_actions()

  def legal_moves(self) -> list[list[int]]:
    """The legal 0-based actions of each episode now ([] for a finished episode)."""
    return [np.flatnonzero(row).tolist() for row in self.legal_mask()]

  def _no_actions(self) -> TypeError:
    return TypeError(
      f'{type(self).__name__} takes free-text replies; it has no finite action set '
      '(num_actions is None).'
    )

  def action_text(self, action: int) -> str:
    """The reply text that plays 0-based `action`."""
    if self.num_actions is None:
      raise self._no_actions()
    if not 0 <= action < self.num_actions:
      raise ValueError(f'action {action} is out of range [0, {self.num_actions}).')
    return str(action + 1)


def check_reset_args(n: int, seed: int, group_size: int, rows: Sequence[int] | None) -> np.ndarray:
  """The played rows of `reset(n, seed, group_size=..., rows=...)`, after checking every argument.

  Raises:
    ValueError: bad n, seed, group_size or rows, each named.
  """
  if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
    raise ValueError(f'reset needs a positive number of episodes, got n={n!r}.')
  if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
    raise ValueError(f'reset needs a non-negative int seed, got {seed!r}.')
  if not isinstance(group_size, int) or group_size <= 0 or n % group_size:
    raise ValueError(f'reset: group_size={group_size!r} must be a positive divisor of n={n}.')
  played = np.arange(n) if rows is None else np.asarray(list(rows), np.int64)
  if (
    played.size == 0
    or len(set(played.tolist())) != played.size
    or not ((played >= 0).all() and (played < n).all())
  ):
    raise ValueError(f'reset: rows must be distinct episodes in [0, {n}), got {list(played)}.')
  return played


def check_actions(actions: Sequence[str], num_envs: int) -> None:
  """Raises ValueError unless `actions` holds one reply per episode (and is not a single str)."""
  if isinstance(actions, str) or len(actions) != num_envs:
    got = 'a single str' if isinstance(actions, str) else f'{len(actions)} replies'
    raise ValueError(f'step needs one reply per episode ({num_envs}), got {got}.')


class BoardGame(abc.ABC):
  """The rules of a two-player board game, vectorised over a stack of boards.

  Boards are int8 [M, R, W] with +1, -1 and 0 cells. `player` is +1 or -1, the side to move or
  to evaluate for. Implementations keep every method free of Python loops over positions.
  """

  name: str
  rows: int
  cols: int
  num_actions: int
  # Text placed above the rendered rows (e.g. the column numbers), possibly ''.
  header: str

  @abc.abstractmethod
  def legal_mask(self, boards: Int8[np.ndarray, 'M R W']) -> Bool[np.ndarray, 'M A']:
    """Which actions can be played on each board."""

  @abc.abstractmethod
  def play(
    self, boards: Int8[np.ndarray, 'M R W'], actions: Int[np.ndarray, ' M'], player: int
  ) -> Int8[np.ndarray, 'M R W']:
    """New boards with `player`'s stone placed by each action; raises if one is illegal."""

  @abc.abstractmethod
  def winner(self, boards: Int8[np.ndarray, 'M R W']) -> Int8[np.ndarray, ' M']:
    """+1 or -1 for the side that has a winning line on each board, else 0."""

  @abc.abstractmethod
  def heuristic(self, boards: Int8[np.ndarray, 'M R W'], player: int) -> Int64[np.ndarray, ' M']:
    """A score of each non-terminal board for `player`; antisymmetric in `player`."""

  @abc.abstractmethod
  def position_keys(self, boards: Int8[np.ndarray, 'M R W']) -> Int64[np.ndarray, ' M']:
    """An int64 key per board that differs between any two distinct reachable boards."""

  def is_full(self, boards: Int8[np.ndarray, 'M R W']) -> Bool[np.ndarray, ' M']:
    """Whether no empty cell is left."""
    return (boards != EMPTY).all(axis=(1, 2))

  def render(self, boards: Int8[np.ndarray, 'M R W']) -> list[str]:
    """The compact text of each board: `header`, then R lines of W cells, top row first."""
    return render_grids(boards, self.header)

  def empty_boards(self, n: int) -> Int8[np.ndarray, 'M R W']:
    """M = n empty boards."""
    return np.zeros((n, self.rows, self.cols), dtype=np.int8)

  def board_from_moves(self, moves: Sequence[int], first: int = AGENT) -> Int8[np.ndarray, 'R W']:
    """Plays the actions `moves` in turn, `first` (+1 or -1) moving first; for tests and
    baselines.

    Raises:
      ValueError: a move is out of range or illegal (`play`'s error).
    """
    board, player = self.empty_boards(1), first
    for move in moves:
      board = self.play(board, np.array([move]), player)
      player = -player
    return board[0]


# Cell value + 1 -> character.
_CELL_CHARS = np.frombuffer(b'O.X', dtype=np.uint8)


def render_grids(boards: Int8[np.ndarray, 'M R W'], header: str = '') -> list[str]:
  """Renders boards as `header` + R lines of W cells ('X' +1, 'O' -1, '.' empty), each ending in
  a newline, without a Python loop over cells."""
  m, r, c = boards.shape
  chars = np.empty((m, r, c + 1), dtype=np.uint8)
  chars[:, :, :c] = _CELL_CHARS[boards.astype(np.intp) + 1]
  chars[:, :, c] = ord('\n')
  head = np.frombuffer(header.encode('ascii'), dtype=np.uint8)
  rows = np.concatenate([np.broadcast_to(head, (m, head.size)), chars.reshape(m, -1)], axis=1)
  width = rows.shape[1]
  text = rows.tobytes().decode('ascii')
  return [text[i * width : (i + 1) * width] for i in range(m)]


def grid_from_text(text: str) -> Int8[np.ndarray, 'R W']:
  """The board a rendered observation shows (the inverse of `render_grids` for one board).

  Lines made only of 'X', 'O' and '.' (surrounding spaces ignored) are the rows, top first; any
  other line (a header, an outcome) is skipped. Handy for writing positions in tests.

  Raises:
    ValueError: no rows, or rows of different lengths.
  """
  rows = [line.strip() for line in text.split('\n')]
  rows = [row for row in rows if row and set(row) <= set('XO.')]
  if not rows or len({len(row) for row in rows}) != 1:
    raise ValueError(f'No rectangular board of X, O and . in {text!r}.')
  codes = {'X': AGENT, 'O': OPPONENT, '.': EMPTY}
  return np.array([[codes[ch] for ch in row] for row in rows], dtype=np.int8)


@functools.lru_cache(maxsize=16)
def _standalone_digit(num_actions: int) -> re.Pattern[str]:
  return re.compile(rf'(?<![0-9A-Za-z])[1-{num_actions}](?![0-9A-Za-z])')


def parse_action(text: str, num_actions: int, mode: ParseMode) -> int | None:
  """Reads a 0-based action from a reply; None when the reply names no in-range action.

  Args:
    text: the agent's reply.
    num_actions: A; the text digits '1'..str(A) are the actions 0..A-1 (A <= 9).
    mode: 'strict': `text.strip()` must be exactly one of those digits. 'lenient': the last of
      those digits that has no ASCII letter or digit right before or after it ('I play 4.' -> 3,
      '4th' -> None, '12' -> None).

  Returns:
    The 0-based action or None. Never raises on any str.
  """
  if not isinstance(text, str):
    return None
  if mode == 'strict':
    stripped = text.strip()
    if len(stripped) == 1 and '1' <= stripped <= str(num_actions):
      return int(stripped) - 1
    return None
  last = None
  for match in _standalone_digit(num_actions).finditer(text):
    last = match
  return None if last is None else int(last.group()) - 1
