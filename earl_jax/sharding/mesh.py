"""Mesh axis names, the canonical device list, and meshes built from a `ParallelConfig`.

Every stage of the RL step (rollout, experience, train) runs on the same devices in the same
order, each with its own mesh shape. A jitted program needs its inputs and outputs on one
device order, so every mesh is built from `canonical_devices()` and nothing else.

  mesh = mesh_lib.make_mesh(ParallelConfig(dp=2, tp=4))      # axes ('data', 'fsdp', 'tensor')
  mesh.shape                                                 # {'data': 2, 'fsdp': 1, 'tensor': 4}
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from earl_jax.config import ModelConfig, ParallelConfig

DATA = 'data'
FSDP = 'fsdp'
TENSOR = 'tensor'
MESH_AXES: tuple[str, str, str] = (DATA, FSDP, TENSOR)
BATCH_AXES: tuple[str, str] = (DATA, FSDP)


class ShardingError(ValueError):
  """A layout that does not fit the model, the batch or the devices."""


def canonical_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """All devices ordered by (process, id): the one device order every mesh uses."""
  devices = list(jax.devices() if devices is None else devices)
  return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(
  parallel: ParallelConfig,
  devices: Sequence[jax.Device] | None = None,
  *,
  axis_type: AxisType = AxisType.Auto,
) -> Mesh:
  """Builds the ('data', 'fsdp', 'tensor') mesh of `parallel` over the canonical devices.

  Args:
    parallel: the layout; its product must equal the number of devices.
    devices: defaults to all devices; they are put in canonical order.
    axis_type: Auto (GSPMD propagation, the default for model code) or Explicit.

  Raises:
    ShardingError: the layout does not use exactly the given devices.
  """
  devices = canonical_devices(devices)
  if parallel.num_devices != len(devices):
    raise ShardingError(
      f'Parallel config {parallel} (dp={parallel.dp} x fsdp={parallel.fsdp} x tp={parallel.tp} '
      f'= {parallel.num_devices} devices) does not match the {len(devices)} devices available.'
    )
  grid = np.array(devices, dtype=object).reshape(parallel.shape)
  return Mesh(grid, MESH_AXES, axis_types=(axis_type,) * len(MESH_AXES))


def parallel_config_of(mesh: Mesh) -> ParallelConfig:
  """The `ParallelConfig` a mesh made by `make_mesh` was built from."""
  if tuple(mesh.axis_names) != MESH_AXES:
    raise ShardingError(f'Mesh axes {mesh.axis_names} are not {MESH_AXES}.')
  return ParallelConfig(dp=mesh.shape[DATA], fsdp=mesh.shape[FSDP], tp=mesh.shape[TENSOR])


def same_devices(a: Mesh, b: Mesh) -> bool:
  """Whether two meshes hold the same devices in the same (flattened) order."""
  return list(a.devices.flat) == list(b.devices.flat)


def abstract_arrays(tree):
  """ShapeDtypeStructs with the same shapes, dtypes and shardings as a tree of arrays.

  Used wherever a program is lowered ahead of time or a checkpoint is restored "like" live arrays.
  Leaves that are already ShapeDtypeStructs are returned as they are.
  """
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, 'sharding', None)), tree
  )


def factorizations(n: int, *, with_fsdp: bool = True) -> list[ParallelConfig]:
  """Every (dp, fsdp, tp) with dp * fsdp * tp == n, sorted by (tp, fsdp, dp)."""
  out = []
  for tp in range(1, n + 1):
    if n % tp:
      continue
    rest = n // tp
    for fsdp in range(1, rest + 1) if with_fsdp else (1,):
      if rest % fsdp:
        continue
      out.append(ParallelConfig(dp=rest // fsdp, fsdp=fsdp, tp=tp))
  return sorted(out, key=lambda p: (p.tp, p.fsdp, p.dp))


def check_model_fits(parallel: ParallelConfig, model: ModelConfig) -> None:
  """Raises ShardingError naming every model dimension the layout does not divide."""
  problems = []
  tp, fsdp = parallel.tp, parallel.fsdp
  for what, size, by, axis in (
    ('num_heads (H)', model.num_heads, tp, 'tp'),
    ('num_kv_heads (K)', model.num_kv_heads, tp, 'tp'),
    ('intermediate_size (F)', model.intermediate_size, tp, 'tp'),
    ('vocab_size (V)', model.vocab_size, tp, 'tp'),
    ('hidden_size (D)', model.hidden_size, fsdp, 'fsdp'),
  ):
    if size % by:
      problems.append(f'{what}={size} is not divisible by {axis}={by}')
  if problems:
    raise ShardingError(
      f'Parallel config {parallel} does not fit model {model.name!r}: ' + '; '.join(problems) + '.'
    )


def check_batch_fits(parallel: ParallelConfig, batch: int, *, what: str = 'batch') -> None:
  """Raises ShardingError when `batch` rows do not split over data x fsdp."""
  if batch % parallel.batch_shards:
    raise ShardingError(
      f'{what}={batch} is not divisible by the {parallel.batch_shards} batch shards of '
      f'{parallel} (dp={parallel.dp} x fsdp={parallel.fsdp}); use a multiple of '
      f'{parallel.batch_shards}.'
    )
