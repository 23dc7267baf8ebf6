"""The multi-turn rollout engine: a batch of episodes, one KV cache that persists across turns.

Each turn, for every running episode, the engine tokenizes only the new observation (the chat
template's turn prompt), prefills it after what the cache already holds, and decodes the reply
token by token (temperature, top-p) until the end-of-turn token or the per-turn limit. The reply
text goes to the environment, which answers with the next observation. The cache capacity is a
context bucket: when the longest episode would outgrow it, the cache is copied into the next
bucket (on device); an episode that would outgrow the largest bucket forfeits its turn (its reply
is submitted empty, which the environment penalises as invalid).

Every turn runs a compiled rollout program taken from `programs` (a `programs.Executables`, whose
`generate(config, S, B, chunk=P, greedy=...)` gives the program of one cache bucket S and prompt
bucket P): the very programs the Parallelism Selector profiles and precompiles.

The engine records, per episode: every token, a loss mask of exactly the tokens the policy
generated, their sampling log-probs, the turn boundaries, the return, and the turn-level and
episode-level context lengths that EARL's Fig. 1 tracks (`trajectories.Trajectories`).

  exe = Executables(model_cfg, spec=StageSpec.for_rollout(rollout_config, tokenizer, model_cfg))
  engine = RolloutEngine(model_cfg, tokenizer, env_config, rollout_config, buckets, programs=exe)
  traj = engine.run(params, mesh, seed=step)           # host numpy Trajectories
  batch = traj.to_batch(bucket=1024, rows=64)          # an rl.batch.Batch (host)
"""

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
    num_episodes: episodes run side by side (the number of responses: the stage's load).
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
  group_size: int = 1
  max_turns: int | None = None
  sampling: sampler.SamplingConfig = dataclasses.field(
    default_factory=lambda: sampler.SamplingConfig(max_new_tokens=4)
  )
  prompt_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
  reply_tokens: tuple[str, ...] = ()

  def __post_init__(self):
    if self.num_episodes <= 0 or self.group_size <= 0 or self.num_episodes % self.group_size:
      raise ConfigError(
        f'RolloutConfig: group_size={self.group_size} must be a positive divisor of '
        f'num_episodes={self.num_episodes}.'
      )
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
  ids = []
  for text in reply_tokens:
    encoded = tokenizer.encode(text)
    if len(encoded) != 1:
      raise ValueError(
        f'RolloutConfig.reply_tokens entry {text!r} encodes to {len(encoded)} tokens '
        f'{encoded}; each entry must be exactly one token of {tokenizer!r}.'
      )
    if not 0 <= encoded[0] < vocab_size:
      raise ValueError(
        f'RolloutConfig.reply_tokens entry {text!r} is id {encoded[0]}, outside the model '
        f'vocabulary of {vocab_size}.'
      )
    ids.append(encoded[0])
  if len(set(ids)) != len(ids):
    raise ValueError(f'RolloutConfig.reply_tokens {reply_tokens!r} map to repeated ids {ids}.')
  return tuple(sorted(ids))


@runtime_checkable
class GeneratePrograms(Protocol):
  """Where the engine gets its compiled turn programs (`programs.Executables` is one).

  `generate(config, bucket, rows, chunk=P, greedy=g)` returns a callable with a `.program`
  (its `in_shardings` place the inputs) that maps (params, cache, prompt [B, P], num_prompt [B],
  key, eot_id) to (Generation, cache); `spec.sampling` is the sampling it was built for.
  """

  spec: Any

  def generate(
    self, config: ParallelConfig, bucket: int, rows: int, *, chunk: int, greedy: bool
  ) -> Any: ...


@dataclasses.dataclass
class _Episodes:
  """The host side of a rollout in progress: what every episode has played so far."""

  rows: list[list[int]]
  masks: list[list[bool]]
  logprobs: list[list[float]]
  turn_starts: list[list[int]]
  turn_tokens: list[list[int]]
  turn_rewards: list[list[float]]
  outcomes: list[str]
  returns: np.ndarray  # f32 [B]
  active: np.ndarray  # bool [B]
  unterminated: np.ndarray  # bool [B]: the last reply hit the limit without an end-of-turn
  fill: np.ndarray  # int64 [B]: host mirror of the cache lengths
  thoughts: np.ndarray  # int32 [B]: turns that thought instead of moving (the env's hints)
  generated: int = 0

  @classmethod
  def empty(cls, B: int) -> '_Episodes':
    lists = lambda: [[] for _ in range(B)]  # noqa: E731
    return cls(
      rows=lists(),
      masks=lists(),
      logprobs=lists(),
      turn_starts=lists(),
      turn_tokens=lists(),
      turn_rewards=lists(),
      outcomes=['truncated'] * B,
      returns=np.zeros(B, np.float32),
      active=np.ones(B, bool),
      unterminated=np.zeros(B, bool),
      fill=np.zeros(B, np.int64),
      thoughts=np.zeros(B, np.int32),
    )

  def record(self, i: int, prompt: list[int], reply: list[int], logprobs: list[float]) -> None:
    """Appends one turn (its prompt and the policy's reply) to episode i."""
    self.turn_starts[i].append(len(self.rows[i]))
    self.rows[i] += prompt + reply
    self.masks[i] += [False] * len(prompt) + [True] * len(reply)
    self.logprobs[i] += [0.0] * len(prompt) + logprobs
    self.turn_tokens[i].append(len(prompt) + len(reply))
    self.fill[i] += len(prompt) + len(reply)
    self.generated += len(reply)

  def score(self, result: envs.StepResult, played: np.ndarray, overflow: np.ndarray) -> None:
    """Books a step's rewards and finished episodes."""
    self.returns += result.rewards
    for i in np.flatnonzero(played).tolist():
      self.turn_rewards[i].append(float(result.rewards[i]))
      self.thoughts[i] += result.infos[i].get('hint') is not None
    for i in np.flatnonzero(overflow).tolist():  # the forfeit lands on the last turn played
      if self.turn_rewards[i]:
        self.turn_rewards[i][-1] += float(result.rewards[i])
    for i in np.flatnonzero(self.active & result.dones).tolist():
      self.outcomes[i] = 'overflow' if overflow[i] else (result.infos[i]['outcome'] or 'truncated')
    self.active &= ~result.dones

  def trajectories(
    self,
    *,
    pad_id: int,
    group_size: int,
    cache_buckets: list[int],
    timings: dict[str, float],
    row_ids: np.ndarray,
    batch_rows: int,
  ) -> Trajectories:
    B = len(self.rows)
    T = max(1, max(len(r) for r in self.rows))
    tokens = np.full((B, T), pad_id, np.int32)
    loss_mask = np.zeros((B, T), bool)
    logprobs = np.zeros((B, T), np.float32)
    for i in range(B):
      n = len(self.rows[i])
      tokens[i, :n] = self.rows[i]
      loss_mask[i, :n] = self.masks[i]
      logprobs[i, :n] = self.logprobs[i]
    return Trajectories(
      tokens=tokens,
      loss_mask=loss_mask,
      logprobs=logprobs,
      lengths=np.array([len(r) for r in self.rows], np.int32),
      returns=self.returns,
      turn_rewards=self.turn_rewards,
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
    )


@dataclasses.dataclass(frozen=True)
class _Turn:
  """One turn's inputs for this process's rows: each row's new prompt tokens, which rows play,
  and the padded chunk (P is the prompt bucket every process agreed on)."""

  prompts: list[list[int]]
  num_prompt: np.ndarray  # int64 [B]: 0 for rows that do not play
  played: np.ndarray  # bool [B]
  overflow: np.ndarray  # bool [B]: would outgrow the largest bucket; forfeits the turn
  need: np.ndarray  # int64 [B]: the cache fill this turn may reach
  chunk: np.ndarray  # int32 [B, P]


@dataclasses.dataclass
class _Run:
  """One rollout's device side: its layout, this process's rows, the key, the growing cache."""

  parallel: ParallelConfig
  mesh: jax.sharding.Mesh
  rows: np.ndarray  # int64 [R]: the rows this process plays
  greedy: bool
  key: jax.Array
  eot: jax.Array
  cache: qwen2.KVCache
  cache_buckets: list[int]
  timings: dict[str, float]


class RolloutEngine:
  """Runs batched multi-turn episodes of `env_config` with the rollout programs of `programs`."""

  def __init__(
    self,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    env_config: envs.EnvConfig,
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

  @property
  def token_ids(self) -> tuple[int, ...] | None:
    """The constrained reply vocabulary of the programs (None: the whole vocabulary)."""
    return self.programs.spec.token_ids

  # -- the KV cache ---------------------------------------------------------------------------------

  def _empty_cache(self, mesh: jax.sharding.Mesh, capacity: int) -> qwen2.KVCache:
    """A zero cache of `capacity` laid out as the rollout programs on `mesh` take it."""
    key = ('empty', mesh, capacity)
    if key not in self._cache_ops:
      abstract = qwen2.KVCache.abstract(self.model_cfg, self.config.num_episodes, capacity)
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

  # -- one turn -------------------------------------------------------------------------------------

  def _prepare_turn(self, turn: int, obs: list[str], ep: _Episodes) -> tuple[_Turn, int]:
    """Tokenizes each playing row's new observation and pads the chunk to a prompt bucket.

    Returns the turn and the cache fill it may reach, both agreed by every process (the prompt
    bucket and the cache bucket are shapes of the one program they all run).
    """
    tok = self.tokenizer
    prompts: list[list[int]] = [[] for _ in range(len(ep.rows))]
    for i in np.flatnonzero(ep.active).tolist():
      ids = tok.turn_prompt_ids(obs[i], first=turn == 0)
      prompts[i] = (tok.reply_suffix_ids() if ep.unterminated[i] else []) + ids
    num_prompt = np.array([len(p) for p in prompts], np.int64)
    need = ep.fill + num_prompt + self.config.sampling.max_new_tokens
    overflow = ep.active & (need > self.buckets.max_length)
    played = ep.active & ~overflow
    num_prompt[~played] = 0
    longest, reach = distributed.process_max(
      [int(num_prompt.max(initial=0)), int(need[played].max(initial=0))]
    )
    P = self.prompt_buckets.bucket_for(max(longest, 1))
    chunk = np.full((len(ep.rows), P), tok.pad_id, np.int32)
    for i in np.flatnonzero(played).tolist():
      chunk[i, : num_prompt[i]] = prompts[i]
    return _Turn(prompts, num_prompt, played, overflow, need, chunk), reach

  def _generate(self, program, params, cache, turn: _Turn, rows, key_data, eot) -> tuple:
    """Runs the turn's program on the whole batch, each process putting its own `rows`; returns
    this process's rows of (tokens, log-probs, counts, stopped) and the cache."""
    sh = program.program.in_shardings
    B, P = self.config.num_episodes, turn.chunk.shape[1]
    gen, cache = program(
      params,
      cache,
      mesh_lib.put_rows(turn.chunk, rows, (B, P), sh[2]),
      mesh_lib.put_rows(turn.num_prompt.astype(np.int32), rows, (B,), sh[3]),
      mesh_lib.put_replicated(key_data, sh[4]),
      eot,
    )
    host = []
    for x in (gen.tokens, gen.logprobs, gen.num_tokens, gen.stopped):
      got, values = mesh_lib.host_rows(x)
      if not np.array_equal(got, rows):
        raise AssertionError(f'rollout rows {got[:8]} read back where {rows[:8]} were put.')
      host.append(values)
    return tuple(host), cache

  def _record_replies(self, ep: _Episodes, turn: _Turn, host) -> list[str]:
    """Books each playing row's reply; returns the reply texts for the environment."""
    gen_tokens, gen_lps, gen_n, gen_stop = host
    replies = [''] * len(ep.rows)
    for i in np.flatnonzero(turn.played).tolist():
      n = int(gen_n[i])
      reply = gen_tokens[i, :n].tolist()
      ep.record(i, turn.prompts[i], reply, gen_lps[i, :n].tolist())
      ep.unterminated[i] = not gen_stop[i]
      text_ids = reply[:-1] if gen_stop[i] else reply
      replies[i] = self.tokenizer.decode(text_ids, skip_special_tokens=True)
    return replies

  def run(
    self,
    params,
    mesh: jax.sharding.Mesh,
    *,
    seed: int,
    greedy: bool = False,
    capacity: int | None = None,
  ) -> Trajectories:
    """Plays `config.num_episodes` episodes to the end.

    Args:
      params: the policy's parameters, sharded on `mesh` as its rollout programs take them.
      mesh: the rollout stage's mesh.
      seed: seeds the environment and the sampler (the whole rollout is deterministic in it).
      greedy: argmax decoding (evaluation).
      capacity: the initial cache bucket (e.g. the selector's choice); grown as needed.
    """
    cfg = self.config
    B = cfg.num_episodes
    run = self._start(mesh, capacity, greedy or cfg.sampling.greedy, seed)
    env = registry.make_env(self.env_config)
    t0 = time.perf_counter()
    obs = env.reset(B, seed, group_size=cfg.group_size, rows=run.rows.tolist())
    run.timings['env_s'] += time.perf_counter() - t0
    ep = _Episodes.empty(len(run.rows))
    for turn in range(cfg.max_turns or env.max_turns):
      if not distributed.process_max([int(ep.active.any())])[0]:
        break
      obs = self._play_turn(run, turn, obs, ep, env, params)
    return ep.trajectories(
      pad_id=self.tokenizer.pad_id,
      group_size=cfg.group_size,
      cache_buckets=run.cache_buckets,
      timings=run.timings,
      row_ids=run.rows,
      batch_rows=B,
    )

  def _start(self, mesh, capacity: int | None, greedy: bool, seed: int) -> '_Run':
    """Checks the mesh, finds this process's rows, makes the first cache."""
    B = self.config.num_episodes
    parallel = mesh_lib.parallel_config_of(mesh)
    mesh_lib.check_batch_fits(parallel, B, what='num_episodes')
    S = capacity or self.buckets.lengths[0]
    first = self.programs.generate(
      parallel, S, B, chunk=self.prompt_buckets.lengths[0], greedy=greedy
    ).program
    if not mesh_lib.same_devices(first.mesh, mesh):
      raise ValueError(
        f'The rollout mesh {dict(mesh.shape)} is not over the devices of the rollout programs; '
        'build the programs with the devices of the mesh.'
      )
    return _Run(
      parallel=parallel,
      mesh=first.mesh,
      rows=mesh_lib.local_rows(first.in_shardings[2], (B, 1)),  # the rows this process plays
      greedy=greedy,
      key=jax.random.fold_in(jax.random.key(seed), 0x5EED),
      eot=mesh_lib.put_replicated(np.int32(self.tokenizer.eot_id), first.in_shardings[5]),
      cache=self._empty_cache(first.mesh, S),
      cache_buckets=[S],
      timings={'generate_s': 0.0, 'env_s': 0.0, 'host_s': 0.0},
    )

  def _play_turn(self, run: '_Run', turn: int, obs, ep: _Episodes, env, params) -> list[str]:
    """One turn of every running episode: prompts, the compiled turn program, the replies to
    the environment. Returns the next observations."""
    t0 = time.perf_counter()
    step, reach = self._prepare_turn(turn, obs, ep)
    if reach > run.cache.capacity:
      S = self.buckets.bucket_for(reach)
      run.cache = self._grow(run.cache, run.mesh, S)
      run.cache_buckets.append(S)
    run.timings['host_s'] += time.perf_counter() - t0

    t0 = time.perf_counter()
    program = self.programs.generate(
      run.parallel,
      run.cache.capacity,
      self.config.num_episodes,
      chunk=step.chunk.shape[1],
      greedy=run.greedy,
    )
    key_data = np.asarray(jax.random.key_data(jax.random.fold_in(run.key, turn)))
    host, run.cache = self._generate(program, params, run.cache, step, run.rows, key_data, run.eot)
    run.timings['generate_s'] += time.perf_counter() - t0

    t0 = time.perf_counter()
    replies = self._record_replies(ep, step, host)
    run.timings['host_s'] += time.perf_counter() - t0

    t0 = time.perf_counter()
    result = env.step(replies)
    run.timings['env_s'] += time.perf_counter() - t0
    ep.score(result, step.played, step.overflow)
    return result.observations
