"""The one table that maps logical axis names to mesh axes.

Model code names the axes of every parameter and activation logically ('embed', 'heads', ...)
and never mentions a mesh axis. This table turns those names into `PartitionSpec`s. Because
every mesh has the same axis names ('data', 'fsdp', 'context', 'tensor') and only their sizes
differ, the same table serves every `ParallelConfig`: on a (dp=8, tp=1) mesh 'tensor' has size 1
and the heads are simply not split; on a cp=1 mesh 'context' has size 1 and the tokens are not.

  rules.spec(('batch', 'seq', 'act_embed'))       # P(('data', 'fsdp'), 'context', None)
  rules.sharding(('batch', 'seq'), dp8_mesh).spec  # P(('data', 'fsdp'), None): cp = 1
  x = rules.constrain(x, ('batch', 'seq', 'act_embed'))   # under jax.set_mesh(mesh)
"""

from collections.abc import Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from earl_jax.sharding.mesh import CONTEXT, DATA, FSDP, TENSOR, ShardingError, context_size

MeshAxes = str | tuple[str, ...] | None
Logical = Sequence[str | None]

# One entry per logical name. Parameters and activations are listed apart, because a weight's
# 'embed' dimension is split by FSDP while an activation's model dimension is not.
LOGICAL_AXIS_RULES: Mapping[str, MeshAxes] = {
  # Activations.
  'batch': (DATA, FSDP),  # B: rows of a batch
  'seq': CONTEXT,  # T: tokens (context parallelism splits each sequence)
  'act_embed': None,  # D of activations
  'act_heads': TENSOR,  # H of activations
  'act_kv_heads': TENSOR,  # K of activations
  'act_mlp': TENSOR,  # F of activations
  'act_vocab': TENSOR,  # V of logits
  'head_dim': None,  # Dh
  # Parameters.
  'embed': FSDP,  # D of weights (FSDP shards it; gathered per layer by XLA)
  'vocab': TENSOR,  # V of the embedding table / LM head
  'heads': TENSOR,  # H of q/o projections
  'kv_heads': TENSOR,  # K of k/v projections
  'mlp': TENSOR,  # F of gate/up/down projections
  'norm': None,  # D of norm scales
  # KV cache.
  'cache_batch': (DATA, FSDP),
  'cache_seq': CONTEXT,
  'cache_kv_heads': TENSOR,
}


def mesh_axes(name: str | None, rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES) -> MeshAxes:
  if name is None:
    return None
  try:
    return rules[name]
  except KeyError:
    raise ShardingError(
      f'Logical axis {name!r} has no rule; known axes: {sorted(rules)}.'
    ) from None


def spec(logical: Logical, rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES) -> PartitionSpec:
  """The PartitionSpec of an array whose dimensions have these logical names."""
  return PartitionSpec(*(mesh_axes(name, rules) for name in logical))


def for_mesh(
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
  rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES,
) -> Mapping[str, MeshAxes]:
  """`rules` on `mesh`: without context parallelism (a 'context' axis of size 1, or none) the
  tokens are not split, and the table names no 'context' axis, so that every layout without it
  keeps the specs it has always had (P(('data', 'fsdp'), None), not P(('data', 'fsdp'),
  'context'): the same placement, but not an equal spec)."""
  if context_size(mesh) > 1:
    return rules
  return {name: _without_context(axes) for name, axes in rules.items()}


def _without_context(axes: MeshAxes) -> MeshAxes:
  if axes == CONTEXT:
    return None
  if isinstance(axes, tuple) and CONTEXT in axes:
    rest = tuple(a for a in axes if a != CONTEXT)
    return rest or None
  return axes


def sharding(
  logical: Logical, mesh: jax.sharding.Mesh, rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES
) -> NamedSharding:
  return NamedSharding(mesh, spec(logical, for_mesh(mesh, rules)))


def flax_rules(
  rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES,
) -> tuple[tuple[str, MeshAxes], ...]:
  """The table in the (logical, mesh) pair form that Flax NNX variable metadata takes."""
  return tuple(rules.items())


def constrain(x: jax.Array, logical: Logical, rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES):
  """Constrains an activation to its logical sharding on the mesh set by `jax.set_mesh`.

  Without a mesh in context (plain single-device use) there is nothing to constrain and `x`
  is returned unchanged; under any mesh, including fake CPU meshes, the constraint is applied.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  if len(logical) != x.ndim:
    raise ShardingError(
      f'constrain: {x.ndim}-d array {x.shape} given {len(logical)} axes {logical}.'
    )
  return jax.lax.with_sharding_constraint(x, spec(logical, for_mesh(mesh, rules)))


def axis_size(mesh: jax.sharding.Mesh, axes: MeshAxes) -> int:
  if axes is None:
    return 1
  if isinstance(axes, str):
    axes = (axes,)
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  return size


def check_divisible(
  shape: Sequence[int],
  logical: Logical,
  mesh: jax.sharding.Mesh,
  *,
  what: str,
  rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES,
) -> None:
  """Raises ShardingError naming the dimension of `what` that the mesh does not divide."""
  if len(shape) != len(logical):
    raise ShardingError(f'{what}: shape {tuple(shape)} has {len(shape)} dims, logical {logical}.')
  rules = for_mesh(mesh, rules)
  for dim, (size, name) in enumerate(zip(shape, logical)):
    n = axis_size(mesh, mesh_axes(name, rules))
    if size % n:
      raise ShardingError(
        f'{what}: dimension {dim} ({name}) has size {size}, which the mesh axes '
        f'{mesh_axes(name, rules)} of total size {n} do not divide (mesh {dict(mesh.shape)}).'
      )
