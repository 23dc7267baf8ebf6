"""The multi-turn rollout engine: a batch of episodes, one KV cache that persists across turns.

Each turn, for every running episode, the engine tokenizes only the new observation (the chat
template's turn prompt), prefills it after what the cache already holds, and decodes the reply
token by token (temperature, top-p) until the end-of-turn token or the per-turn limit. The reply
text goes to the environment, which answers with the next observation. The cache capacity is a
context bucket: when the longest episode would outgrow it, the cache is copied into the next
bucket (on device); an episode that would outgrow the largest bucket forfeits its turn (its reply
is submitted empty, which the environment penalises as invalid).

The engine records, per episode: every token, a loss mask of exactly the tokens the policy
generated, their sampling log-probs, the turn boundaries, the return, and the turn-level and
episode-level context lengths that EARL's Fig. 1 tracks.

  engine = RolloutEngine(model_cfg, graphdef, tokenizer, env_config, rollout_config, buckets)
  traj = engine.run(params, mesh, seed=step)           # host numpy Trajectories
  batch = traj.to_batch(bucket=1024, rows=64)          # an rl.trajectory.Batch (host)
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from earl_jax.config import BucketConfig, ModelConfig
from earl_jax.envs import base as envs
from earl_jax.models import qwen2
from earl_jax.models.tokenizer import Tokenizer
from earl_jax.rl.trajectory import Batch
from earl_jax.rollout import sampler
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding import rules


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
      raise ValueError(
        f'RolloutConfig: group_size={self.group_size} must be a positive divisor of '
        f'num_episodes={self.num_episodes}.'
      )
    if self.max_turns is not None and self.max_turns <= 0:
      raise ValueError(f'RolloutConfig.max_turns must be positive, got {self.max_turns}.')
    BucketConfig(lengths=tuple(self.prompt_buckets))  # validates the table
    tokens = self.reply_tokens
    if not isinstance(tokens, tuple) or not all(isinstance(t, str) and t for t in tokens):
      raise ValueError(
        f'RolloutConfig.reply_tokens must be a tuple of non-empty strings, got {tokens!r}.'
      )
    if len(set(tokens)) != len(tokens):
      raise ValueError(f'RolloutConfig.reply_tokens has duplicates: {tokens!r}.')


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


@dataclasses.dataclass
class Trajectories:
  """Finished episodes on the host. Arrays are [B, L] with L the longest episode."""

  tokens: np.ndarray  # int32 [B, L], right-padded with the tokenizer's pad id
  loss_mask: np.ndarray  # bool [B, L]: tokens the policy generated
  logprobs: np.ndarray  # f32 [B, L]: their sampling log-probs (0 elsewhere)
  lengths: np.ndarray  # int32 [B]: episode-level context length (tokens)
  returns: np.ndarray  # f32 [B]: the episode return (sum of its rewards)
  turn_rewards: list[list[float]]  # the reward each turn earned
  group_ids: np.ndarray  # int32 [B]
  turn_starts: list[list[int]]  # token index where each turn's prompt starts
  turn_tokens: list[list[int]]  # tokens of each turn (prompt + reply): turn-level context length
  outcomes: list[str]  # 'win' | 'loss' | 'draw' | 'invalid' | 'overflow' | 'truncated'
  generated_tokens: int
  cache_buckets: list[int]
  timings: dict[str, float]

  @property
  def num_episodes(self) -> int:
    return len(self.outcomes)

  def win_rate(self) -> float:
    return float(np.mean([o == 'win' for o in self.outcomes]))

  def outcome_rates(self) -> dict[str, float]:
    n = len(self.outcomes)
    return {o: sum(x == o for x in self.outcomes) / n for o in sorted(set(self.outcomes))}

  def context_stats(self) -> dict[str, float]:
    turns = [t for row in self.turn_tokens for t in row]
    return {
      'episode_len_mean': float(np.mean(self.lengths)),
      'episode_len_max': float(np.max(self.lengths)),
      'episode_len_p95': float(np.percentile(self.lengths, 95)),
      'turn_len_mean': float(np.mean(turns)) if turns else 0.0,
      'turns_mean': float(np.mean([len(t) for t in self.turn_tokens])),
    }

  def token_returns(self, gamma: float) -> np.ndarray:
    """[B, L] f32: on every generated token, the discounted reward-to-go from its turn on.

    G_t = sum_k gamma^(k - t) r_k over the episode's turns k >= t; 0 on template tokens.
    """
    out = np.zeros(self.tokens.shape, np.float32)
    for i, rewards in enumerate(self.turn_rewards):
      g, returns = 0.0, [0.0] * len(rewards)
      for t in range(len(rewards) - 1, -1, -1):
        g = rewards[t] + gamma * g
        returns[t] = g
      starts = [*self.turn_starts[i], int(self.lengths[i])]
      for t, g in enumerate(returns):
        lo, hi = starts[t], starts[t + 1]
        out[i, lo:hi] = np.where(self.loss_mask[i, lo:hi], g, 0.0)
    return out

  def to_batch(self, *, bucket: int, rows: int, gamma: float = 1.0) -> Batch:
    """A host Batch with `rows` rows (padding rows are invalid) and tokens padded to `bucket`.

    `gamma` discounts the per-token reward-to-go (`Batch.returns`).
    """
    B, L = self.tokens.shape
    if bucket < L:
      raise ValueError(f'to_batch: bucket {bucket} is shorter than the longest episode ({L}).')
    if rows < B:
      raise ValueError(f'to_batch: rows={rows} is fewer than the {B} episodes.')
    out = Batch.zeros(rows, bucket)
    pad = lambda x, v=0: np.pad(x, ((0, rows - B), (0, bucket - L)), constant_values=v)  # noqa: E731
    return out.replace(
      tokens=pad(self.tokens).astype(np.int32),
      loss_mask=pad(self.loss_mask, False),
      sample_logprobs=pad(self.logprobs).astype(np.float32),
      returns=pad(self.token_returns(gamma)),
      rewards=np.pad(self.returns, (0, rows - B)).astype(np.float32),
      lengths=np.pad(self.lengths, (0, rows - B)).astype(np.int32),
      group_ids=np.pad(self.group_ids, (0, rows - B)).astype(np.int32),
      valid=np.arange(rows) < B,
    )


class RolloutEngine:
  """Runs batched multi-turn episodes of `env_config` with the policy `graphdef` + params."""

  def __init__(
    self,
    model_cfg: ModelConfig,
    graphdef: nnx.GraphDef,
    tokenizer: Tokenizer,
    env_config: envs.EnvConfig,
    config: RolloutConfig,
    buckets: BucketConfig,
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
    self.model_cfg = model_cfg
    self.graphdef = graphdef
    self.tokenizer = tokenizer
    self.env_config = env_config
    self.config = config
    self.buckets = buckets
    self.prompt_buckets = BucketConfig(lengths=tuple(config.prompt_buckets))
    self.token_ids = reply_token_ids(tokenizer, config.reply_tokens, model_cfg.vocab_size)
    self._generate = jax.jit(
      functools.partial(self._generate_impl, greedy=False), donate_argnums=(1,)
    )
    self._generate_greedy = jax.jit(
      functools.partial(self._generate_impl, greedy=True), donate_argnums=(1,)
    )
    self._grow = jax.jit(self._grow_impl, static_argnums=(1,), donate_argnums=(0,))
    self._empty_cache = jax.jit(self._empty_cache_impl, static_argnums=(0, 1))

  def _empty_cache_impl(self, batch: int, capacity: int) -> qwen2.KVCache:
    cache = qwen2.KVCache.abstract(self.model_cfg, batch, capacity)
    return _constrain_cache(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache))

  def _grow_impl(self, cache: qwen2.KVCache, capacity: int) -> qwen2.KVCache:
    extra = capacity - cache.capacity
    grow = lambda x: jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))  # noqa: E731
    return _constrain_cache(
      dataclasses.replace(cache, k=tuple(map(grow, cache.k)), v=tuple(map(grow, cache.v)))
    )

  def _generate_impl(self, params, cache, prompt, num_prompt, key, *, greedy: bool):
    model = nnx.merge(self.graphdef, params)
    config = dataclasses.replace(self.config.sampling, greedy=greedy or self.config.sampling.greedy)
    gen, cache = sampler.generate(
      model,
      cache,
      prompt,
      num_prompt,
      key,
      eot_id=self.tokenizer.eot_id,
      config=config,
      token_ids=self.token_ids,
    )
    return gen, _constrain_cache(cache)

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
      params: the policy's parameters, sharded on `mesh`.
      mesh: the rollout stage's mesh.
      seed: seeds the environment and the sampler (the whole rollout is deterministic in it).
      greedy: argmax decoding (evaluation).
      capacity: the initial cache bucket (e.g. the selector's choice); grown as needed.
    """
    cfg, tok = self.config, self.tokenizer
    B, N = cfg.num_episodes, cfg.sampling.max_new_tokens
    mesh_lib.check_batch_fits(mesh_lib.parallel_config_of(mesh), B, what='num_episodes')
    env = envs.make_env(self.env_config)
    max_turns = cfg.max_turns or env.max_turns
    timings = {'generate_s': 0.0, 'env_s': 0.0, 'host_s': 0.0}
    t0 = time.perf_counter()
    obs = env.reset(B, seed, group_size=cfg.group_size)
    timings['env_s'] += time.perf_counter() - t0

    rows: list[list[int]] = [[] for _ in range(B)]
    masks: list[list[bool]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    turn_starts: list[list[int]] = [[] for _ in range(B)]
    turn_tokens: list[list[int]] = [[] for _ in range(B)]
    outcomes: list[str] = ['truncated'] * B
    returns = np.zeros(B, np.float32)
    turn_rewards: list[list[float]] = [[] for _ in range(B)]
    active = np.ones(B, bool)
    unterminated = np.zeros(B, bool)  # last reply hit the limit without an end-of-turn token
    fill = np.zeros(B, np.int64)  # host mirror of the cache lengths
    generated = 0
    row_sharding = NamedSharding(mesh, rules.spec(('batch', 'seq')))
    key = jax.random.fold_in(jax.random.key(seed), 0x5EED)
    generate = self._generate_greedy if greedy else self._generate

    with jax.set_mesh(mesh):
      S = capacity or self.buckets.lengths[0]
      cache = self._empty_cache(B, S)
      cache_buckets = [S]
      for turn in range(max_turns):
        if not active.any():
          break
        t0 = time.perf_counter()
        prompts = [[] for _ in range(B)]
        for i in np.flatnonzero(active).tolist():
          ids = tok.turn_prompt_ids(obs[i], first=turn == 0)
          prompts[i] = (tok.reply_suffix_ids() if unterminated[i] else []) + ids
        num_prompt = np.array([len(p) for p in prompts], np.int64)
        need = fill + num_prompt + N
        overflow = active & (need > self.buckets.max_length)
        run_rows = active & ~overflow
        num_prompt[~run_rows] = 0
        P = self.prompt_buckets.bucket_for(max(int(num_prompt.max()), 1))
        prompt = np.full((B, P), tok.pad_id, np.int32)
        for i in np.flatnonzero(run_rows).tolist():
          prompt[i, : num_prompt[i]] = prompts[i]
        if run_rows.any() and need[run_rows].max() > S:
          S = self.buckets.bucket_for(int(need[run_rows].max()))
          cache = self._grow(cache, S)
          cache_buckets.append(S)
        timings['host_s'] += time.perf_counter() - t0

        t0 = time.perf_counter()
        gen, cache = generate(
          params,
          cache,
          jax.device_put(prompt, row_sharding),
          jax.device_put(num_prompt.astype(np.int32), NamedSharding(mesh, rules.spec(('batch',)))),
          jax.random.fold_in(key, turn),
        )
        gen_tokens, gen_lps, gen_n, gen_stop = jax.device_get(
          (gen.tokens, gen.logprobs, gen.num_tokens, gen.stopped)
        )
        timings['generate_s'] += time.perf_counter() - t0

        t0 = time.perf_counter()
        replies = [''] * B
        for i in np.flatnonzero(run_rows).tolist():
          n = int(gen_n[i])
          reply = gen_tokens[i, :n].tolist()
          turn_starts[i].append(len(rows[i]))
          rows[i] += prompts[i] + reply
          masks[i] += [False] * len(prompts[i]) + [True] * n
          lps[i] += [0.0] * len(prompts[i]) + gen_lps[i, :n].tolist()
          turn_tokens[i].append(len(prompts[i]) + n)
          unterminated[i] = not gen_stop[i]
          text_ids = reply[:-1] if gen_stop[i] else reply
          replies[i] = tok.decode(text_ids, skip_special_tokens=True)
          fill[i] += num_prompt[i] + n
          generated += n
        timings['host_s'] += time.perf_counter() - t0

        t0 = time.perf_counter()
        result = env.step(replies)
        timings['env_s'] += time.perf_counter() - t0
        returns += result.rewards
        for i in np.flatnonzero(run_rows).tolist():
          turn_rewards[i].append(float(result.rewards[i]))
        for i in np.flatnonzero(overflow).tolist():  # the forfeit lands on the last turn played
          if turn_rewards[i]:
            turn_rewards[i][-1] += float(result.rewards[i])
        for i in np.flatnonzero(active & result.dones).tolist():
          outcomes[i] = 'overflow' if overflow[i] else (result.infos[i]['outcome'] or 'truncated')
        active &= ~result.dones
        obs = result.observations

    L = max(1, max(len(r) for r in rows))
    tokens = np.full((B, L), tok.pad_id, np.int32)
    loss_mask = np.zeros((B, L), bool)
    logprobs = np.zeros((B, L), np.float32)
    for i in range(B):
      n = len(rows[i])
      tokens[i, :n] = rows[i]
      loss_mask[i, :n] = masks[i]
      logprobs[i, :n] = lps[i]
    return Trajectories(
      tokens=tokens,
      loss_mask=loss_mask,
      logprobs=logprobs,
      lengths=np.array([len(r) for r in rows], np.int32),
      returns=returns,
      turn_rewards=turn_rewards,
      group_ids=(np.arange(B) // cfg.group_size).astype(np.int32),
      turn_starts=turn_starts,
      turn_tokens=turn_tokens,
      outcomes=outcomes,
      generated_tokens=generated,
      cache_buckets=cache_buckets,
      timings=timings,
    )


def _constrain_cache(cache: qwen2.KVCache) -> qwen2.KVCache:
  return dataclasses.replace(
    cache,
    k=tuple(rules.constrain(x, qwen2.KVCache.LOGICAL) for x in cache.k),
    v=tuple(rules.constrain(x, qwen2.KVCache.LOGICAL) for x in cache.v),
    lengths=rules.constrain(cache.lengths, ('cache_batch',)),
  )
