"""The multi-turn rollout engine: M episodes on B slots, one KV cache that persists across turns.

Each turn, for every slot that holds a running episode, the engine tokenizes only the new
observation (the chat template's turn prompt), prefills it after what the slot's cache row
already holds, and decodes the reply token by token (temperature, top-p) until the end-of-turn
token or the per-turn limit. The reply text goes to the environment, which answers with the
next observation.

Slots (`RolloutConfig.num_slots`, B <= M = `num_episodes`): the rows of the rollout programs.
With `refill` (the default), an episode that ends at a turn boundary hands its slot to the next
waiting episode at once: the newcomer's first observation is prefilled into that row by the same
turn program, which resets the row's fill when the row's turn is 0 (the slot index is data, not
a shape, so one program serves every slot). Without it, lock-step: the next B episodes start
only when every slot is free, and every turn waits for the slowest episode. The policy is frozen
for the whole rollout, so refill is on-policy. Reproducible whatever the schedule: a token's
sampling key is (episode id, turn, token index) (`sampler.row_keys`), and the episodes that
start at the same turn boundary (a cohort) share an environment reset on exactly them, which
draws each one's own randomness; so refill, lock-step and all-at-once play the same episodes
token for token, and the result lists them in episode-id order, as the experience stage takes
them. In a run of several processes, each refills its own slots from its own episodes: the rows
of the whole batch that its devices hold.

The cache capacity is a context bucket: when the fullest slot would outgrow it, the cache is
copied into the next bucket (on device); an episode that would outgrow the largest bucket
forfeits its turn (its reply is submitted empty, which the environment penalises as invalid).

Every turn runs a compiled rollout program taken from `programs` (a `programs.Executables`, whose
`generate(config, S, B, chunk=P, greedy=...)` gives the program of one cache bucket S and prompt
bucket P): the very programs the Parallelism Selector profiles and precompiles.

The engine records, per episode: every token, a loss mask of exactly the tokens the policy
generated, their sampling log-probs, the turn boundaries, the return, the turn-level and
episode-level context lengths that EARL's Fig. 1 tracks, its latency, and what its
environment reports of it (`TextEnv.episode_stats`: a code task's programs run and sandbox
time; read as its cohort ends); and for the whole rollout the padded fractions of decode and
prefill and the slot occupancy (`Trajectories.rollout_stats`).

  exe = Executables(model_cfg, spec=StageSpec.for_rollout(rollout_config, tokenizer, model_cfg))
  engine = RolloutEngine(model_cfg, tokenizer, env_config, rollout_config, buckets, programs=exe)
  traj = engine.run(params, mesh, seed=step)           # host numpy Trajectories
  batch = traj.to_batch(bucket=1024, rows=64)          # an rl.batch.Batch (host)
"""

import collections
import dataclasses
import time
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from earl_jax import distributed
from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.envs import base as envs
from earl_jax.envs import registry
from earl_jax.errors import ConfigError
from earl_jax.models import qwen2
from earl_jax.models.tokenizer import Tokenizer
from earl_jax.rollout import sampler
from earl_jax.rollout.trajectories import Trajectories
from earl_jax.sharding import mesh as mesh_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """How episodes are rolled out.

  Attributes:
    num_episodes: M, the episodes a rollout plays (the number of responses the experience and
      train stages take).
    num_slots: B, the most episodes that run side by side: the rows of the rollout programs
      and of their KV cache (None: all M at once). With fewer slots than episodes, `refill`
      says how the slots are reused.
    refill: a slot whose episode ends takes the next waiting episode at the next turn boundary
      (its first observation is prefilled into that row, whose fill is reset), so a long
      episode no longer holds B - 1 finished ones as padding. False: lock-step, the next B
      episodes start only when every slot is free. Either way every episode plays the same
      game and samples the same tokens (`sampler.row_keys`); only the schedule differs.
    group_size: consecutive episodes that share their start and opponent randomness (GRPO
      groups); must divide num_episodes.
    max_turns: cap on agent turns (None: the game's own maximum).
    sampling: temperature, top-p and the per-turn token limit.
    prompt_buckets: padded lengths of a turn's new prompt tokens (one compile per bucket).
    reply_tokens: constrained decoding: the only tokens a reply may use, each given as the text
      of exactly one token (e.g. the column digits '1'..'7' of Connect Four); () allows the whole
      vocabulary. The policy is then the softmax over these tokens alone, in the sampler and in
      the experience and train forwards, so exploration and the entropy bonus spread over
      well-formed replies only (the environment still judges whether a move is legal). Multi-token
      replies stop early only if the end-of-turn token's text is in the set.
  """

  num_episodes: int = 64
  num_slots: int | None = None
  refill: bool = True
  group_size: int = 1
  max_turns: int | None = None
  sampling: sampler.SamplingConfig = dataclasses.field(
    default_factory=lambda: sampler.SamplingConfig(max_new_tokens=4)
  )
  prompt_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
  reply_tokens: tuple[str, ...] = ()

  @property
  def slots(self) -> int:
    """B, the rows the rollout programs run: `num_slots`, at most `num_episodes`."""
    return min(self.num_slots or self.num_episodes, self.num_episodes)

  def __post_init__(self):
    if self.num_episodes <= 0 or self.group_size <= 0 or self.num_episodes % self.group_size:
      raise ConfigError(
        f'RolloutConfig: group_size={self.group_size} must be a positive divisor of '
        f'num_episodes={self.num_episodes}.'
      )
    slots = self.num_slots
    if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 1):
      raise ConfigError(f'RolloutConfig.num_slots must be None or an int >= 1, got {slots!r}.')
    if not isinstance(self.refill, bool):
      raise ConfigError(f'RolloutConfig.refill must be a bool, got {self.refill!r}.')
    if self.max_turns is not None and self.max_turns <= 0:
      raise ConfigError(f'RolloutConfig.max_turns must be positive, got {self.max_turns}.')
    BucketConfig(lengths=tuple(self.prompt_buckets))  # validates the table
    tokens = self.reply_tokens
    if not isinstance(tokens, tuple) or not all(isinstance(t, str) and t for t in tokens):
      raise ConfigError(
        f'RolloutConfig.reply_tokens must be a tuple of non-empty strings, got {tokens!r}.'
      )
    if len(set(tokens)) != len(tokens):
      raise ConfigError(f'RolloutConfig.reply_tokens has duplicates: {tokens!r}.')


def reply_token_ids(
  tokenizer: Tokenizer, reply_tokens: tuple[str, ...], vocab_size: int
) -> tuple[int, ...] | None:
  """The sorted vocabulary ids of `RolloutConfig.reply_tokens` (None: no constraint).

  Raises ValueError naming the entry if one is not exactly one token of `tokenizer`, or its id
  is outside the model's vocabulary.
  """
  if not reply_tokens:
    return None
  ids = [
    _one_token(tokenizer, text, vocab_size, 'RolloutConfig.reply_tokens entry')
    for text in reply_tokens
  ]
  if len(set(ids)) != len(ids):
    raise ValueError(f'RolloutConfig.reply_tokens {reply_tokens!r} map to repeated ids {ids}.')
  return tuple(sorted(ids))


def move_token_ids(tokenizer: Tokenizer, env: envs.TextEnv, vocab_size: int) -> tuple[int, ...]:
  """The vocabulary id of each of `env`'s moves, in move order (`TextEnv.action_text`): the
  tokens whose probability the rules' term reads (`LossConfig.legal_move_coef`).

  Raises ValueError if `env` takes free-text replies, or a move is not exactly one token of
  `tokenizer` inside the model's vocabulary.
  """
  if env.num_actions is None:
    raise ValueError(
      f'{type(env).__name__} takes free-text replies: it has no moves whose legality the '
      'rules could label (expected a board game)'
    )
  return tuple(
    _one_token(tokenizer, env.action_text(a), vocab_size, 'the move')
    for a in range(env.num_actions)
  )


def _one_token(tokenizer: Tokenizer, text: str, vocab_size: int, what: str) -> int:
  """The id of `text`, which must be exactly one token of `tokenizer` below `vocab_size`."""
  encoded = tokenizer.encode(text)
  if len(encoded) != 1:
    raise ValueError(
      f'{what} {text!r} encodes to {len(encoded)} tokens {encoded}; each entry must be exactly '
      f'one token of {tokenizer!r}.'
    )
  if not 0 <= encoded[0] < vocab_size:
    raise ValueError(
      f'{what} {text!r} is id {encoded[0]}, outside the model vocabulary of {vocab_size}.'
    )
  return encoded[0]


@runtime_checkable
class GeneratePrograms(Protocol):
  """Where the engine gets its compiled turn programs (`programs.Executables` is one).

  `generate(config, bucket, rows, chunk=P, greedy=g)` returns a callable with a `.program`
  (its `in_shardings`, a `sampler.RolloutArgs`, place the inputs) that maps the
  `sampler.RolloutArgs` (params, cache, prompt [B, P], num_prompt [B], key_data, eot_id) to
  (Generation, cache); `spec.sampling` is the sampling it was built for.
  """

  spec: Any

  def generate(
    self, config: ParallelConfig, bucket: int, rows: int, *, chunk: int, greedy: bool
  ) -> Any: ...


@dataclasses.dataclass
class _Episodes:
  """This process's episodes, indexed by their place among its episode ids: what each has
  played so far, and where it is."""

  rows: list[list[int]]
  masks: list[list[bool]]
  logprobs: list[list[float]]
  legal_moves: list[list[int]]  # bits of the moves legal where each reply starts, else 0
  turn_starts: list[list[int]]
  turn_tokens: list[list[int]]
  turn_rewards: list[list[float]]
  turn_move_rewards: list[list[float]]  # the part of each turn's reward its reply earned
  outcomes: list[str]
  observations: list[str]  # the observation each running episode answers next
  returns: np.ndarray  # f32 [E]
  running: np.ndarray  # bool [E]: started and not yet ended
  unterminated: np.ndarray  # bool [E]: the last reply hit the limit without an end-of-turn
  fill: np.ndarray  # int64 [E]: host mirror of the episode's cache fill
  turns: np.ndarray  # int64 [E]: turns played
  thoughts: np.ndarray  # int32 [E]: turns that thought instead of moving (the env's hints)
  started_s: np.ndarray  # f64 [E]: when the episode took a slot (perf_counter)
  seconds: np.ndarray  # f64 [E]: from taking a slot to ending
  env_stats: dict[str, np.ndarray]  # name -> f64 [E]: what its environment reported
  generated: int = 0

  @classmethod
  def empty(cls, E: int, stat_names: tuple[str, ...] = ()) -> '_Episodes':
    lists = lambda: [[] for _ in range(E)]  # noqa: E731
    return cls(
      rows=lists(),
      masks=lists(),
      logprobs=lists(),
      legal_moves=lists(),
      turn_starts=lists(),
      turn_tokens=lists(),
      turn_rewards=lists(),
      turn_move_rewards=lists(),
      outcomes=['truncated'] * E,
      observations=[''] * E,
      returns=np.zeros(E, np.float32),
      running=np.zeros(E, bool),
      unterminated=np.zeros(E, bool),
      fill=np.zeros(E, np.int64),
      turns=np.zeros(E, np.int64),
      thoughts=np.zeros(E, np.int32),
      started_s=np.zeros(E, np.float64),
      seconds=np.zeros(E, np.float64),
      env_stats={name: np.zeros(E, np.float64) for name in stat_names},
    )

  def record(
    self, i: int, prompt: list[int], reply: list[int], logprobs: list[float], legal: int = 0
  ) -> None:
    """Appends one turn (its prompt and the policy's reply) to episode i; `legal`: the bits
    of the moves that were legal in the position the reply answers."""
    self.turn_starts[i].append(len(self.rows[i]))
    self.rows[i] += prompt + reply
    self.masks[i] += [False] * len(prompt) + [True] * len(reply)
    self.logprobs[i] += [0.0] * len(prompt) + logprobs
    self.legal_moves[i] += [0] * len(prompt) + [legal] * min(len(reply), 1)
    self.legal_moves[i] += [0] * (len(reply) - 1)
    self.turn_tokens[i].append(len(prompt) + len(reply))
    self.fill[i] += len(prompt) + len(reply)
    self.generated += len(reply)

  def score(self, members: list[int], result: envs.StepResult, played, overflow) -> None:
    """Books one step of a cohort's environment: rewards, observations, ended episodes.

    `members` are the cohort's episodes (in its environment's order); `played` and `overflow`
    (bool, one per member) say which replied this turn and which forfeited it.
    """
    for j, i in enumerate(members):
      if not self.running[i]:
        continue
      reward = float(result.rewards[j])
      self.returns[i] += reward
      if played[j]:
        self.turn_rewards[i].append(reward)
        self.turn_move_rewards[i].append(float(result.move_rewards[j]))
        self.thoughts[i] += result.infos[j].get('hint') is not None
      elif overflow[j] and self.turn_rewards[i]:  # the forfeit lands on the last turn played
        self.turn_rewards[i][-1] += reward
      self.observations[i] = result.observations[j]
      if result.dones[j]:
        self.outcomes[i] = (
          'overflow' if overflow[j] else (result.infos[j]['outcome'] or 'truncated')
        )
        self.running[i] = False

  def trajectories(
    self,
    *,
    pad_id: int,
    group_size: int,
    cache_buckets: list[int],
    timings: dict[str, float],
    row_ids: np.ndarray,
    batch_rows: int,
    stats: dict[str, float],
  ) -> Trajectories:
    E = len(self.rows)
    T = max(1, max(len(r) for r in self.rows))
    tokens = np.full((E, T), pad_id, np.int32)
    loss_mask = np.zeros((E, T), bool)
    logprobs = np.zeros((E, T), np.float32)
    legal_moves = np.zeros((E, T), np.int32)
    for i in range(E):
      n = len(self.rows[i])
      tokens[i, :n] = self.rows[i]
      loss_mask[i, :n] = self.masks[i]
      logprobs[i, :n] = self.logprobs[i]
      legal_moves[i, :n] = self.legal_moves[i]
    return Trajectories(
      tokens=tokens,
      loss_mask=loss_mask,
      logprobs=logprobs,
      legal_moves=legal_moves,
      lengths=np.array([len(r) for r in self.rows], np.int32),
      returns=self.returns,
      turn_rewards=self.turn_rewards,
      turn_move_rewards=self.turn_move_rewards,
      group_ids=(row_ids // group_size).astype(np.int32),
      turn_starts=self.turn_starts,
      turn_tokens=self.turn_tokens,
      outcomes=self.outcomes,
      generated_tokens=self.generated,
      cache_buckets=cache_buckets,
      timings=timings,
      row_ids=row_ids.astype(np.int32),
      batch_rows=batch_rows,
      thoughts=self.thoughts.copy(),
      episode_seconds=self.seconds.astype(np.float32),
      rollout_stats=stats,
      env_stats={name: values.copy() for name, values in self.env_stats.items()},
    )


@dataclasses.dataclass
class _Cohort:
  """Episodes that took their slots at the same turn boundary, and their environment.

  They started together, so they have played the same number of turns, and their environment
  (reset on exactly these episodes of the whole batch) has stepped once per turn: each episode
  draws the environment randomness it would draw in any other schedule. All cohorts step in one
  `TextEnv.step_many` call, which a board game batches.
  """

  members: list[int]  # this process's episode indices, in the environment's order
  env: envs.TextEnv


def _legal_moves(cohorts: list[_Cohort]) -> dict[int, int]:
  """By episode index, the bits of the moves legal in each game now (bit a: move a), what
  `Batch.legal_moves` records at the reply that answers it; none for an environment whose
  replies are free text."""
  out: dict[int, int] = {}
  for cohort in cohorts:
    if cohort.env.num_actions is None:
      continue
    legal = cohort.env.legal_mask()
    bits = legal.astype(np.int64) @ (1 << np.arange(legal.shape[1], dtype=np.int64))
    out.update(zip(cohort.members, bits.tolist()))
  return out


@dataclasses.dataclass(frozen=True)
class _Turn:
  """One call of the turn program for this process's slots: each slot's new prompt tokens,
  which slots play, and the padded chunk (P is the prompt bucket every process agreed on)."""

  prompts: list[list[int]]
  num_prompt: np.ndarray  # int64 [Bl]: 0 for slots that do not play
  played: np.ndarray  # bool [Bl]
  overflow: np.ndarray  # bool [Bl]: would outgrow the largest bucket; forfeits the turn
  chunk: np.ndarray  # int32 [Bl, P] (P = 0 until every process agreed on the prompt bucket)


@dataclasses.dataclass
class _Counts:
  """What the turn programs did, for the padded fractions and the slot occupancy: per call, and
  per slot of this process (columns: real prompt tokens prefilled, calls played, tokens
  generated, calls played in the drain)."""

  per_slot: np.ndarray  # int64 [Bl, 4]
  calls: int = 0
  prompt_width: int = 0  # P summed over calls
  drain_calls: int = 0  # calls once no episode was waiting (on any process)
  decode_steps: list[int] = dataclasses.field(default_factory=list)  # this process's, per call


@dataclasses.dataclass
class _Run:
  """One rollout's device side and schedule: its layout, this process's slots and episodes,
  the key, the growing cache, the slot table and the waiting episodes."""

  parallel: ParallelConfig
  mesh: jax.sharding.Mesh
  slot_rows: np.ndarray  # int64 [Bl]: the slots (program rows) this process fills
  episode_ids: np.ndarray  # int64 [E]: the episodes (rows of the whole batch) it plays
  greedy: bool
  seed: int
  key_data: jax.Array  # uint32 [2], replicated: the rollout's key
  eot: jax.Array
  cache: qwen2.KVCache
  cache_buckets: list[int]
  timings: dict[str, float]
  slots: np.ndarray  # int64 [Bl]: the episode index in each slot (-1: free)
  waiting: collections.deque  # episode indices not started yet, in id order
  counts: _Counts
  cohorts: list[_Cohort] = dataclasses.field(default_factory=list)
  # Passed to every cohort's reset: a curriculum's task weights, a match's games.
  reset_options: dict[str, Any] = dataclasses.field(default_factory=dict)


class RolloutEngine:
  """Runs multi-turn episodes of `env_config` on B slots with the rollout programs of
  `programs`, refilling a slot as soon as its episode ends (`RolloutConfig.refill`)."""

  def __init__(
    self,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    env_config: envs.AnyEnvConfig,
    config: RolloutConfig,
    buckets: BucketConfig,
    *,
    programs: GeneratePrograms,
  ):
    if config.sampling.max_new_tokens + config.prompt_buckets[0] > buckets.max_length:
      raise ValueError(
        f'The per-turn token limit ({config.sampling.max_new_tokens}) plus the smallest prompt '
        f'bucket ({config.prompt_buckets[0]}) does not fit the largest context bucket '
        f'({buckets.max_length}); raise the buckets or lower sampling.max_new_tokens.'
      )
    if tokenizer.vocab_size > model_cfg.vocab_size:
      raise ValueError(
        f'The tokenizer has {tokenizer.vocab_size} ids but the model only {model_cfg.vocab_size}.'
      )
    spec = programs.spec
    if dataclasses.replace(spec.sampling, greedy=False) != dataclasses.replace(
      config.sampling, greedy=False
    ):
      raise ValueError(
        f'The rollout programs sample with {spec.sampling}, the rollout config with '
        f'{config.sampling}; build the programs from this rollout config.'
      )
    if bool(config.reply_tokens) != (spec.token_ids is not None):
      raise ValueError(
        f'RolloutConfig.reply_tokens={config.reply_tokens!r} but the rollout programs were '
        f'built with token_ids={spec.token_ids}; build the programs from this rollout config.'
      )
    self.model_cfg = model_cfg
    self.tokenizer = tokenizer
    self.env_config = env_config
    self.config = config
    self.buckets = buckets
    self.programs = programs
    self.prompt_buckets = BucketConfig(lengths=tuple(config.prompt_buckets))
    # Cache creation and growth, compiled once per (layout, bucket) and owned by the engine.
    self._cache_ops: dict[tuple, Any] = {}
    # Environments whose cohort has ended, reset for the next one (building one can load a
    # task table).
    self._idle_envs: list[envs.TextEnv] = [registry.make_env(env_config)]
    self.max_turns = config.max_turns or self._idle_envs[0].max_turns
    # What the environment reports per episode (`TextEnv.episode_stats`), read as a cohort ends.
    self.stat_names = tuple(sorted(self._idle_envs[0].episode_stats()))

  @property
  def token_ids(self) -> tuple[int, ...] | None:
    """The constrained reply vocabulary of the programs (None: the whole vocabulary)."""
    return self.programs.spec.token_ids

  @property
  def num_slots(self) -> int:
    """B, the rows of the rollout programs."""
    return self.config.slots

  # -- the KV cache ---------------------------------------------------------------------------------

  def _empty_cache(self, mesh: jax.sharding.Mesh, capacity: int) -> qwen2.KVCache:
    """A zero cache of `capacity` laid out as the rollout programs on `mesh` take it."""
    key = ('empty', mesh, capacity)
    if key not in self._cache_ops:
      abstract = qwen2.KVCache.abstract(self.model_cfg, self.num_slots, capacity)
      self._cache_ops[key] = jax.jit(
        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
        out_shardings=qwen2.KVCache.shardings(self.model_cfg, mesh),
      )
    return self._cache_ops[key]()

  def _grow(self, cache: qwen2.KVCache, mesh: jax.sharding.Mesh, capacity: int) -> qwen2.KVCache:
    """The cache copied into a larger bucket, on device."""
    key = ('grow', mesh, cache.capacity, capacity)
    if key not in self._cache_ops:
      extra = capacity - cache.capacity
      pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))  # noqa: E731
      self._cache_ops[key] = jax.jit(
        lambda c: dataclasses.replace(c, k=tuple(map(pad, c.k)), v=tuple(map(pad, c.v))),
        out_shardings=qwen2.KVCache.shardings(self.model_cfg, mesh),
      )
    return self._cache_ops[key](cache)

  # -- the rollout ----------------------------------------------------------------------------------

  def run(
    self,
    params,
    mesh: jax.sharding.Mesh,
    *,
    seed: int,
    greedy: bool = False,
    capacity: int | None = None,
    task_weights: np.ndarray | None = None,
    games: int | None = None,
  ) -> Trajectories:
    """Plays `config.num_episodes` episodes to the end on `config.slots` slots.

    Args:
      params: the policy's parameters, sharded on `mesh` as its rollout programs take them.
      mesh: the rollout stage's mesh.
      seed: seeds the environment and the sampler (the whole rollout is deterministic in it,
        whatever the number of slots or the schedule).
      greedy: argmax decoding (evaluation).
      capacity: the initial cache bucket (e.g. the selector's choice); grown as needed.
      task_weights: a curriculum's draw weight per task (`envs.curriculum`; code tasks only).
      games: the games of each episode's match (`EnvConfig.series_games`; board games only;
        None: the environment's own).

    Returns:
      This process's episodes in episode-id order (`Trajectories.row_ids` among the
      `num_episodes` rows of the whole batch), with the schedule's statistics in
      `rollout_stats` (identical on every process).
    """
    cfg = self.config
    run = self._start(mesh, capacity, greedy or cfg.sampling.greedy, seed)
    run.reset_options = {
      **({} if task_weights is None else {'task_weights': task_weights}),
      **({} if games is None else {'games': games}),
    }
    episodes = _Episodes.empty(len(run.episode_ids), self.stat_names)
    while True:
      t0 = time.perf_counter()
      self._admit(run, episodes)
      inputs, need = self._prepare_turn(run, episodes)
      occupied = int((run.slots >= 0).any())
      agreed = distributed.process_max(
        [occupied, int(inputs.num_prompt.max(initial=0)), need, len(run.waiting)]
      )
      run.timings['host_s'] += time.perf_counter() - t0
      if not agreed[0]:
        break
      played = self._play_turn(run, episodes, inputs, params, prompt=agreed[1], reach=agreed[2])
      self._count(run, played, drain=not agreed[3])
      self._retire(run, episodes)
    return episodes.trajectories(
      pad_id=self.tokenizer.pad_id,
      group_size=cfg.group_size,
      cache_buckets=run.cache_buckets,
      timings=run.timings,
      row_ids=run.episode_ids,
      batch_rows=cfg.num_episodes,
      stats=self._stats(run.counts, run.slot_rows),
    )

  def _start(self, mesh, capacity: int | None, greedy: bool, seed: int) -> _Run:
    """Checks the mesh, finds this process's slots and episodes, makes the first cache."""
    M, B = self.config.num_episodes, self.num_slots
    parallel = mesh_lib.parallel_config_of(mesh)
    mesh_lib.check_batch_fits(parallel, M, what='num_episodes')
    mesh_lib.check_batch_fits(parallel, B, what='num_slots')
    S = capacity or self.buckets.lengths[0]
    first = self.programs.generate(
      parallel, S, B, chunk=self.prompt_buckets.lengths[0], greedy=greedy
    ).program
    if not mesh_lib.same_devices(first.mesh, mesh):
      raise ValueError(
        f'The rollout mesh {dict(mesh.shape)} is not over the devices of the rollout programs; '
        'build the programs with the devices of the mesh.'
      )
    shardings: sampler.RolloutArgs = first.in_shardings
    slot_rows = mesh_lib.local_rows(shardings.prompt, (B, 1))
    # The episodes this process plays are the rows of the whole batch its devices hold, so
    # that the batch handed to the experience stage is laid out as a batch of M rows would be.
    episode_ids = mesh_lib.local_rows(shardings.prompt, (M, 1))
    key = jax.random.fold_in(jax.random.key(seed), 0x5EED)
    return _Run(
      parallel=parallel,
      mesh=first.mesh,
      slot_rows=slot_rows,
      episode_ids=episode_ids,
      greedy=greedy,
      seed=seed,
      key_data=mesh_lib.put_replicated(jax.random.key_data(key), shardings.key_data),
      eot=mesh_lib.put_replicated(np.int32(self.tokenizer.eot_id), shardings.eot_id),
      cache=self._empty_cache(first.mesh, S),
      cache_buckets=[S],
      timings={'generate_s': 0.0, 'env_s': 0.0, 'host_s': 0.0},
      slots=np.full(len(slot_rows), -1, np.int64),
      waiting=collections.deque(range(len(episode_ids))),
      counts=_Counts(per_slot=np.zeros((len(slot_rows), 4), np.int64)),
    )

  def _admit(self, run: _Run, episodes: _Episodes) -> None:
    """Hands free slots to waiting episodes (lock-step: only once every slot is free); the
    newcomers form a cohort whose environment starts their games."""
    free = np.flatnonzero(run.slots < 0)
    if not run.waiting or not free.size or (not self.config.refill and free.size < len(run.slots)):
      return
    members = [run.waiting.popleft() for _ in range(min(free.size, len(run.waiting)))]
    run.slots[free[: len(members)]] = members
    t0 = time.perf_counter()
    env = self._idle_envs.pop() if self._idle_envs else registry.make_env(self.env_config)
    observations = env.reset(
      self.config.num_episodes,
      run.seed,
      group_size=self.config.group_size,
      rows=run.episode_ids[members].tolist(),
      **run.reset_options,
    )
    now = time.perf_counter()
    run.timings['env_s'] += now - t0
    for i, obs in zip(members, observations):
      episodes.observations[i] = obs
      episodes.running[i] = True
      episodes.started_s[i] = now
    run.cohorts.append(_Cohort(members=members, env=env))

  def _prepare_turn(self, run: _Run, episodes: _Episodes) -> tuple[_Turn, int]:
    """Tokenizes each occupied slot's new observation (the chunk is padded once every process
    agreed on the prompt bucket). Returns the turn and the cache fill it may reach here."""
    tok = self.tokenizer
    prompts: list[list[int]] = [[] for _ in range(len(run.slots))]
    for s in np.flatnonzero(run.slots >= 0).tolist():
      i = run.slots[s]
      ids = tok.turn_prompt_ids(episodes.observations[i], first=episodes.turns[i] == 0)
      prompts[s] = (tok.reply_suffix_ids() if episodes.unterminated[i] else []) + ids
    num_prompt = np.array([len(p) for p in prompts], np.int64)
    fill = np.where(run.slots >= 0, episodes.fill[np.maximum(run.slots, 0)], 0)
    need = fill + num_prompt + self.config.sampling.max_new_tokens
    overflow = (run.slots >= 0) & (need > self.buckets.max_length)
    played = (run.slots >= 0) & ~overflow
    num_prompt[~played] = 0
    chunk = np.zeros((len(run.slots), 0), np.int32)
    return _Turn(prompts, num_prompt, played, overflow, chunk), int(need[played].max(initial=0))

  def _play_turn(
    self, run: _Run, episodes: _Episodes, inputs: _Turn, params, *, prompt: int, reach: int
  ) -> _Turn:
    """One call of the turn program on every slot, then each cohort's environment step.

    `prompt` and `reach` are the longest prompt and the largest fill over every process's
    slots. Returns the turn as played (its chunk padded to the agreed prompt bucket).
    """
    t0 = time.perf_counter()
    if reach > run.cache.capacity:
      S = self.buckets.bucket_for(reach)
      run.cache = self._grow(run.cache, run.mesh, S)
      run.cache_buckets.append(S)
    P = self.prompt_buckets.bucket_for(max(prompt, 1))
    chunk = np.full((len(run.slots), P), self.tokenizer.pad_id, np.int32)
    for s in np.flatnonzero(inputs.played).tolist():
      chunk[s, : inputs.num_prompt[s]] = inputs.prompts[s]
    inputs = dataclasses.replace(inputs, chunk=chunk)
    run.timings['host_s'] += time.perf_counter() - t0

    t0 = time.perf_counter()
    program = self.programs.generate(
      run.parallel, run.cache.capacity, self.num_slots, chunk=P, greedy=run.greedy
    )
    host, run.cache = self._generate(program, params, run, episodes, inputs)
    run.timings['generate_s'] += time.perf_counter() - t0

    t0 = time.perf_counter()
    replies = self._record_replies(run, episodes, inputs, host, _legal_moves(run.cohorts))
    run.timings['host_s'] += time.perf_counter() - t0

    t0 = time.perf_counter()
    slot_of = {i: s for s, i in enumerate(run.slots.tolist()) if i >= 0}
    texts = [[replies.get(i, '') for i in cohort.members] for cohort in run.cohorts]
    envs_now = [cohort.env for cohort in run.cohorts]
    results = type(envs_now[0]).step_many(envs_now, texts) if envs_now else []
    for cohort, result in zip(run.cohorts, results):
      played = [i in slot_of and inputs.played[slot_of[i]] for i in cohort.members]
      overflow = [i in slot_of and inputs.overflow[slot_of[i]] for i in cohort.members]
      episodes.score(cohort.members, result, played, overflow)
    run.timings['env_s'] += time.perf_counter() - t0
    return inputs

  def _generate(self, program, params, run: _Run, episodes: _Episodes, turn: _Turn) -> tuple:
    """Runs the turn program on every slot, each process putting its own; returns this
    process's slots of (tokens, log-probs, counts, stopped) and the cache."""
    shardings: sampler.RolloutArgs = program.program.in_shardings
    B = self.num_slots
    rows = run.slot_rows
    held = np.maximum(run.slots, 0)
    episode_ids = np.where(run.slots >= 0, run.episode_ids[held], 0).astype(np.int32)
    turns = np.where(run.slots >= 0, episodes.turns[held], 1).astype(np.int32)
    put = lambda x, sh: mesh_lib.put_rows(x, rows, (B, *x.shape[1:]), sh)  # noqa: E731
    args = sampler.RolloutArgs(
      params=params,
      cache=run.cache,
      prompt=put(turn.chunk, shardings.prompt),
      num_prompt=put(turn.num_prompt.astype(np.int32), shardings.num_prompt),
      key_data=run.key_data,
      episode_ids=put(episode_ids, shardings.episode_ids),
      turns=put(turns, shardings.turns),
      eot_id=run.eot,
    )
    gen, cache = program(*args)
    host = []
    for x in (gen.tokens, gen.logprobs, gen.num_tokens, gen.stopped):
      got, values = mesh_lib.host_rows(x)
      if not np.array_equal(got, rows):
        raise AssertionError(f'rollout rows {got[:8]} read back where {rows[:8]} were put.')
      host.append(values)
    return tuple(host), cache

  def _record_replies(
    self, run: _Run, episodes: _Episodes, turn: _Turn, host, legal: dict[int, int]
  ) -> dict[int, str]:
    """Books each playing slot's reply (`legal`: the bits of the moves legal where it answers,
    by episode index); returns the reply texts by episode index."""
    gen_tokens, gen_lps, gen_n, gen_stop = host
    replies: dict[int, str] = {}
    for s in np.flatnonzero(turn.played).tolist():
      i, n = int(run.slots[s]), int(gen_n[s])
      reply = gen_tokens[s, :n].tolist()
      episodes.record(i, turn.prompts[s], reply, gen_lps[s, :n].tolist(), legal.get(i, 0))
      episodes.unterminated[i] = not gen_stop[s]
      episodes.turns[i] += 1
      text_ids = reply[:-1] if gen_stop[s] else reply
      replies[i] = self.tokenizer.decode(text_ids, skip_special_tokens=True)
    run.counts.decode_steps.append(int(gen_n.max(initial=0)))
    run.counts.per_slot[:, 2] += np.where(turn.played, gen_n, 0)
    return replies

  def _count(self, run: _Run, turn: _Turn, *, drain: bool) -> None:
    """Books one call of the turn program (`drain`: no episode was waiting anywhere)."""
    counts = run.counts
    counts.calls += 1
    counts.prompt_width += turn.chunk.shape[1]
    counts.drain_calls += drain
    counts.per_slot[:, 0] += turn.num_prompt
    counts.per_slot[:, 1] += turn.played
    counts.per_slot[:, 3] += turn.played & drain

  def _retire(self, run: _Run, episodes: _Episodes) -> None:
    """Frees the slots of episodes that ended (or used up their turns) and drops cohorts
    with no episode left."""
    now = time.perf_counter()
    for s in np.flatnonzero(run.slots >= 0).tolist():
      i = run.slots[s]
      if episodes.running[i] and episodes.turns[i] >= self.max_turns:
        episodes.running[i] = False  # truncated: its outcome stays 'truncated'
      if not episodes.running[i]:
        episodes.seconds[i] = now - episodes.started_s[i]
        run.slots[s] = -1
    live = [c for c in run.cohorts if episodes.running[c.members].any()]
    for cohort in run.cohorts:
      if cohort not in live:  # its environment's reports, before a reset clears them
        for name, values in cohort.env.episode_stats().items():
          episodes.env_stats[name][cohort.members] = values
        self._idle_envs.append(cohort.env)
    run.cohorts = live

  def _stats(self, counts: _Counts, slot_rows: np.ndarray) -> dict[str, float]:
    """The schedule's statistics over every process's slots (a collective).

    decode_padded: the share of decoded slot-tokens (B x the decode steps of each call) that
    generated nothing (a finished, idle or early-stopped row). prefill_padded: the share of
    prefilled slot-tokens (B x P per call) that were padding. slot_occupancy: the share of
    slot-calls that played an episode; drain_calls: the share of the calls made once no episode
    was waiting, and drain_occupancy the occupancy over those.
    """
    B = self.num_slots
    table = np.zeros((B, counts.per_slot.shape[1]), np.int64)
    table[slot_rows] = counts.per_slot
    held = np.isin(np.arange(B), slot_rows)
    # Each slot counted once, from the process that holds it first (rows may be replicated).
    totals = distributed.gather_rows(table, held).sum(axis=0).tolist()
    prompt_tokens, playing, generated, drain_playing = totals
    steps = sum(distributed.process_max(counts.decode_steps)) if counts.decode_steps else 0
    calls = max(counts.calls, 1)
    return {
      'slots': float(B),
      'calls': float(counts.calls),
      'decode_steps': float(steps),
      'decode_padded': 1.0 - generated / max(B * steps, 1),
      'prefill_padded': 1.0 - prompt_tokens / max(B * counts.prompt_width, 1),
      'slot_occupancy': playing / (B * calls),
      'drain_calls': counts.drain_calls / calls,
      'drain_occupancy': drain_playing / max(B * counts.drain_calls, 1),
    }
