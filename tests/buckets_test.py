"""pad_to_bucket on host and device arrays."""

import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax import buckets
from earl_jax.config import BucketConfig

TABLE = BucketConfig(lengths=(8, 16, 32))


def test_pads_to_the_smallest_bucket_at_the_end():
  x = np.arange(2 * 11).reshape(2, 11)
  padded, n = buckets.pad_to_bucket(x, TABLE, axis=1, pad_value=-1)
  assert n == 16 and padded.shape == (2, 16) and isinstance(padded, np.ndarray)
  np.testing.assert_array_equal(padded[:, :11], x)
  assert (padded[:, 11:] == -1).all()


def test_exact_fit_is_unchanged_and_jax_arrays_stay_jax():
  x = jnp.ones((3, 8))
  padded, n = buckets.pad_to_bucket(x, TABLE, axis=-1)
  assert n == 8 and padded is x
  y, n = buckets.pad_to_bucket(jnp.ones((9, 2)), TABLE, axis=0)
  assert n == 16 and isinstance(y, jnp.ndarray) and y.shape == (16, 2)


def test_too_long_names_the_length_and_the_table():
  with pytest.raises(
    ValueError, match=r'Length 33 is longer than the largest bucket 32 \(buckets: \(8, 16, 32\)\)'
  ):
    buckets.pad_to_bucket(np.zeros((1, 33)), TABLE, axis=1)
