"""Per-group reward statistics with collectives, on the train layout, without a controller.

REINFORCE with a per-prompt baseline and GRPO normalise each reward by the mean (and std) of the
rewards of its group (the responses to one prompt). In the paper's prototype the rewards go
through the single controller for this; here each device reduces its own rows into per-group
sums and a `psum` over the batch axes completes them, so every device ends up with the full
per-group table and reads back the statistics of its own rows. Two passes (sum and count, then
the sum of squared deviations from the mean) keep the variance accurate.

  mean_B, std_B, count_B = group_stats(rewards_B, group_ids_B, valid_B, num_groups=G, mesh=mesh)
  advantages_B = (rewards_B - mean_B) / (std_B + eps)                    # GRPO

Per-shard shapes (rows sharded over `batch_axes`, replicated over the other axes):
  rewards [B/s] f32, group_ids [B/s] int32 in [0, G), valid [B/s] bool
  -> segment sums [G] -> psum over batch_axes [G] -> gathered back per row [B/s] x 3.
Invalid (padding) rows contribute nothing; their outputs are the statistics of their group id
(0 when the group has no valid row). std is sqrt(sum of squares / (count - ddof)), 0 where
count <= ddof.
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from earl_jax.sharding import rules
from earl_jax.sharding.mesh import BATCH_AXES


def _group_stats_kernel(mesh: Mesh, batch_axes: tuple[str, ...], num_groups: int, ddof: int):
  """The jitted shard_map kernel (see the module docstring). Built per call and not cached: under
  the caller's jit it is traced once and inlined; an eager call compiles it (the persistent
  compilation cache makes that cheap)."""

  def per_shard(rewards, group_ids, valid):
    w = valid.astype(jnp.float32)
    r = rewards.astype(jnp.float32)
    count = jax.lax.psum(jax.ops.segment_sum(w, group_ids, num_segments=num_groups), batch_axes)
    total = jax.lax.psum(jax.ops.segment_sum(w * r, group_ids, num_segments=num_groups), batch_axes)
    mean = jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)
    dev = (r - mean[group_ids]) * w
    sq = jax.lax.psum(
      jax.ops.segment_sum(dev * dev, group_ids, num_segments=num_groups), batch_axes
    )
    var = jnp.where(count > ddof, sq / jnp.maximum(count - ddof, 1.0), 0.0)
    std = jnp.sqrt(var)
    return mean[group_ids], std[group_ids], count[group_ids]

  spec = P(batch_axes)
  return jax.jit(
    jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec, spec))
  )


def group_stats(
  rewards_B: Float[Array, ' B'],
  group_ids_B: Int[Array, ' B'],
  valid_B: Bool[Array, ' B'],
  *,
  num_groups: int,
  mesh: Mesh,
  batch_axes: tuple[str, ...] = BATCH_AXES,
  ddof: int = 0,
) -> tuple[Float[Array, ' B'], Float[Array, ' B'], Float[Array, ' B']]:
  """Per-row mean, std and count of the rewards of the row's group, over valid rows.

  Args:
    rewards_B: rewards (any float dtype; statistics are computed in f32).
    group_ids_B: group (prompt) index of each row, in [0, num_groups).
    valid_B: False for padding rows, which are left out of every statistic.
    num_groups: G, static.
    mesh: the mesh the rows are sharded on (e.g. the train mesh).
    batch_axes: the mesh axes the rows are sharded over; the psum runs over these only, so
      copies over the other axes (e.g. 'tensor') are not counted twice.
    ddof: delta degrees of freedom of the std (0: population, 1: sample).

  Returns:
    (mean_B, std_B, count_B), f32, sharded like the rows.
  """
  if not isinstance(num_groups, int) or num_groups < 1:
    raise ValueError(f'group_stats: num_groups must be a positive int, got {num_groups!r}.')
  if ddof < 0:
    raise ValueError(f'group_stats: ddof must be >= 0, got {ddof}.')
  for axis in batch_axes:
    if axis not in mesh.shape:
      raise ValueError(f'group_stats: batch axis {axis!r} is not an axis of the mesh {mesh.shape}.')
  shards = rules.axis_size(mesh, tuple(batch_axes))
  if rewards_B.shape[0] % shards:
    raise ValueError(
      f'group_stats: {rewards_B.shape[0]} rows do not split over the {shards} shards of '
      f'{batch_axes}; pad them (earl_jax.dispatch.pad_rows) and mark the padding invalid.'
    )
  fn = _group_stats_kernel(mesh, tuple(batch_axes), num_groups, ddof)
  return fn(rewards_B, group_ids_B.astype(jnp.int32), valid_B.astype(bool))
