"""Context-length buckets: one `pad_to_bucket`, so each jitted program compiles once per bucket.

table = BucketConfig(lengths=(64, 128, 256))
padded, n = pad_to_bucket(tokens_BxT, table, axis=1)     # T=100 -> n=128
"""

from typing import TypeVar

import jax.numpy as jnp
import numpy as np

from earl_jax.config import BucketConfig

ArrayT = TypeVar('ArrayT', np.ndarray, jnp.ndarray)


def pad_to_bucket(
  x: ArrayT, buckets: BucketConfig, *, axis: int = -1, pad_value: int | float | bool = 0
) -> tuple[ArrayT, int]:
  """Pads `x` along `axis` (at the end) to the smallest bucket that holds it.

  Works on numpy arrays (host data, the usual case) and on jax arrays.

  Returns:
    (padded array, bucket length).

  Raises:
    ValueError: `x` is longer than the largest bucket; the message names both.
  """
  axis = axis % x.ndim
  length = x.shape[axis]
  bucket = buckets.bucket_for(length)
  if bucket == length:
    return x, bucket
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, bucket - length)
  xp = np if isinstance(x, np.ndarray) else jnp
  return xp.pad(x, widths, constant_values=pad_value), bucket


def round_up(n: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= `n` (a length padded to an alignment)."""
  return -(-n // multiple) * multiple
