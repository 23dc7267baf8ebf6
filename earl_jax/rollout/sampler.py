"""Jitted generation against a bucketed KV cache: prefill a chunk, then decode token by token.

`prefill` writes a right-padded chunk of new tokens (a turn's observation) after each row's
current fill and returns the logits that follow the last real token. `decode` then samples one
token at a time with temperature and top-p until every active row has emitted the end-of-turn
token or the per-turn limit. Both are pure functions of (model, cache, ...); `generate` chains
them and is what the rollout engine jits, once per (batch, chunk bucket, cache bucket). The
engine samples each row with its own key (`row_keys`: episode id, turn), so that a row's tokens
do not depend on which slot it runs in or on what the other rows hold.

Recorded log-probs are those of the sampled token under the temperature-scaled model
distribution (before top-p truncation): exactly what a full forward over the final tokens gives
for log_softmax(logits / temperature), which is what the policy-gradient ratio needs.

Constrained decoding: with `token_ids`, replies are drawn from those vocabulary ids alone (the
softmax runs over them; every other logit is masked), and `qwen2.token_logprobs(...,
token_ids=...)` gives the same restricted policy's log-probs for training.
"""

import dataclasses
import typing
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from earl_jax.errors import ConfigError
from earl_jax.models.qwen2 import KVCache, Qwen2, restrict_logits

# The lowest sampling temperature. The policy's gradients scale as 1 / temperature: far below it
# they overflow float32 and every update is skipped (1e-30 skipped every step).
MIN_TEMPERATURE = 1e-2


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How replies are sampled.

  Attributes:
    temperature: >= `MIN_TEMPERATURE`; logits are divided by it. Use `greedy` for argmax
      decoding.
    top_p: nucleus mass in (0, 1]; 1 disables truncation.
    max_new_tokens: the per-turn token limit (the end-of-turn token counts).
    greedy: argmax instead of sampling (temperature still scales the recorded log-probs).
    explore: the probability that a sampled token is instead drawn uniformly from the allowed
      tokens (the reply tokens, or the whole vocabulary), uncorrected: its recorded log-prob is
      the policy's, so the update treats it as the policy's own sample. A rare good action then
      gets the full gradient of log p at its small p, which a policy that has collapsed onto
      one action never samples itself. 0 (the default) draws nothing more. Never with `greedy`.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  max_new_tokens: int = 8
  greedy: bool = False
  explore: float = 0.0

  def __post_init__(self):
    if not MIN_TEMPERATURE <= self.temperature < float('inf'):
      raise ConfigError(
        f'SamplingConfig.temperature must be a number >= {MIN_TEMPERATURE} (the gradients scale '
        'as 1 / temperature: far below it they overflow and every step is skipped; greedy=true '
        f'decodes by argmax), got {self.temperature}.'
      )
    if not 0 < self.top_p <= 1:
      raise ConfigError(f'SamplingConfig.top_p must be in (0, 1], got {self.top_p}.')
    if self.max_new_tokens < 1:
      raise ConfigError(f'SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}.')
    if not 0.0 <= self.explore < 1.0:
      raise ConfigError(f'SamplingConfig.explore must be in [0, 1), got {self.explore}.')


def prefill(
  model: Qwen2,
  cache: KVCache,
  tokens: Int[Array, 'B T'],
  num_new: Int[Array, ' B'],
) -> tuple[Float[Array, 'B V'], KVCache]:
  """Appends the first `num_new[b]` tokens of each row after its fill; returns next-token logits.

  Rows with num_new == 0 are left as they were (their returned logits are meaningless).
  """
  T = tokens.shape[1]
  positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  h, cache = model(tokens, positions, cache)
  last = jnp.clip(num_new - 1, 0, T - 1)
  h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]  # [B, D]
  logits = model.logits(h_last)
  return logits, dataclasses.replace(cache, lengths=cache.lengths + num_new.astype(jnp.int32))


def _top_p_mask(logits: Float[Array, 'B V'], top_p: float) -> Float[Array, 'B V']:
  """Sets logits outside the smallest set of tokens with mass >= top_p to -inf."""
  probs = jax.nn.softmax(logits, axis=-1)
  order = jnp.argsort(-probs, axis=-1)
  sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  keep_sorted = mass_before < top_p  # the first token is always kept
  keep = (
    jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
  )
  return jnp.where(keep, logits, -jnp.inf)


def sample_token(
  logits: Float[Array, 'B V'],
  key: jax.Array,
  config: SamplingConfig,
  token_ids: tuple[int, ...] | None = None,
) -> tuple[Int[Array, ' B'], Float[Array, ' B']]:
  """One token per row and its log-prob under softmax(logits / temperature) (over `token_ids`).

  `key` is one PRNG key for the whole batch, or a key per row (shape [B]): row b then draws
  with its own key alone, whatever the other rows hold.
  """
  scaled = logits.astype(jnp.float32) / config.temperature
  if token_ids is not None:
    scaled = restrict_logits(scaled, token_ids)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  if config.greedy:
    token = jnp.argmax(scaled, axis=-1)
  else:
    masked = _top_p_mask(scaled, config.top_p) if config.top_p < 1 else scaled
    if key.ndim:  # one key per row
      token = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, masked)
    else:
      token = jax.random.categorical(key, masked, axis=-1)
    if config.explore > 0:
      token = _explore(token, key, config.explore, scaled.shape[-1], token_ids)
  token = token.astype(jnp.int32)
  return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _explore(
  token: Int[Array, ' B'],
  key: jax.Array,
  rate: float,
  vocab_size: int,
  token_ids: tuple[int, ...] | None,
) -> Int[Array, ' B']:
  """`token` with probability 1 - `rate` per row, else a uniform draw from `token_ids` (or the
  whole vocabulary), from keys folded off the sampling key (a per-row key stays per row)."""
  allowed = jnp.asarray(token_ids if token_ids is not None else np.arange(vocab_size), jnp.int32)

  def draw(k, shape):
    coin_key, pick_key = jax.random.split(jax.random.fold_in(k, 0x5EED))
    coin = jax.random.uniform(coin_key, shape) < rate
    return coin, allowed[jax.random.randint(pick_key, shape, 0, allowed.shape[0])]

  if key.ndim:
    coin, pick = jax.vmap(lambda k: draw(k, ()))(key)
  else:
    coin, pick = draw(key, token.shape)
  return jnp.where(coin, pick, token)


# Pytree container: its fields also hold shardings and ShapeDtypeStructs (for jit and AOT), so
# the shape annotations document it and the runtime checker skips it.
@typing.no_type_check
@flax.struct.dataclass
class Generation:
  """What `decode` produced for each row (columns past `num_tokens[b]` are padding)."""

  tokens: Int[Array, 'B N']
  logprobs: Float[Array, 'B N']
  num_tokens: Int[Array, ' B']
  stopped: Bool[Array, ' B']  # emitted the end-of-turn token (else hit the per-turn limit)


def decode(
  model: Qwen2,
  cache: KVCache,
  logits: Float[Array, 'B V'],
  active: Bool[Array, ' B'],
  key: jax.Array,
  *,
  eot_id: int | Int[Array, ''],
  config: SamplingConfig,
  token_ids: tuple[int, ...] | None = None,
) -> tuple[Generation, KVCache]:
  """Samples up to `config.max_new_tokens` tokens for each active row, feeding each one back.

  Every sampled token (the end-of-turn token included) is written to the cache, so the next
  turn's prompt follows it directly. Inactive rows generate nothing and their fill is unchanged.
  Token i uses `jax.random.fold_in(key, i)`: sampling is deterministic given `key`. With one key
  per row (`key` of shape [B], see `row_keys`), a row's tokens depend on its own key alone.
  """
  B = logits.shape[0]
  N = config.max_new_tokens

  def cond(carry):
    i, _, _, _, done, _ = carry
    return (i < N) & ~jnp.all(done)

  def body(carry):
    i, logits, cache, gen, done, stopped = carry
    token_key = (
      jax.vmap(jax.random.fold_in, (0, None))(key, i) if key.ndim else jax.random.fold_in(key, i)
    )
    token, logp = sample_token(logits, token_key, config, token_ids)
    live = ~done
    gen = dataclasses.replace(
      gen,
      tokens=gen.tokens.at[:, i].set(jnp.where(live, token, 0)),
      logprobs=gen.logprobs.at[:, i].set(jnp.where(live, logp, 0.0)),
      num_tokens=gen.num_tokens + live.astype(jnp.int32),
    )
    h, cache = model(token[:, None], cache.lengths[:, None], cache)
    cache = dataclasses.replace(cache, lengths=cache.lengths + live.astype(jnp.int32))
    hit_eot = live & (token == eot_id)
    return i + 1, model.logits(h[:, 0]), cache, gen, done | hit_eot, stopped | hit_eot

  gen = Generation(
    tokens=jnp.zeros((B, N), jnp.int32),
    logprobs=jnp.zeros((B, N), jnp.float32),
    num_tokens=jnp.zeros((B,), jnp.int32),
    stopped=jnp.zeros((B,), bool),
  )
  carry = (jnp.int32(0), logits, cache, gen, ~active, jnp.zeros((B,), bool))
  _, _, cache, gen, _, stopped = jax.lax.while_loop(cond, body, carry)
  return dataclasses.replace(gen, stopped=stopped), cache


def row_keys(key: jax.Array, episode_ids: Int[Array, ' B'], turns: Int[Array, ' B']) -> jax.Array:
  """One PRNG key per row: `key` folded with the row's episode id, then its turn.

  Token i of a turn then draws with `fold_in(row key, i)` (`decode`): the randomness of a token
  depends on (episode, turn, token index) only, never on the row (slot) the episode runs in or
  on how many turns the batch has taken, so that any schedule of the same episodes samples the
  same tokens.
  """
  fold = lambda e, t: jax.random.fold_in(jax.random.fold_in(key, e), t)  # noqa: E731
  return jax.vmap(fold)(episode_ids, turns)


class RolloutArgs(NamedTuple):
  """The positional arguments of a compiled rollout program (`programs.builders.rollout_program`),
  in the order the program takes them; each field holds a value, its sharding, or its
  ShapeDtypeStruct (`Program.abstract_args`, `Program.in_shardings`).

  Attributes:
    params: the model parameters (`nnx.State`).
    cache: the `KVCache` of capacity S (donated; comes back updated).
    prompt: int32 [B, P], each row's new prompt tokens, right-padded.
    num_prompt: int32 [B], the real tokens of each row's prompt (0: the row idles).
    key_data: uint32 [2], `jax.random.key_data` of the rollout's PRNG key (its seed).
    episode_ids: int32 [B], the episode each row plays (keys its sampling, `row_keys`).
    turns: int32 [B], the episode's turn; 0 starts the episode: the row's fill is reset before
      its first observation is prefilled (a slot handed to the next episode).
    eot_id: int32 [], the end-of-turn id (-1: never sampled, every row decodes N tokens).
  """

  params: Any
  cache: Any
  prompt: Any
  num_prompt: Any
  key_data: Any
  episode_ids: Any
  turns: Any
  eot_id: Any


def generate(
  model: Qwen2,
  cache: KVCache,
  prompt: Int[Array, 'B T'],
  num_prompt: Int[Array, ' B'],
  key: jax.Array,
  *,
  eot_id: int | Int[Array, ''],
  config: SamplingConfig,
  token_ids: tuple[int, ...] | None = None,
  restart: Bool[Array, ' B'] | None = None,
) -> tuple[Generation, KVCache]:
  """Prefills each row's new prompt tokens, then decodes its reply (rows with no prompt idle).

  `key`: one key, or one per row (see `decode`). `restart`: rows that start a new episode;
  their fill is reset to 0 first, so the prompt is written from the row's first slot (the
  previous episode's keys and values stay behind, masked until overwritten).
  """
  if restart is not None:
    cache = dataclasses.replace(cache, lengths=jnp.where(restart, 0, cache.lengths))
  logits, cache = prefill(model, cache, prompt, num_prompt)
  return decode(
    model, cache, logits, num_prompt > 0, key, eot_id=eot_id, config=config, token_ids=token_ids
  )
