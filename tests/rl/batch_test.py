"""The RL batch: its fields, their logical axes, the train layout, and all-padding batches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.config import ParallelConfig
from earl_jax.rl.batch import Batch
from earl_jax.sharding import mesh as mesh_lib

TOKEN_FIELDS = (
  'tokens',
  'loss_mask',
  'sample_logprobs',
  'old_logprobs',
  'ref_logprobs',
  'advantages',
  'returns',
  'legal_moves',
  'segment_ids',
  'positions',
)
ROW_FIELDS = ('rewards', 'lengths', 'group_ids', 'valid')


def test_fields_and_logical_axes():
  names = tuple(f.name for f in dataclasses.fields(Batch))
  assert names == TOKEN_FIELDS + ROW_FIELDS
  axes = Batch.logical_axes()
  assert all(getattr(axes, f) == ('batch', 'seq') for f in TOKEN_FIELDS)
  assert all(getattr(axes, f) == ('batch',) for f in ROW_FIELDS)


@pytest.mark.parametrize('xp', [np, jnp], ids=['numpy', 'jax'])
def test_zeros_is_an_all_padding_batch(xp):
  b = Batch.zeros(6, 32, xp=xp)
  assert b.num_rows == 6 and b.bucket == 32
  ints = {'tokens': np.int32, 'lengths': np.int32, 'group_ids': np.int32}
  ints.update(segment_ids=np.int32, positions=np.int32, legal_moves=np.int32)
  want = {**ints, 'loss_mask': np.bool_, 'valid': np.bool_}
  for name in TOKEN_FIELDS + ROW_FIELDS:
    x = getattr(b, name)
    assert x.shape == ((6, 32) if name in TOKEN_FIELDS else (6,))
    assert np.dtype(x.dtype) == np.dtype(want.get(name, np.float32)), name
    if name == 'positions':
      np.testing.assert_array_equal(np.asarray(x), np.tile(np.arange(32), (6, 1)))
    else:
      assert not np.asarray(x).any()


@pytest.mark.parametrize('parallel', ['dp8', 'dp2.tp4', 'dp2.fsdp2.tp2'])
def test_train_layout_splits_rows_over_data_and_fsdp_only(parallel):
  pc = ParallelConfig.parse(parallel)
  mesh = mesh_lib.make_mesh(pc)
  shardings = Batch.shardings(mesh)
  host = Batch.zeros(16, 8).replace(tokens=np.arange(16 * 8, dtype=np.int32).reshape(16, 8))
  placed = jax.device_put(host, shardings)
  tokens = placed.tokens
  assert tokens.sharding.spec == jax.P(('data', 'fsdp'), None)
  assert tokens.addressable_data(0).shape == (16 // pc.batch_shards, 8)
  assert placed.valid.addressable_data(0).shape == (16 // pc.batch_shards,)
  # Replicated over 'tensor': the devices of one tensor group hold the same rows.
  if pc.tp > 1:
    first, second = tokens.addressable_shards[0], tokens.addressable_shards[1]
    assert first.index == second.index
  np.testing.assert_array_equal(np.asarray(tokens), host.tokens)


def test_a_batch_is_a_pytree_that_replace_keeps():
  b = Batch.zeros(2, 4)
  leaves = jax.tree.leaves(b)
  assert len(leaves) == len(TOKEN_FIELDS + ROW_FIELDS)
  c = b.replace(rewards=np.ones(2, np.float32))
  assert c.rewards.tolist() == [1.0, 1.0] and b.rewards.tolist() == [0.0, 0.0]
