"""Decode attention and cache writes on a slot-split KV cache, against qwen2's own cache path."""

import functools
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from earl_jax.models import attention, qwen2
from earl_jax.models import context_decode as cd

B, S, K, Q, Dh = 4, 64, 2, 2, 8
AXIS = 'context'
TOL = 1e-5
# Row 0's visible slots all sit in the first device's slice (8 slots on (1, 8), 16 on (2, 4));
# row 1 fills the whole cache; rows 2 and 3 end mid-slice.
LENGTHS = np.array([5, S, 37, 20], np.int32)


def make_mesh(data: int, context: int) -> Mesh:
  return Mesh(np.array(jax.devices()).reshape(data, context), ('data', AXIS))


def normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def put_cache(mesh, *caches):
  sharding = NamedSharding(mesh, cd.cache_spec(mesh, AXIS))
  return tuple(jax.device_put(c, sharding) for c in caches)


@functools.partial(jax.jit, static_argnums=0)
def qwen2_attend_cache(N, q, k_new, v_new, positions, cache_k, cache_v):
  """qwen2's generation attention (write at `positions`, then attend), the parity target."""
  layer = SimpleNamespace(cfg=SimpleNamespace(num_kv_heads=K))
  out, cache = qwen2.Attention._attend_cache(
    layer, q.reshape(B, N, K * Q, Dh), k_new, v_new, positions, (cache_k, cache_v)
  )
  return out.reshape(B, N, K, Q, Dh), cache


def jitted(fn, mesh):
  return jax.jit(functools.partial(fn, mesh=mesh, axis=AXIS))


@pytest.mark.parametrize('N', [1, 3])
@pytest.mark.parametrize('shape', [(2, 4), (1, 8)])
def test_decode_attention_matches_qwen2_and_is_replicated_over_the_context_axis(shape, N):
  mesh = make_mesh(*shape)
  rng = np.random.default_rng(N)
  q = normal(rng, (B, N, K, Q, Dh))
  cache_k, cache_v = normal(rng, (B, K, S, Dh)), normal(rng, (B, K, S, Dh))  # stale slots too
  lengths = jnp.asarray(LENGTHS)
  positions = cd.decode_positions(lengths, N)
  # The new tokens are already in the cache: qwen2 rewrites the same values, then attends.
  k_new, v_new = (c[jnp.arange(B)[:, None], :, positions] for c in (cache_k, cache_v))
  expected, _ = qwen2_attend_cache(N, q, k_new, v_new, positions, cache_k, cache_v)
  reference = cd.reference_decode_attention(q, cache_k, cache_v, lengths)
  np.testing.assert_allclose(np.asarray(reference), np.asarray(expected), atol=TOL, rtol=0)

  sk, sv = put_cache(mesh, cache_k, cache_v)
  out = jitted(cd.sharded_decode_attention, mesh)(q, sk, sv, positions)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=TOL, rtol=0)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, cd.batch_spec(mesh, AXIS, 5)), 5)
  assert out.addressable_data(0).shape == (B // shape[0], N, K, Q, Dh)


def test_cache_write_straddling_slices_matches_qwen2_and_touches_only_owning_shards():
  mesh = make_mesh(2, 4)  # slices of 16 slots
  rng = np.random.default_rng(7)
  cache_k, cache_v = normal(rng, (B, K, S, Dh)), normal(rng, (B, K, S, Dh))
  new_k, new_v = normal(rng, (B, 4, K, Dh)), normal(rng, (B, 4, K, Dh))
  # Across the 16 and 32 boundaries, the first slice, and past the capacity (dropped).
  positions = jnp.asarray([[14, 15, 16, 17], [30, 31, 32, 33], [0, 1, 2, 3], [62, 63, 64, 65]])
  dense = (
    attention.write_rows(cache_k, positions, new_k),
    attention.write_rows(cache_v, positions, new_v),
  )
  before = put_cache(mesh, cache_k, cache_v)
  after = jitted(cd.sharded_cache_write, mesh)(*before, new_k, new_v, positions)

  written = np.zeros((B, S), bool)  # [b, slot] that the write should change
  for b, row in enumerate(np.asarray(positions)):
    written[b, row[row < S]] = True
  for old, new, want in zip(before, after, dense):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(want))
    assert new.sharding.spec == cd.cache_spec(mesh, AXIS)
    for old_shard, shard in zip(old.addressable_shards, new.addressable_shards):
      assert shard.index == old_shard.index and shard.data.shape == (B // 2, K, S // 4, Dh)
      changed = np.any(np.asarray(shard.data) != np.asarray(old_shard.data), axis=(1, 3))
      rows, _, slots, _ = shard.index
      np.testing.assert_array_equal(changed, written[rows, slots], err_msg=str(shard.index))


# A greedy decode of a tiny random "model" over a prefilled cache: token -> q, k, v by fixed
# embeddings (no position encoding), next token = argmax of a fixed projection of the last
# query's attention output.
V, PROMPT, CHUNK, STEPS = 32, 8, 3, 12


class TinyModel(NamedTuple):
  wq: jax.Array  # [V, K, Q, Dh]
  wk: jax.Array  # [V, K, Dh]
  wv: jax.Array  # [V, K, Dh]
  wo: jax.Array  # [K, Q, Dh, V]


def tiny_model(seed=3):
  rng = np.random.default_rng(seed)
  return TinyModel(
    wq=normal(rng, (V, K, Q, Dh)),
    wk=normal(rng, (V, K, Dh)),
    wv=normal(rng, (V, K, Dh)),
    wo=normal(rng, (K, Q, Dh, V)),
  )


def next_token(model, out):
  return jnp.argmax(jnp.einsum('BKQd,KQdV->BV', out[:, -1], model.wo), axis=-1).astype(jnp.int32)


def greedy_decode(model, prefill, step, cache, prompt, prompt_lengths):
  """Prefills all but the last CHUNK prompt tokens of each row (padding at slot S: dropped),
  runs the last CHUNK as one step, then STEPS - 1 single-token steps; returns the new tokens."""
  cols = np.arange(PROMPT - CHUNK)
  prefix = prompt_lengths[:, None] - CHUNK
  positions = jnp.asarray(np.where(cols[None] < prefix, cols[None], S), jnp.int32)
  tokens = jnp.asarray(prompt[:, : PROMPT - CHUNK])
  cache = prefill(*cache, model.wk[tokens], model.wv[tokens], positions)
  rows = np.arange(B)[:, None]
  positions = jnp.asarray(prefix + np.arange(CHUNK)[None], jnp.int32)
  tokens = jnp.asarray(prompt[rows, np.asarray(positions)])
  generated = []
  for _ in range(STEPS):
    token, cache = step(model, tokens, positions, cache)
    generated.append(np.asarray(token))
    tokens, positions = token[:, None], positions[:, -1:] + 1
  return np.stack(generated, axis=1)


def test_greedy_decode_with_the_sharded_cache_matches_qwen2_dense_decode():
  mesh = make_mesh(1, 8)  # slices of 8 slots: rows cross several while decoding
  model = tiny_model()
  rng = np.random.default_rng(11)
  prompt = rng.integers(0, V, (B, PROMPT)).astype(np.int32)
  prompt_lengths = np.array([3, 8, 5, 6])  # row 0: no prefix, stays on two slices

  @jax.jit
  def dense_step(model, tokens, positions, cache):
    N = tokens.shape[1]
    out, cache = qwen2_attend_cache(
      N, model.wq[tokens], model.wk[tokens], model.wv[tokens], positions, *cache
    )
    return next_token(model, out), cache

  @jax.jit
  def sharded_step(model, tokens, positions, cache):
    cache = cd.sharded_cache_write(
      *cache, model.wk[tokens], model.wv[tokens], positions, mesh=mesh, axis=AXIS
    )
    out = cd.sharded_decode_attention(model.wq[tokens], *cache, positions, mesh=mesh, axis=AXIS)
    return next_token(model, out), cache

  zeros = jnp.zeros((B, K, S, Dh), jnp.float32)
  dense_prefill = jax.jit(
    lambda ck, cv, k, v, p: (attention.write_rows(ck, p, k), attention.write_rows(cv, p, v))
  )
  dense = greedy_decode(model, dense_prefill, dense_step, (zeros, zeros), prompt, prompt_lengths)
  sharded = greedy_decode(
    model,
    jitted(cd.sharded_cache_write, mesh),
    sharded_step,
    put_cache(mesh, zeros, zeros),
    prompt,
    prompt_lengths,
  )
  np.testing.assert_array_equal(sharded, dense)
  assert len(np.unique(dense)) > 3  # the toy model does not collapse onto one token


def test_indivisible_slots_or_batch_raise_clear_errors():
  q = jnp.zeros((B, 1, K, Q, Dh))
  new, positions = jnp.zeros((B, 1, K, Dh)), jnp.zeros((B, 1), jnp.int32)
  odd_slots = jnp.zeros((B, K, 36, Dh))  # 36 slots over 8 devices
  with pytest.raises(ValueError, match=r'S = 36 slots .* C = 8 devices'):
    cd.sharded_decode_attention(q, odd_slots, odd_slots, positions, mesh=make_mesh(1, 8), axis=AXIS)
  with pytest.raises(ValueError, match=r'S = 36 slots .* C = 8 devices'):
    cd.sharded_cache_write(
      odd_slots, odd_slots, new, new, positions, mesh=make_mesh(1, 8), axis=AXIS
    )
  odd_rows = jnp.zeros((3, K, S, Dh))  # 3 rows over data = 2
  with pytest.raises(ValueError, match='Batch 3 does not split'):
    cd.sharded_decode_attention(
      q[:3], odd_rows, odd_rows, positions[:3], mesh=make_mesh(2, 4), axis=AXIS
    )
  with pytest.raises(ValueError, match='Batch 3 does not split'):
    cd.sharded_cache_write(
      odd_rows, odd_rows, new[:3], new[:3], positions[:3], mesh=make_mesh(2, 4), axis=AXIS
    )


def test_queries_that_see_no_slot_stay_finite_like_qwen2():
  """lengths < N (a degenerate call): queries at negative positions see nothing; qwen2's
  softmax over all-min scores gives the mean of v over the cache, and so does the kernel."""
  mesh, N = make_mesh(2, 4), 3
  rng = np.random.default_rng(5)
  q = normal(rng, (B, N, K, Q, Dh))
  cache_k, cache_v = normal(rng, (B, K, S, Dh)), normal(rng, (B, K, S, Dh))
  lengths = jnp.asarray([0, 1, 2, S], jnp.int32)
  positions = cd.decode_positions(lengths, N)
  out = jitted(cd.sharded_decode_attention, mesh)(q, *put_cache(mesh, cache_k, cache_v), positions)
  reference = cd.reference_decode_attention(q, cache_k, cache_v, lengths)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=TOL, rtol=0)
  mean_v = jnp.mean(cache_v[0], axis=1)  # [K, Dh]: row 0 sees nothing at all
  np.testing.assert_allclose(
    np.asarray(out[0]), np.broadcast_to(mean_v[:, None], (N, K, Q, Dh)), atol=TOL
  )


def test_kv_heads_split_over_a_head_axis_too():
  """The model's layout: rows over 'data', slots over 'context', kv heads over 'tensor'. The
  write and the attention keep each device's K / 2 heads, and match qwen2's cache path."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ('data', AXIS, 'tensor'))
  split = {'mesh': mesh, 'axis': AXIS, 'head_axis': 'tensor'}
  N, rng = 2, np.random.default_rng(7)
  q = normal(rng, (B, N, K, Q, Dh))
  cache_k, cache_v = normal(rng, (B, K, S, Dh)), normal(rng, (B, K, S, Dh))
  k_new, v_new = normal(rng, (B, N, K, Dh)), normal(rng, (B, N, K, Dh))
  positions = cd.decode_positions(jnp.asarray(LENGTHS), N)
  expected, (want_k, want_v) = qwen2_attend_cache(N, q, k_new, v_new, positions, cache_k, cache_v)
  sharding = NamedSharding(mesh, cd.cache_spec(mesh, AXIS, 'tensor'))
  caches = [jax.device_put(c, sharding) for c in (cache_k, cache_v)]

  @jax.jit
  def step(q, cache_k, cache_v, k_new, v_new, positions):
    cache_k, cache_v = cd.sharded_cache_write(cache_k, cache_v, k_new, v_new, positions, **split)
    return cd.sharded_decode_attention(q, cache_k, cache_v, positions, **split), cache_k, cache_v

  out, got_k, got_v = step(q, *caches, k_new, v_new, positions)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=TOL, rtol=0)
  np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
  np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
  assert got_k.addressable_data(0).shape == (B // 2, K // 2, S // 2, Dh)
  assert out.addressable_data(0).shape == (B // 2, N, K // 2, Q, Dh)
