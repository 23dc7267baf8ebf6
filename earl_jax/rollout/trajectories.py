"""Finished multi-turn episodes, as the rollout engine hands them on: ragged rows on the host.

One row per episode holds the whole conversation (turn prompts and the policy's replies) in one
token sequence, right-padded to T, the longest episode. In a run of several processes each one
holds the episodes whose rows its devices hold (`row_ids` among the `batch_rows` of the whole
batch). `to_device_batch` puts them, padded to a context bucket, onto a layout as one global
`rl.batch.Batch` built from every process's own rows; `to_batch` is the host batch of a single
process. `EpisodeStats.gather` merges the per-episode statistics of every process, so that all of
them log and decide on the same numbers.

  traj = engine.run(params, mesh, seed=step)
  stats = EpisodeStats.gather(traj)          # the whole batch's lengths, returns, outcomes
  stats.context_stats()                      # Fig. 1's turn- and episode-level context lengths
  batch = traj.to_device_batch(bucket=1024, shardings=Batch.shardings(mesh), gamma=0.9)
"""

import dataclasses

import jax
import numpy as np
from jaxtyping import Bool, Float, Float32, Int32

from earl_jax import distributed
from earl_jax.rl.advantages import MOVE_CREDITS
from earl_jax.rl.batch import Batch
from earl_jax.sharding import mesh as mesh_lib

OUTCOMES = ('win', 'loss', 'draw', 'invalid', 'overflow', 'truncated')


def win_rate(outcomes: list[str]) -> float:
  return float(np.mean([o == 'win' for o in outcomes]))


def outcome_rates(outcomes: list[str]) -> dict[str, float]:
  n = len(outcomes)
  return {o: sum(x == o for x in outcomes) / n for o in sorted(set(outcomes))}


@dataclasses.dataclass
class Trajectories:
  """Finished episodes on the host.

  Attributes:
    tokens: every token of each episode, right-padded with the tokenizer's pad id.
    loss_mask: the tokens the policy generated.
    logprobs: their sampling log-probs (0 elsewhere).
    lengths: the episode-level context length (tokens).
    returns: the episode return (the sum of its rewards).
    group_ids: the episode's group (episodes that share their randomness).
    turn_rewards: the reward each turn earned, per episode.
    turn_move_rewards: the part of each turn's reward that its reply itself earned
      (`StepResult.move_rewards`), per episode (default: zeros).
    turn_starts: the token index where each turn's prompt starts, per episode.
    turn_tokens: the tokens of each turn (prompt + reply): the turn-level context length.
    outcomes: 'win' | 'loss' | 'draw' | 'invalid' | 'overflow' | 'truncated', per episode.
    thoughts: the turns of each episode that thought instead of moving (`EnvConfig.think_depth`;
      default: none).
    generated_tokens: tokens the policy generated in all.
    cache_buckets: the KV-cache capacities the rollout went through.
    timings: seconds spent generating, in the environment and on the host.
    row_ids: the row of each episode in the whole batch (default: 0..B-1, a single process).
    batch_rows: the rows of the whole batch (default: B).
    episode_seconds: each episode's latency, from taking a slot to ending (default: zeros).
    rollout_stats: the rollout schedule's statistics, the same on every process (the rollout
      engine's padded fractions and slot occupancy; default: none).
    env_stats: what the environment reported per episode (`TextEnv.episode_stats`: name ->
      float [B]; default: none).
    legal_moves: at the first token of each reply, the moves the environment's rules allowed
      in the position it answered, as bits (bit a: move a was legal); 0 elsewhere, and
      everywhere for a task without moves (default: zeros).
  """

  tokens: Int32[np.ndarray, 'B T']
  loss_mask: Bool[np.ndarray, 'B T']
  logprobs: Float32[np.ndarray, 'B T']
  lengths: Int32[np.ndarray, ' B']
  returns: Float32[np.ndarray, ' B']
  group_ids: Int32[np.ndarray, ' B']
  turn_rewards: list[list[float]]
  turn_starts: list[list[int]]
  turn_tokens: list[list[int]]
  outcomes: list[str]
  generated_tokens: int
  cache_buckets: list[int]
  timings: dict[str, float]
  row_ids: Int32[np.ndarray, ' B'] | None = None
  batch_rows: int | None = None
  thoughts: Int32[np.ndarray, ' B'] | None = None
  episode_seconds: Float32[np.ndarray, ' B'] | None = None
  rollout_stats: dict[str, float] = dataclasses.field(default_factory=dict)
  env_stats: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  turn_move_rewards: list[list[float]] | None = None
  legal_moves: Int32[np.ndarray, 'B T'] | None = None

  def __post_init__(self):
    B = len(self.outcomes)
    if self.legal_moves is None:
      self.legal_moves = np.zeros(self.tokens.shape, np.int32)
    if self.turn_move_rewards is None:
      self.turn_move_rewards = [[0.0] * len(r) for r in self.turn_rewards]
    if self.episode_seconds is None:
      self.episode_seconds = np.zeros(B, np.float32)
    if self.thoughts is None:
      self.thoughts = np.zeros(B, np.int32)
    if self.row_ids is None:
      self.row_ids = np.arange(B, dtype=np.int32)
    if self.batch_rows is None:
      self.batch_rows = B

  @property
  def num_episodes(self) -> int:
    return len(self.outcomes)

  def win_rate(self) -> float:
    return win_rate(self.outcomes)

  def outcome_rates(self) -> dict[str, float]:
    return outcome_rates(self.outcomes)

  def context_stats(self) -> dict[str, float]:
    return context_stats(self.lengths, [len(t) for t in self.turn_tokens], self.thoughts)

  def token_returns(
    self,
    gamma: float,
    bonus: Float32[np.ndarray, ' B'] | None = None,
    *,
    move_credit: str = 'reward_to_go',
  ) -> Float32[np.ndarray, 'B T']:
    """On every generated token, the discounted reward-to-go from its turn on.

    G_t = sum_k gamma^(k - t) r_k over the episode's turns k >= t; 0 on template tokens.
    `bonus`: per episode, added to its last turn's reward (a shaping of the whole episode).
    `move_credit='own_turn'`: each turn's move reward m_t (`turn_move_rewards`) counts for its
    own turn alone, G_t = m_t + sum_k gamma^(k - t) (r_k - m_k): an invalid reply's penalty does
    not blame the moves before it, nor does a legal move's bonus reward them
    (`AdvantageConfig.move_credit`).
    """
    if move_credit not in MOVE_CREDITS:
      raise ValueError(f'token_returns: move_credit={move_credit!r}; known: {MOVE_CREDITS}.')
    out = np.zeros(self.tokens.shape, np.float32)
    for i, rewards in enumerate(self.turn_rewards):
      own = self.turn_move_rewards[i] if move_credit == 'own_turn' else [0.0] * len(rewards)
      rewards = [r - m for r, m in zip(rewards, own)]
      if bonus is not None and rewards:
        rewards = [*rewards[:-1], rewards[-1] + float(bonus[i])]
      reward_to_go, returns = 0.0, [0.0] * len(rewards)
      for turn in range(len(rewards) - 1, -1, -1):
        reward_to_go = rewards[turn] + gamma * reward_to_go
        returns[turn] = reward_to_go + own[turn]
      starts = [*self.turn_starts[i], int(self.lengths[i])]
      for turn, reward_to_go in enumerate(returns):
        lo, hi = starts[turn], starts[turn + 1]
        out[i, lo:hi] = np.where(self.loss_mask[i, lo:hi], reward_to_go, 0.0)
    return out

  def episode(self, i: int) -> dict:
    """Row `i`'s episode, on its own (its tokens cut at its length): what `assemble` takes, and
    what one process hands another (`rollout.dynamic_sampling`)."""
    n = int(self.lengths[i])
    return {
      'tokens': self.tokens[i, :n].copy(),
      'loss_mask': self.loss_mask[i, :n].copy(),
      'logprobs': self.logprobs[i, :n].copy(),
      'legal_moves': self.legal_moves[i, :n].copy(),
      'return': float(self.returns[i]),
      'turn_rewards': list(self.turn_rewards[i]),
      'turn_move_rewards': list(self.turn_move_rewards[i]),
      'turn_starts': list(self.turn_starts[i]),
      'turn_tokens': list(self.turn_tokens[i]),
      'outcome': self.outcomes[i],
      'thoughts': int(self.thoughts[i]),
      'episode_seconds': float(self.episode_seconds[i]),
      'env_stats': {name: float(values[i]) for name, values in self.env_stats.items()},
    }

  @classmethod
  def assemble(
    cls, episodes: list[dict], sources: 'list[Trajectories]', *, group_size: int
  ) -> 'Trajectories':
    """This process's rows from `episodes` (`episode` records, one per row of `sources[0]`, in
    its order), e.g. taken from several rollouts of the step (dynamic sampling): each keeps the
    position (`row_ids`) of `sources[0]`'s row, and its group is its position's
    (// group_size). The tokens are right-padded with 0 past each episode's length (as
    `to_batch` pads). The rollout's timings and statistics cover every source: timings and cache
    buckets in all, the schedule's statistics averaged; `generated_tokens` counts the rows."""
    first = sources[0]
    if len(episodes) != first.num_episodes:
      raise ValueError(
        f'Trajectories.assemble: {len(episodes)} episodes for {first.num_episodes} rows.'
      )
    lengths = np.array([len(e['tokens']) for e in episodes], np.int32)
    T = max(1, int(lengths.max(initial=0)))
    tokens = np.zeros((len(episodes), T), np.int32)
    loss_mask = np.zeros((len(episodes), T), bool)
    logprobs = np.zeros((len(episodes), T), np.float32)
    legal_moves = np.zeros((len(episodes), T), np.int32)
    for j, e in enumerate(episodes):
      n = lengths[j]
      tokens[j, :n], loss_mask[j, :n], logprobs[j, :n] = e['tokens'], e['loss_mask'], e['logprobs']
      legal_moves[j, :n] = e['legal_moves']
    stats = {k: float(np.mean([s.rollout_stats[k] for s in sources])) for k in first.rollout_stats}
    return cls(
      tokens=tokens,
      loss_mask=loss_mask,
      logprobs=logprobs,
      legal_moves=legal_moves,
      lengths=lengths,
      returns=np.array([e['return'] for e in episodes], np.float32),
      group_ids=(first.row_ids // group_size).astype(np.int32),
      turn_rewards=[e['turn_rewards'] for e in episodes],
      turn_move_rewards=[e['turn_move_rewards'] for e in episodes],
      turn_starts=[e['turn_starts'] for e in episodes],
      turn_tokens=[e['turn_tokens'] for e in episodes],
      outcomes=[e['outcome'] for e in episodes],
      generated_tokens=int(loss_mask.sum()),
      cache_buckets=sorted({b for s in sources for b in s.cache_buckets}),
      timings={k: float(sum(s.timings.get(k, 0.0) for s in sources)) for k in first.timings},
      row_ids=first.row_ids.copy(),
      batch_rows=first.batch_rows,
      thoughts=np.array([e['thoughts'] for e in episodes], np.int32),
      episode_seconds=np.array([e['episode_seconds'] for e in episodes], np.float32),
      rollout_stats=stats,
      env_stats={
        name: np.array([e['env_stats'][name] for e in episodes]) for name in first.env_stats
      },
    )

  def to_batch(
    self,
    *,
    bucket: int,
    rows: int,
    gamma: float = 1.0,
    exclude: tuple[str, ...] = (),
    bonus: Float32[np.ndarray, ' B'] | None = None,
    move_credit: str = 'reward_to_go',
  ) -> Batch:
    """A host Batch with `rows` rows (padding rows are invalid) and tokens padded to `bucket`.

    `gamma` discounts the per-token reward-to-go (`Batch.returns`), `move_credit` says where a
    move reward counts (`token_returns`). `bonus`: per episode, a
    reward added to its return and to its last turn's (e.g. `overlong_penalties`). `exclude`: outcomes whose
    episodes stay out of the update (e.g. ('overflow',), overlong filtering): their rows keep
    their tokens but are invalid with an all-False loss mask, like padding rows, so they add
    nothing to the loss or to the advantages' statistics. The episodes' rows: this is the whole
    batch only in a single process (see `to_device_batch`).
    """
    unknown = sorted(set(exclude) - set(OUTCOMES))
    if unknown:
      raise ValueError(f'to_batch: unknown outcomes {unknown} in exclude; known: {list(OUTCOMES)}.')
    B, T = self.tokens.shape
    if bucket < T:
      raise ValueError(f'to_batch: bucket {bucket} is shorter than the longest episode ({T}).')
    if rows < B:
      raise ValueError(f'to_batch: rows={rows} is fewer than the {B} episodes.')
    out = Batch.zeros(rows, bucket)
    pad = lambda x, v=0: np.pad(x, ((0, rows - B), (0, bucket - T)), constant_values=v)  # noqa: E731
    kept = np.array([o not in exclude for o in self.outcomes], bool)
    return out.replace(
      tokens=pad(self.tokens).astype(np.int32),
      loss_mask=pad(self.loss_mask & kept[:, None], False),
      sample_logprobs=pad(self.logprobs).astype(np.float32),
      returns=pad(self.token_returns(gamma, bonus, move_credit=move_credit)),
      legal_moves=pad(self.legal_moves).astype(np.int32),
      segment_ids=(
        np.arange(bucket)[None, :] < np.pad(self.lengths, (0, rows - B))[:, None]
      ).astype(np.int32),
      rewards=np.pad(self.returns + (0 if bonus is None else bonus), (0, rows - B)).astype(
        np.float32
      ),
      lengths=np.pad(self.lengths, (0, rows - B)).astype(np.int32),
      group_ids=np.pad(self.group_ids, (0, rows - B)).astype(np.int32),
      valid=np.pad(kept, (0, rows - B)),
    )

  def to_device_batch(
    self,
    *,
    bucket: int,
    shardings: Batch,
    gamma: float = 1.0,
    exclude: tuple[str, ...] = (),
    bonus: Float32[np.ndarray, ' B'] | None = None,
    move_credit: str = 'reward_to_go',
  ) -> Batch:
    """The whole batch (`batch_rows` rows, tokens padded to `bucket`) as device arrays on
    `shardings`, built from this process's episodes: every process calls it with its own, and
    each puts only the rows its devices hold (which must be among them). `exclude`, `bonus` and
    `move_credit` as in `to_batch`."""
    host = self.to_batch(
      bucket=bucket,
      rows=self.num_episodes,
      gamma=gamma,
      exclude=exclude,
      bonus=bonus,
      move_credit=move_credit,
    )
    return jax.tree.map(
      lambda x, sh: mesh_lib.put_rows(x, self.row_ids, (self.batch_rows, *x.shape[1:]), sh),
      host,
      shardings,
    )


@dataclasses.dataclass(frozen=True)
class EpisodeStats:
  """Per-episode statistics of the whole batch, identical on every process.

  Attributes:
    lengths: the episode-level context length of every row.
    returns: its return.
    turns: its agent turns.
    generated: the tokens the policy generated in it.
    outcomes: its outcome (one of OUTCOMES).
    thoughts: its turns that thought instead of moving.
    env_stats: what its environment reported of it (`Trajectories.env_stats`).
    groups: its group (`Trajectories.group_ids`: episodes that share their start), where known.
  """

  lengths: Int32[np.ndarray, ' B']
  returns: Float32[np.ndarray, ' B']
  turns: Int32[np.ndarray, ' B']
  generated: Int32[np.ndarray, ' B']
  outcomes: list[str]
  thoughts: Int32[np.ndarray, ' B'] | None = None
  env_stats: dict[str, Float[np.ndarray, ' B']] = dataclasses.field(default_factory=dict)
  groups: Int32[np.ndarray, ' B'] | None = None

  @classmethod
  def gather(cls, traj: Trajectories) -> 'EpisodeStats':
    """Every process's episodes merged (a collective: every process calls it)."""
    B = traj.batch_rows
    held = np.zeros(B, bool)
    held[traj.row_ids] = True
    names = sorted(traj.env_stats)  # the same on every process: one environment class
    columns = [
      traj.lengths,
      traj.returns,
      [len(t) for t in traj.turn_tokens],
      traj.loss_mask.sum(axis=1),
      [OUTCOMES.index(o) for o in traj.outcomes],
      traj.thoughts,
      traj.group_ids,
      *(traj.env_stats[name] for name in names),
    ]
    table = np.zeros((B, len(columns)), np.float64)
    table[traj.row_ids] = np.stack(columns, axis=1)
    table = distributed.gather_rows(table, held)
    return cls(
      lengths=table[:, 0].astype(np.int32),
      returns=table[:, 1].astype(np.float32),
      turns=table[:, 2].astype(np.int32),
      generated=table[:, 3].astype(np.int32),
      outcomes=[OUTCOMES[int(i)] for i in table[:, 4]],
      thoughts=table[:, 5].astype(np.int32),
      groups=table[:, 6].astype(np.int32),
      env_stats={name: table[:, 7 + k] for k, name in enumerate(names)},
    )

  @property
  def num_episodes(self) -> int:
    return len(self.outcomes)

  @property
  def tokens(self) -> int:
    return int(np.sum(self.lengths))

  @property
  def generated_tokens(self) -> int:
    return int(np.sum(self.generated))

  def win_rate(self) -> float:
    return win_rate(self.outcomes)

  def outcome_rates(self) -> dict[str, float]:
    return outcome_rates(self.outcomes)

  def context_stats(self) -> dict[str, float]:
    return context_stats(self.lengths, self.turns, self.thoughts)

  def group_stats(self) -> dict[str, float]:
    """How many groups of two or more episodes the batch holds, and the fraction of them whose
    episodes all returned the same: a group-relative advantage ('grpo', 'dr_grpo', 'rloo') is
    0 on each of their tokens, so they teach nothing. {} without groups of two or more."""
    if self.groups is None:
      return {}
    sizes = np.bincount(self.groups)
    multi = np.flatnonzero(sizes >= 2)
    if not len(multi):
      return {}
    flat = [np.ptp(self.returns[self.groups == g]) == 0 for g in multi]
    return {'count': float(len(multi)), 'flat_rate': float(np.mean(flat))}


def overlong_penalties(
  lengths: Int32[np.ndarray, ' B'], *, cap: int, buffer: int, penalty: float
) -> Float32[np.ndarray, ' B']:
  """DAPO's soft overlong punishment on the episodes' context lengths: 0 up to cap - buffer,
  then falling linearly to -penalty at the cap (and beyond it); 0 everywhere when buffer is 0."""
  if buffer <= 0:
    return np.zeros(len(lengths), np.float32)
  over = np.clip((np.asarray(lengths) - (cap - buffer)) / buffer, 0.0, 1.0)
  return (-penalty * over).astype(np.float32)


def context_stats(
  lengths: Int32[np.ndarray, ' B'], turns, thoughts: Int32[np.ndarray, ' B'] | None
) -> dict[str, float]:
  """Fig. 1's context lengths of a batch of episodes.

  Returns:
    episode_len_mean / _max / _p95: the episode-level context length (tokens).
    turn_len_mean: the turn-level context length, tokens per agent turn (its prompt and reply).
    turns_mean: agent turns per episode.
    move_len_mean: tokens per move, the thinking turns before it included (a turn that thought
      instead of moving is part of the move it prepared); equal to turn_len_mean without
      thinking.
    thoughts_per_move: thinking turns per move.
  """
  tokens = float(np.sum(lengths))
  turns = int(np.sum(turns))
  thought = 0 if thoughts is None else int(np.sum(thoughts))
  moves = max(turns - thought, 1)
  return {
    'episode_len_mean': float(np.mean(lengths)),
    'episode_len_max': float(np.max(lengths)),
    'episode_len_p95': float(np.percentile(lengths, 95)),
    'turn_len_mean': tokens / max(turns, 1),
    'turns_mean': turns / len(lengths),
    'move_len_mean': tokens / moves,
    'thoughts_per_move': thought / moves,
  }
