"""Generation against a bucketed KV cache: HF greedy parity, recorded log-probs, top-p, stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.config import ModelConfig
from earl_jax.errors import ConfigError
from earl_jax.models import hf_import, qwen2
from earl_jax.rollout import sampler
from earl_jax.testing import fixture_path, small_mesh


def _generate_fn(graphdef, cfg, mesh, B, S, eot_id, config):
  def run(state, prompt, num_prompt, key):
    model = nnx.merge(graphdef, state)
    cache = qwen2.KVCache.init(cfg, B, S, mesh)
    return sampler.generate(model, cache, prompt, num_prompt, key, eot_id=eot_id, config=config)

  return jax.jit(run)


@pytest.mark.parametrize(
  'layout',
  [{'dp': 2, 'tp': 2}, {'dp': 2, 'cp': 4}, {'dp': 1, 'tp': 2, 'cp': 4}, {'dp': 1, 'cp': 8}],
)
def test_greedy_matches_hf_generate(layout):
  """Greedy decode equals HF's generate token for token, on a cache split over 'context' too
  (each device holds S / cp slots; its prefill writes and decode attention are split-K)."""
  ref = np.load(fixture_path('qwen2_tiny_reference.npz'))
  mesh = small_mesh(**layout)
  cfg, graphdef, state = hf_import.load(fixture_path('qwen2_tiny'), mesh)
  prompt = np.zeros((2, 32), np.int32)
  prompt[0] = ref['tokens'][0]
  prompt[1, :20] = ref['tokens'][0, :20]  # a shorter second row: ragged prefill
  config = sampler.SamplingConfig(greedy=True, max_new_tokens=8)
  run = _generate_fn(graphdef, cfg, mesh, 2, 64, eot_id=cfg.vocab_size, config=config)
  with jax.set_mesh(mesh):
    gen, cache = run(state, jnp.asarray(prompt), jnp.asarray([32, 20]), jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(gen.tokens[0]), ref['greedy_untied'])
  assert np.asarray(gen.num_tokens).tolist() == [8, 8]
  assert not np.asarray(gen.stopped).any()
  assert np.asarray(cache.lengths).tolist() == [40, 28]
  cp = layout.get('cp', 1)
  assert cache.k[0].sharding.shard_shape(cache.k[0].shape)[2] == 64 // cp


def test_recorded_logprobs_match_full_forward_and_stop_at_eot():
  """Sampled log-probs equal log_softmax(logits / T) of a full forward over the final tokens."""
  cfg = ModelConfig.preset('tiny')
  mesh = small_mesh(dp=2, tp=2)
  graphdef, state = qwen2.init_model(cfg, mesh, seed=0)
  B, P, S = 4, 16, 64
  temperature = 0.7
  rng = np.random.RandomState(0)
  prompt = rng.randint(0, cfg.vocab_size, (B, P)).astype(np.int32)
  num_prompt = np.array([16, 9, 3, 12], np.int32)
  eot = 7
  config = sampler.SamplingConfig(temperature=temperature, max_new_tokens=12)
  run = _generate_fn(graphdef, cfg, mesh, B, S, eot_id=eot, config=config)
  with jax.set_mesh(mesh):
    gen, cache = run(state, jnp.asarray(prompt), jnp.asarray(num_prompt), jax.random.key(3))
  tokens = np.asarray(gen.tokens)
  n = np.asarray(gen.num_tokens)
  assert (np.asarray(cache.lengths) == num_prompt + n).all()
  # Rebuild each row's full sequence and score it with the training forward.
  full = np.zeros((B, S), np.int32)
  for b in range(B):
    seq = np.concatenate([prompt[b, : num_prompt[b]], tokens[b, : n[b]]])
    full[b, : len(seq)] = seq

  def score(state, tokens):
    model = nnx.merge(graphdef, state)
    T = tokens.shape[1]
    h, _ = model(tokens, jnp.broadcast_to(jnp.arange(T), tokens.shape))
    logp = jax.nn.log_softmax(model.logits(h) / temperature, axis=-1)
    return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]

  with jax.set_mesh(mesh):
    lp = np.asarray(jax.jit(score)(state, jnp.asarray(full)))
  for b in range(B):
    expected = lp[b, num_prompt[b] - 1 : num_prompt[b] - 1 + n[b]]
    np.testing.assert_allclose(np.asarray(gen.logprobs)[b, : n[b]], expected, atol=1e-4)
    assert (tokens[b, n[b] :] == 0).all()
    hit = np.nonzero(tokens[b, : n[b]] == eot)[0]
    if np.asarray(gen.stopped)[b]:
      assert hit.tolist() == [n[b] - 1]  # stops right after the eot token
    else:
      assert n[b] == config.max_new_tokens and hit.size == 0


def test_eot_stops_each_row_independently():
  """A zero LM head makes every logit equal, so greedy picks token 0; with eot=0 rows stop at once."""
  cfg = ModelConfig.preset('tiny')
  mesh = small_mesh(dp=1, tp=1)
  graphdef, state = qwen2.init_model(cfg, mesh, seed=0)
  state['lm_head'][...] = jnp.zeros((cfg.hidden_size, cfg.vocab_size), jnp.float32)
  config = sampler.SamplingConfig(greedy=True, max_new_tokens=5)
  run = _generate_fn(graphdef, cfg, mesh, 2, 32, eot_id=0, config=config)
  with jax.set_mesh(mesh):
    gen, cache = run(state, jnp.ones((2, 4), jnp.int32), jnp.asarray([4, 0]), jax.random.key(0))
  assert np.asarray(gen.num_tokens).tolist() == [1, 0]  # row 1 had no prompt: inactive
  assert np.asarray(gen.stopped).tolist() == [True, False]
  assert np.asarray(cache.lengths).tolist() == [5, 0]


def test_top_p_keeps_the_nucleus_only():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  masked = np.asarray(sampler._top_p_mask(logits, 0.7))
  assert np.isfinite(masked[0, :2]).all() and np.isinf(masked[0, 2:]).all()
  masked = np.asarray(sampler._top_p_mask(logits, 0.1))
  assert np.isfinite(masked[0, 0]) and np.isinf(masked[0, 1:]).all()
  config = sampler.SamplingConfig(top_p=0.7, max_new_tokens=1)
  keys = jax.random.split(jax.random.key(0), 500)
  toks = jax.vmap(lambda k: sampler.sample_token(logits, k, config)[0])(keys)
  counts = np.bincount(np.asarray(toks).ravel(), minlength=4)
  assert counts[2] == counts[3] == 0
  assert 0.5 < counts[0] / counts[:2].sum() < 0.75  # renormalised 0.5 / 0.8 = 0.625


def test_sampling_is_deterministic_given_a_key():
  logits = jax.random.normal(jax.random.key(1), (3, 50))
  config = sampler.SamplingConfig(temperature=1.3, top_p=0.9)

  def draws(seed):
    keys = jax.random.split(jax.random.key(seed), 8)
    return np.asarray(jax.vmap(lambda k: sampler.sample_token(logits, k, config)[0])(keys))

  np.testing.assert_array_equal(draws(5), draws(5))
  assert not np.array_equal(draws(5), draws(6))


@pytest.mark.parametrize(
  'kwargs', [{'temperature': 0.0}, {'top_p': 0.0}, {'top_p': 1.5}, {'max_new_tokens': 0}]
)
def test_bad_sampling_config(kwargs):
  with pytest.raises(ValueError, match='SamplingConfig'):
    sampler.SamplingConfig(**kwargs)


def test_a_rows_draws_depend_on_its_own_key_only():
  """With one key per row (`row_keys`: episode id, turn), a row samples the same token in any
  slot and whatever the other rows hold: what refill and lock-step agreeing rests on."""
  logits = jax.random.normal(jax.random.key(2), (4, 50))
  config = sampler.SamplingConfig(temperature=1.1, top_p=0.95)
  episodes, turns = jnp.asarray([5, 1, 7, 3]), jnp.asarray([0, 2, 1, 4])
  keys = sampler.row_keys(jax.random.key(9), episodes, turns)
  tokens = np.asarray(sampler.sample_token(logits, keys, config)[0])
  order = jnp.asarray([2, 0, 3, 1])
  moved = np.asarray(sampler.sample_token(logits[order], keys[order], config)[0])
  np.testing.assert_array_equal(moved, tokens[np.asarray(order)])
  others = logits.at[1:].set(jax.random.normal(jax.random.key(3), (3, 50)))
  assert int(sampler.sample_token(others, keys, config)[0][0]) == tokens[0]
  # Other episodes (or turns) are other draws.
  for other in (
    sampler.row_keys(jax.random.key(9), episodes + 10, turns),
    sampler.row_keys(jax.random.key(9), episodes, turns + 1),
  ):
    assert not np.array_equal(np.asarray(sampler.sample_token(logits, other, config)[0]), tokens)


@pytest.mark.parametrize('per_row', [False, True])
def test_exploration_draws_uniformly_from_the_allowed_tokens_uncorrected(per_row):
  """With `explore`, a share of the rows take a uniform draw from the reply tokens instead of
  the policy's; each records the policy's log-prob of what it took (no correction). Without it
  every row takes the policy's token."""
  B, allowed = 4096, (3, 4, 5, 6)
  logits = jnp.zeros((B, 16)).at[:, 3].set(30.0)  # the policy: token 3, almost surely
  key = jax.random.key(4)
  keys = sampler.row_keys(key, jnp.arange(B), jnp.zeros(B, jnp.int32)) if per_row else key
  plain = sampler.SamplingConfig()
  tokens, logp = sampler.sample_token(logits, keys, sampler.SamplingConfig(explore=0.4), allowed)
  tokens, logp = np.asarray(tokens), np.asarray(logp)
  assert set(np.unique(tokens)) == set(allowed)
  # 0.4 explore, 3 of 4 uniform draws land off token 3: 0.3 of the rows (sd 0.007).
  assert abs((tokens != 3).mean() - 0.3) < 0.03
  want = jax.nn.log_softmax(sampler.restrict_logits(logits, allowed), axis=-1)
  np.testing.assert_allclose(logp, np.take_along_axis(np.asarray(want), tokens[:, None], 1)[:, 0])
  assert (logp[tokens != 3] < -20).all()  # the policy's own log-prob, not the uniform 1/4
  assert (np.asarray(sampler.sample_token(logits, keys, plain, allowed)[0]) == 3).all()
  with pytest.raises(ConfigError, match=r'explore must be in \[0, 1\)'):
    sampler.SamplingConfig(explore=1.0)
