"""Sequence-sharded attention (ring, Ulysses) against the dense reference, on fake meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from earl_jax.models import context_attention as ca

B, T, K, Q, Dh = 4, 64, 4, 2, 8
AXIS = 'context'
TOL = 1e-5


def make_mesh(data: int, context: int) -> Mesh:
  return Mesh(np.array(jax.devices()).reshape(data, context), ('data', AXIS))


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, T, K, Q, Dh)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, T, K, Dh)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, T, K, Dh)), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal((B, T, K, Q, Dh)), jnp.float32)
  return q, k, v, cotangent


def packed_segment_ids():
  """Packed rows of uneven lengths; 0 is padding. Segments cross every shard boundary (16, 32,
  48 contiguous over 4 devices; multiples of 4 and 8 in zig-zag chunks)."""
  seg = np.zeros((B, T), np.int32)
  seg[0, :10], seg[0, 10:37], seg[0, 37:60] = 1, 2, 3  # three sequences, then padding
  seg[1, :23] = 1  # one short sequence, then padding
  seg[2, 5:40], seg[2, 40:] = 1, 2  # left padding, then two sequences
  seg[3] = 1  # one full-length sequence
  return jnp.asarray(seg)


def run(kernel, q, k, v, seg, cotangent, C, zigzag):
  """Output (sequence order), raw kernel output (layout order) and dq, dk, dv of
  sum(out * cotangent); inputs are put in layout order before the kernel."""
  layout = (lambda x: ca.to_zigzag(x, C)) if zigzag else (lambda x: x)

  def loss(q, k, v):
    raw = kernel(layout(q), layout(k), layout(v), None if seg is None else layout(seg))
    out = ca.from_zigzag(raw, C) if zigzag else raw
    return jnp.sum(out * cotangent), (out, raw)

  (_, (out, raw)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return out, raw, grads


def reference(q, k, v, seg, cotangent):
  loss = lambda q, k, v: jnp.sum(ca.reference_attention(q, k, v, seg) * cotangent)  # noqa: E731
  return ca.reference_attention(q, k, v, seg), jax.grad(loss, (0, 1, 2))(q, k, v)


def check_against_reference(kernel, mesh, seg, zigzag):
  q, k, v, cotangent = inputs()
  C = mesh.shape[AXIS]
  out, raw, grads = run(kernel, q, k, v, seg, cotangent, C, zigzag)
  ref_out, ref_grads = reference(q, k, v, seg, cotangent)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=TOL, rtol=0)
  for name, g, r in zip(('dq', 'dk', 'dv'), grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=TOL, rtol=0, err_msg=name)
  # The kernel's own output stays split along the sequence on AXIS, batch on 'data'.
  assert raw.sharding.spec[1] == AXIS
  assert raw.sharding.is_equivalent_to(NamedSharding(mesh, ca.sequence_spec(mesh, AXIS, 5)), 5)
  assert raw.addressable_data(0).shape == (B // mesh.shape['data'], T // C, K, Q, Dh)


@pytest.mark.parametrize('zigzag', [True, False])
@pytest.mark.parametrize('segmented', [False, True])
def test_ring_matches_the_dense_reference_on_a_2x4_mesh(zigzag, segmented):
  mesh = make_mesh(2, 4)
  kernel = lambda *a: ca.ring_attention(*a, mesh=mesh, axis=AXIS, zigzag=zigzag)  # noqa: E731
  check_against_reference(kernel, mesh, packed_segment_ids() if segmented else None, zigzag)


@pytest.mark.parametrize('zigzag', [True, False])
def test_ring_matches_the_dense_reference_on_a_1x8_mesh(zigzag):
  mesh = make_mesh(1, 8)
  kernel = lambda *a: ca.ring_attention(*a, mesh=mesh, axis=AXIS, zigzag=zigzag)  # noqa: E731
  check_against_reference(kernel, mesh, packed_segment_ids(), zigzag)


@pytest.mark.parametrize('zigzag', [True, False])
@pytest.mark.parametrize('block', [4, 8])
def test_ring_in_tiles_smaller_than_a_shard_matches_the_dense_reference(zigzag, block):
  """T = 64 over C = 4: shards of 16 (chunks of 8 in zig-zag), so each visit runs several
  tiles, the diagonal one stops at the diagonal, and packed segments cross tile boundaries."""
  mesh = make_mesh(2, 4)
  kernel = lambda *a: ca.ring_attention(*a, mesh=mesh, axis=AXIS, zigzag=zigzag, block=block)  # noqa: E731
  check_against_reference(kernel, mesh, packed_segment_ids(), zigzag)


@pytest.mark.parametrize('zigzag', [True, False])
def test_ring_temporaries_grow_about_linearly_with_the_shard(zigzag):
  """Compiled per-device temporaries of forward + backward in tiles of 16: doubling T (shards
  of 64 -> 128 on a 2 x 4 mesh) about doubles them, where one whole [B_local, K, Q, t, t] tile
  per visit would about quadruple them; and they stay below one such tile."""
  mesh = make_mesh(2, 4)

  def temp_bytes(T):
    q = jax.ShapeDtypeStruct((B, T, K, Q, Dh), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, Dh), jnp.float32)
    attend = lambda q, k, v: ca.ring_attention(  # noqa: E731
      q, k, v, None, mesh=mesh, axis=AXIS, zigzag=zigzag, block=16
    )
    grad = jax.grad(lambda *a: jnp.sum(attend(*a)), (0, 1, 2))
    return jax.jit(grad).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(256), temp_bytes(512)
  t = 512 // mesh.shape[AXIS]
  full_tile = (B // mesh.shape['data']) * K * Q * t * t * 4
  assert large < 2.5 * small, (small, large)
  assert large < full_tile, (large, full_tile)


@pytest.mark.parametrize('shape, zigzag', [((4, 2), False), ((2, 4), False), ((2, 4), True)])
def test_ulysses_matches_the_dense_reference(shape, zigzag):
  mesh = make_mesh(*shape)
  kernel = lambda *a: ca.ulysses_attention(*a, mesh=mesh, axis=AXIS, zigzag=zigzag, block=16)  # noqa: E731
  check_against_reference(kernel, mesh, packed_segment_ids(), zigzag)


def test_ulysses_needs_the_axis_to_divide_the_kv_heads():
  q, k, v, _ = inputs()
  with pytest.raises(ValueError, match=r'K = 4 kv heads over the C = 8'):
    ca.ulysses_attention(q, k, v, None, mesh=make_mesh(1, 8), axis=AXIS)


def test_layout_errors_name_the_sizes():
  q, k, v, _ = inputs()
  with pytest.raises(ValueError, match=r'2C = 16 to divide T = 8'):
    ca.ring_attention(q[:, :8], k[:, :8], v[:, :8], None, mesh=make_mesh(1, 8), axis=AXIS)
  with pytest.raises(ValueError, match=r'Batch 1 does not split over the 2 devices'):
    ca.ring_attention(q[:1], k[:1], v[:1], None, mesh=make_mesh(2, 4), axis=AXIS)
  with pytest.raises(ValueError, match=r'positive block, got 0'):
    ca.ring_attention(q, k, v, None, mesh=make_mesh(2, 4), axis=AXIS, block=0)


@pytest.mark.parametrize('C', [2, 4, 8])
def test_zigzag_order_round_trips(C):
  order = ca.zigzag_order(T, C)
  assert sorted(order.tolist()) == list(range(T))
  np.testing.assert_array_equal(order[ca.zigzag_inverse(T, C)], np.arange(T))
  x = jnp.arange(2 * T).reshape(2, T)
  np.testing.assert_array_equal(np.asarray(ca.from_zigzag(ca.to_zigzag(x, C), C)), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(ca.to_zigzag(x, C))[0], order)
  # Device i holds chunks i and 2C - 1 - i.
  c = T // (2 * C)
  assert ca.zigzag_order(T, C)[c : 2 * c].tolist() == list(range(T - c, T))


@pytest.mark.parametrize('C', [2, 4, 8])
def test_zigzag_balances_the_causal_work(C):
  """Unmasked (query, key) pairs per device, from the positions the ring kernel uses."""

  def pairs_per_device(zigzag):
    positions = ca.sequence_positions(T, C, zigzag=zigzag).reshape(C, T // C)
    return (positions + 1).sum(axis=1)  # query p sees keys 0..p

  chunk_pairs = (T // (2 * C)) ** 2
  balanced, contiguous = pairs_per_device(True), pairs_per_device(False)
  assert balanced.sum() == contiguous.sum() == T * (T + 1) // 2
  assert balanced.max() - balanced.min() <= chunk_pairs
  assert contiguous.max() - contiguous.min() > chunk_pairs
