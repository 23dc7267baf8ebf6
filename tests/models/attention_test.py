"""The blockwise causal attention against a dense single-device reference, on fake meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from earl_jax.config import ParallelConfig
from earl_jax.models import attention
from earl_jax.sharding import mesh as mesh_lib

B, T, K, Q, Dh = 2, 64, 4, 2, 16


def dense_reference(q, k, v, segment_ids=None):
  """softmax(q k^T / sqrt(Dh)) v over [T, T] with a causal (and segment) mask, in f32."""
  s = jnp.einsum('BTKQd,BSKd->BKQTS', q.astype(jnp.float32), k.astype(jnp.float32))
  mask = jnp.tril(jnp.ones((T, T), bool))[None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  s = jnp.where(mask[:, None, None], s / np.sqrt(Dh), -jnp.inf)
  return jnp.einsum('BKQTS,BSKd->BTKQd', jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))


def inputs(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, T, K, Q, Dh)), dtype)
  k = jnp.asarray(rng.standard_normal((B, T, K, Dh)), dtype)
  v = jnp.asarray(rng.standard_normal((B, T, K, Dh)), dtype)
  # Packed rows: segments of uneven lengths that cross block boundaries, then padding (0).
  seg = np.zeros((B, T), np.int32)
  seg[0, :10], seg[0, 10:37], seg[0, 37:60] = 1, 2, 3
  seg[1, :5], seg[1, 5:64] = 1, 2
  return q, k, v, jnp.asarray(seg)


def loss_of(fn):
  # A loss whose gradient reaches every output element differently.
  w = jnp.asarray(np.random.default_rng(7).standard_normal((B, T, K, Q, Dh)), jnp.float32)
  return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v).astype(jnp.float32)) * w)


@pytest.mark.parametrize('block', [8, 16, 32])
@pytest.mark.parametrize('segmented', [False, True])
def test_values_and_gradients_match_the_dense_reference(block, segmented):
  q, k, v, seg = inputs()
  seg = seg if segmented else None
  ours = lambda q, k, v: attention.blockwise_causal_attention(q, k, v, block=block, segment_ids=seg)  # noqa: E731
  ref = lambda q, k, v: dense_reference(q, k, v, seg)  # noqa: E731
  np.testing.assert_allclose(np.asarray(ours(q, k, v)), np.asarray(ref(q, k, v)), atol=2e-6)
  g_ours = jax.grad(loss_of(ours), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(loss_of(ref), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_ours, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_bfloat16_inputs_keep_their_dtype_and_stay_close():
  q, k, v, _ = inputs(dtype=jnp.bfloat16)
  out = attention.blockwise_causal_attention(q, k, v, block=16)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(out, np.float32), np.asarray(dense_reference(q, k, v)), atol=2e-2
  )
  grads = jax.grad(
    loss_of(lambda *x: attention.blockwise_causal_attention(*x, block=16)), (0, 1, 2)
  )(q, k, v)
  assert [g.dtype for g in grads] == [jnp.bfloat16] * 3


def test_a_query_ignores_later_keys_and_other_segments():
  q, k, v, seg = inputs()
  a = attention.blockwise_causal_attention(q, k, v, block=16, segment_ids=seg)
  # Changing keys / values from position 40 on, or of segment 1 of row 0, leaves what may not
  # see them unchanged.
  k2, v2 = k.at[:, 40:].set(3.0), v.at[:, 40:].set(-2.0)
  b = attention.blockwise_causal_attention(q, k2, v2, block=16, segment_ids=seg)
  np.testing.assert_array_equal(np.asarray(a)[:, :40], np.asarray(b)[:, :40])
  k3 = k.at[0, :10].set(5.0)
  c = attention.blockwise_causal_attention(q, k3, v, block=16, segment_ids=seg)
  np.testing.assert_array_equal(np.asarray(a)[0, 10:], np.asarray(c)[0, 10:])
  assert not np.allclose(np.asarray(a)[0, :10], np.asarray(c)[0, :10])


@pytest.mark.parametrize('layout', ['dp2.tp4', 'dp4.tp2', 'dp8'])
def test_sharded_batch_and_heads_give_the_single_device_values(layout):
  pc = ParallelConfig.parse(layout)
  mesh = mesh_lib.make_mesh(pc)
  q, k, v, seg = inputs()
  q, k, v = (jnp.concatenate([x] * 4, axis=0) for x in (q, k, v))  # B = 8: divisible by dp
  seg = jnp.concatenate([seg] * 4, axis=0)
  batch = ('data', 'fsdp')
  qs = NamedSharding(mesh, PartitionSpec(batch, None, 'tensor', None, None))
  ks = NamedSharding(mesh, PartitionSpec(batch, None, 'tensor', None))
  ss = NamedSharding(mesh, PartitionSpec(batch, None))

  def step(q, k, v, seg):
    f = lambda q, k, v: attention.blockwise_causal_attention(q, k, v, block=16, segment_ids=seg)  # noqa: E731
    return f(q, k, v), jax.grad(lambda *x: jnp.sum(f(*x) ** 2), (0, 1, 2))(q, k, v)

  args = (
    jax.device_put(q, qs),
    jax.device_put(k, ks),
    jax.device_put(v, ks),
    jax.device_put(seg, ss),
  )
  out, grads = jax.jit(step, out_shardings=(qs, (qs, ks, ks)))(*args)
  ref_out, ref_grads = jax.jit(step)(q, k, v, seg)
  assert out.sharding.is_equivalent_to(qs, out.ndim)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-6)
  for a, b in zip(grads, ref_grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_program_size_does_not_grow_with_the_number_of_blocks():
  """Both passes are loops: the lowered program of 64 blocks is no larger than that of 4 (an
  unrolled block loop grows with T / block, and so did its compile time)."""

  def size(t):
    q = jax.ShapeDtypeStruct((1, t, K, Q, Dh), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, K, Dh), jnp.float32)
    f = lambda q, k, v: jnp.sum(attention.blockwise_causal_attention(q, k, v, block=16))  # noqa: E731
    return len(jax.jit(jax.grad(f, (0, 1, 2))).lower(q, kv, kv).as_text().splitlines())

  assert size(64 * 16) == size(4 * 16)


def test_a_block_that_does_not_divide_the_chunk_is_refused():
  q, k, v, _ = inputs()
  with pytest.raises(ValueError, match='block 24 must be a positive divisor of T=64'):
    attention.blockwise_causal_attention(q, k, v, block=24)
