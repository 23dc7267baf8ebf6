"""The logical-axis table, constrain under a mesh, and divisibility errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from earl_jax.sharding import rules
from earl_jax.sharding.mesh import ShardingError
from earl_jax.testing import small_mesh


def test_spec_of_logical_names():
  assert rules.spec(('batch', 'seq', 'act_embed')) == P(('data', 'fsdp'), 'context', None)
  assert rules.spec(('embed', 'heads', 'head_dim')) == P('fsdp', 'tensor', None)
  with pytest.raises(ShardingError, match="Logical axis 'nope' has no rule"):
    rules.spec(('nope',))


def test_tokens_split_over_context_only_where_the_mesh_has_it():
  """A cp = 1 mesh keeps the specs it always had (no 'context' named); a cp > 1 mesh splits
  each sequence, its KV cache's slots included."""
  dp8, cp4 = small_mesh(dp=8), small_mesh(dp=2, cp=4)
  assert rules.sharding(('batch', 'seq'), dp8).spec == P(('data', 'fsdp'), None)
  assert rules.sharding(('batch', 'seq'), cp4).spec == P(('data', 'fsdp'), 'context')
  cache = ('cache_batch', 'cache_kv_heads', 'cache_seq', 'head_dim')
  assert rules.sharding(cache, cp4).spec == P(('data', 'fsdp'), 'tensor', 'context', None)
  assert rules.sharding(('embed', 'heads'), cp4).spec == P('fsdp', 'tensor')  # weights: whole
  x = jnp.ones((4, 16, 8))
  with jax.set_mesh(cp4):
    y = jax.jit(lambda x: rules.constrain(x + 1, ('batch', 'seq', 'act_embed')))(x)
  assert y.addressable_data(0).shape == (2, 4, 8)
  with pytest.raises(
    ShardingError, match=r'dimension 1 \(seq\) has size 6, which the mesh axes context'
  ):
    rules.check_divisible((4, 6), ('batch', 'seq'), cp4, what='tokens')
  rules.check_divisible((4, 6), ('batch', 'seq'), small_mesh(dp=4), what='tokens')  # cp = 1


def test_constrain_applies_under_a_mesh_and_not_without():
  mesh = small_mesh(dp=2, tp=4)
  x = jnp.ones((8, 4, 16))

  def f(x):
    return rules.constrain(x * 2, ('batch', 'seq', 'act_mlp'))

  with jax.set_mesh(mesh):
    y = jax.jit(f)(x)
  expected = jax.sharding.NamedSharding(mesh, P(('data', 'fsdp'), None, 'tensor'))
  assert y.sharding.is_equivalent_to(expected, 3)
  assert y.addressable_data(0).shape == (4, 4, 4)
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), 2 * np.ones((8, 4, 16)))


def test_check_divisible_names_the_dimension():
  mesh = small_mesh(dp=2, tp=4)
  with pytest.raises(ShardingError, match=r'kv cache: dimension 2 \(cache_kv_heads\) has size 2'):
    rules.check_divisible(
      (4, 64, 2, 8),
      ('cache_batch', 'cache_seq', 'cache_kv_heads', 'head_dim'),
      mesh,
      what='kv cache',
    )
  rules.check_divisible(
    (4, 64, 4, 8), ('cache_batch', 'cache_seq', 'cache_kv_heads', 'head_dim'), mesh, what='kv cache'
  )
