"""Packing: the plan against a host reference, the device gather, and the update it feeds being
the unpacked one (log-probs, loss and gradients equal)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.rl import losses, packing
from earl_jax.rl import train_step as train_lib
from earl_jax.rl.batch import Batch
from earl_jax.sharding import mesh as mesh_lib

CFG = ModelConfig.preset('tiny-game')


def _lengths(B, T, seed=0):
  return np.random.default_rng(seed).integers(3, T + 1, B)


@pytest.mark.parametrize('ranks,seed', [(1, 0), (4, 1), (8, 2)])
def test_the_plan_places_every_token_once_within_its_rank(ranks, seed):
  B, T = 32, 48
  lengths = _lengths(B, T, seed)
  p = packing.plan(lengths, ranks=ranks, bucket=T, row_multiple=ranks)
  b, r = B // ranks, p.rows // ranks
  assert p.rows % ranks == 0 and p.tokens == lengths.sum() and 0 < p.fill <= 1
  seen = np.zeros((B, T), int)
  for row in range(p.rows):
    k = row // r  # the rank that holds this packed row
    for t in np.flatnonzero(p.src_row[row] >= 0):
      i, col = k * b + p.src_row[row, t], p.src_col[row, t]
      seen[i, col] += 1
      assert col < lengths[i] and p.positions[row, t] == col and p.segment_ids[row, t] > 0
    # Segments are contiguous runs, numbered from 1, each starting at position 0.
    seg = p.segment_ids[row]
    starts = np.flatnonzero(np.diff(np.r_[0, seg]) != 0)
    assert all(p.positions[row, s] == 0 for s in starts if seg[s] > 0)
    assert (seg[seg > 0] >= 1).all() and not (seg[1:][seg[:-1] == 0] > 0).any()
  expected = np.arange(T)[None, :] < lengths[:, None]
  np.testing.assert_array_equal(seen, expected.astype(int))
  # Fewer rows than episodes, from an allowed size.
  assert r <= b and r in {max(1, int(np.ceil(f * b))) for f in packing.ROW_FRACTIONS} | {b}


def test_plan_errors_and_row_multiples():
  with pytest.raises(ValueError, match='10 rows do not split over 4 ranks'):
    packing.plan([1] * 10, ranks=4, bucket=8)
  with pytest.raises(ValueError, match='an episode of 9 tokens exceeds the bucket 8'):
    packing.plan([9, 1], ranks=1, bucket=8)
  p = packing.plan([1] * 16, ranks=2, bucket=64, row_multiple=8)
  assert p.rows % 8 == 0  # one row per rank would do; the batch must divide 8 shards
  assert packing.packed_rows_per_rank(3, 8, 2, 1) == 4  # quarters of 8 rows: even counts
  assert packing.packed_rows_per_rank(3, 16, 2, 1) == 4  # quarters of 16: multiples of 4
  assert packing.packed_rows_per_rank(5, 16, 2, 1) == 8
  assert packing.packed_rows_per_rank(3, 8, 2, 4) == 4  # 2 x 3 rows do not divide 4 shards


@pytest.mark.parametrize(
  'parallel', ['dp8', 'dp2.tp4', 'dp4.fsdp2', 'dp1.tp8', 'dp2.cp4', 'dp1.tp2.cp4']
)
def test_pack_on_device_equals_the_host_reference(parallel):
  B, T = 16, 32
  mesh = mesh_lib.make_mesh(ParallelConfig.parse(parallel))
  rng = np.random.default_rng(3)
  lengths = _lengths(B, T, 3)
  host = Batch.zeros(B, T).replace(
    tokens=rng.integers(1, 64, (B, T)).astype(np.int32),
    loss_mask=rng.random((B, T)) > 0.5,
    advantages=rng.standard_normal((B, T)).astype(np.float32),
    old_logprobs=rng.standard_normal((B, T)).astype(np.float32),
    lengths=lengths.astype(np.int32),
    valid=np.ones(B, bool),
  )
  batch = jax.device_put(host, Batch.shardings(mesh))
  ranks = ParallelConfig.parse(parallel).batch_shards
  p = packing.plan(lengths, ranks=ranks, bucket=T, row_multiple=ranks)
  with jax.transfer_guard('disallow'):
    out = packing.pack(batch, p, mesh)
  b, r = B // ranks, p.rows // ranks
  rank = np.arange(p.rows)[:, None] // r
  src = np.where(p.src_row >= 0, rank * b + p.src_row, 0)
  for name in ('tokens', 'loss_mask', 'advantages', 'old_logprobs'):
    want = np.where(p.src_row >= 0, getattr(host, name)[src, p.src_col], 0)
    np.testing.assert_array_equal(np.asarray(getattr(out, name)), want.astype(want.dtype))
  np.testing.assert_array_equal(np.asarray(out.segment_ids), p.segment_ids)
  np.testing.assert_array_equal(np.asarray(out.positions), p.positions)
  assert np.asarray(out.lengths).sum() == lengths.sum()
  for name in ('tokens', 'segment_ids', 'positions'):  # on a cp mesh: T split over the ring
    assert getattr(out, name).sharding.is_equivalent_to(getattr(Batch.shardings(mesh), name), 2)


def test_packing_traces_its_gather_once_per_shape(monkeypatch):
  """Every step packs with the same jitted gather: a second batch of the same shape on the same
  layout traces nothing."""
  B, T = 16, 32
  mesh = mesh_lib.make_mesh(ParallelConfig.parse('dp2.cp4'))
  traced = []
  gather = packing._gather
  monkeypatch.setattr(packing, '_gather', lambda *a: traced.append(1) or gather(*a))
  packing._gather_program.cache_clear()
  lengths = _lengths(B, T, 5)
  p = packing.plan(lengths, ranks=2, bucket=T, row_multiple=2)
  for seed in range(2):
    tokens = np.random.default_rng(seed).integers(1, 64, (B, T)).astype(np.int32)
    host = Batch.zeros(B, T).replace(
      tokens=tokens, lengths=lengths.astype(np.int32), valid=np.ones(B, bool)
    )
    packing.pack(jax.device_put(host, Batch.shardings(mesh)), p, mesh)
  assert len(traced) == len(packing._TOKEN_FIELDS)


def test_the_packed_update_is_the_unpacked_update():
  """Same episodes, same advantages: the packed batch's loss, metrics and gradient (token
  aggregation) are those of the unpacked batch, on a sharded layout."""
  mesh = mesh_lib.make_mesh(ParallelConfig(dp=4, tp=2))
  graphdef, params = qwen2.init_model(CFG, mesh, seed=2)
  B, T = 16, 64
  rng = np.random.default_rng(4)
  lengths = _lengths(B, T // 2, 4)  # two or more episodes fit a row
  real = np.arange(T)[None, :] < lengths[:, None]
  host = Batch.zeros(B, T).replace(
    tokens=np.where(real, rng.integers(1, 64, (B, T)), 0).astype(np.int32),
    loss_mask=real & (rng.random((B, T)) > 0.4) & (np.arange(T) > 0),
    advantages=np.where(real, rng.standard_normal((B, T)), 0).astype(np.float32),
    old_logprobs=np.where(real, -rng.random((B, T)), 0).astype(np.float32),
    ref_logprobs=np.where(real, -rng.random((B, T)), 0).astype(np.float32),
    segment_ids=real.astype(np.int32),
    lengths=lengths.astype(np.int32),
    valid=np.ones(B, bool),
  )
  host = host.replace(sample_logprobs=host.old_logprobs)
  batch = jax.device_put(host, Batch.shardings(mesh))
  p = packing.plan(lengths, ranks=4, bucket=T, row_multiple=4)
  packed = packing.pack(batch, p, mesh)
  assert p.rows < B
  config = losses.LossConfig(kl_coef=0.05, entropy_coef=0.01)

  def grads(b, is_packed):
    fn = jax.value_and_grad(train_lib.loss_fn, has_aux=True)
    return fn(params, graphdef, b, config, 0.9, jnp.float32(0.01), None, is_packed)

  with jax.set_mesh(mesh):
    (l1, m1), g1 = jax.jit(lambda b: grads(b, False))(batch)
    (l2, m2), g2 = jax.jit(lambda b: grads(b, True))(packed)
  np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5, atol=1e-7)
  for k in ('pg_loss', 'kl_ref', 'entropy'):
    np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, atol=1e-7)
  for a, c in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=2e-6, rtol=1e-4)
