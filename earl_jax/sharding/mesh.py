"""Mesh axis names, the canonical device list, and meshes built from a `ParallelConfig`.

Every stage of the RL step (rollout, experience, train) runs on the same devices in the same
order, each with its own mesh shape. A jitted program needs its inputs and outputs on one
device order, so every mesh is built from `canonical_devices()` and nothing else.

  mesh = mesh_lib.make_mesh(ParallelConfig(dp=2, tp=4))   # axes ('data', 'fsdp', 'context', 'tensor')
  mesh.shape                                   # {'data': 2, 'fsdp': 1, 'context': 1, 'tensor': 4}
"""

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.errors import UserError

DATA = 'data'
FSDP = 'fsdp'
TENSOR = 'tensor'
CONTEXT = 'context'
MESH_AXES: tuple[str, str, str, str] = (DATA, FSDP, CONTEXT, TENSOR)
BATCH_AXES: tuple[str, str] = (DATA, FSDP)


class ShardingError(UserError):
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
  """Builds the ('data', 'fsdp', 'context', 'tensor') mesh of `parallel` over the canonical
  devices.

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
      f'Parallel config {parallel} (dp={parallel.dp} x fsdp={parallel.fsdp} x cp={parallel.cp} '
      f'x tp={parallel.tp} = {parallel.num_devices} devices) does not match the {len(devices)} devices available.'
    )
  grid = np.array(devices, dtype=object).reshape(parallel.shape)
  return Mesh(grid, MESH_AXES, axis_types=(axis_type,) * len(MESH_AXES))


def parallel_config_of(mesh: Mesh) -> ParallelConfig:
  """The `ParallelConfig` a mesh made by `make_mesh` was built from."""
  if tuple(mesh.axis_names) != MESH_AXES:
    raise ShardingError(f'Mesh axes {mesh.axis_names} are not {MESH_AXES}.')
  shape = mesh.shape
  return ParallelConfig(dp=shape[DATA], fsdp=shape[FSDP], tp=shape[TENSOR], cp=shape[CONTEXT])


def context_size(mesh: Mesh | jax.sharding.AbstractMesh) -> int:
  """How many devices split each sequence on `mesh` (its 'context' axis; 1 on an empty mesh or
  one without the axis)."""
  return 1 if mesh.empty else dict(mesh.shape).get(CONTEXT, 1)


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


def factorizations(
  n: int, *, with_fsdp: bool = True, with_cp: bool = False
) -> list[ParallelConfig]:
  """Every (dp, fsdp, cp, tp) with dp * fsdp * cp * tp == n (fsdp = 1 unless `with_fsdp`, cp = 1
  unless `with_cp`), sorted by (cp, tp, fsdp, dp): the layouts without context parallelism first,
  in the order they had before it existed."""
  out = []
  for cp in range(1, n + 1) if with_cp else (1,):
    if n % cp:
      continue
    for tp in range(1, n // cp + 1):
      if (n // cp) % tp:
        continue
      rest = n // cp // tp
      for fsdp in range(1, rest + 1) if with_fsdp else (1,):
        if rest % fsdp:
          continue
        out.append(ParallelConfig(dp=rest // fsdp, fsdp=fsdp, tp=tp, cp=cp))
  return sorted(out, key=layout_order)


def layout_order(p: ParallelConfig) -> tuple[int, int, int, int]:
  """The order candidates are listed in: (cp, tp, fsdp, dp)."""
  return (p.cp, p.tp, p.fsdp, p.dp)


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


def check_context_fits(
  parallel: ParallelConfig, lengths: Sequence[int], *, what: str = 'bucket'
) -> None:
  """Raises ShardingError when a sequence length does not split over the layout's cp devices
  (each device holds T / cp contiguous tokens of every row)."""
  bad = [t for t in lengths if t % parallel.cp]
  if bad:
    raise ShardingError(
      f'{what} lengths {bad} do not split over the cp={parallel.cp} devices of {parallel} '
      f'(each holds T / cp tokens of a row): expected lengths that are multiples of {parallel.cp}.'
    )


def local_rows(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> np.ndarray:
  """int64 [R]: the indices along dimension 0 held by this process's devices, sorted.

  Rows replicated over some mesh axes (e.g. 'tensor') count once; a row whose replicas span
  several processes is local to each of them.
  """
  rows: set[int] = set()
  # Only dimension 0 matters: the others are probed at the device count, which every split of
  # them divides (a [B, T] sharding split over 'context' asked about (B, 1)).
  probe = (shape[0], *([len(sharding.device_set)] * (len(shape) - 1)))
  for index in sharding.addressable_devices_indices_map(probe).values():
    start, stop, _ = index[0].indices(shape[0])
    rows.update(range(start, stop))
  return np.array(sorted(rows), np.int64)


def host_rows(x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
  """The rows of `x` this process holds, read from its addressable shards only.

  Works on arrays that span other processes (where `jax.device_get` cannot). Every row is read
  once, from the first shard that holds it; dimension 0 must be whole within each shard's
  other dimensions (rows split, other dimensions replicated or whole).

  Returns:
    (int64 [R] the sorted row indices, [R, ...] their values).
  """
  pieces: dict[int, np.ndarray] = {}
  for shard in x.addressable_shards:
    index = shard.index
    if any(s != slice(None) and s.indices(n) != (0, n, 1) for s, n in zip(index[1:], x.shape[1:])):
      raise ShardingError(f'host_rows: shards of {x.shape} split a dimension other than 0.')
    start = index[0].indices(x.shape[0])[0]
    if start in pieces:
      continue
    pieces[start] = np.asarray(shard.data)
  starts = sorted(pieces)
  values = np.concatenate([pieces[s] for s in starts], axis=0)
  rows = np.concatenate([np.arange(s, s + len(pieces[s])) for s in starts])
  order = np.argsort(rows, kind='stable')
  rows, values = rows[order], values[order]
  keep = np.concatenate([[True], rows[1:] != rows[:-1]]) if rows.size else rows.astype(bool)
  return rows[keep], values[keep]


def put_rows(
  values: np.ndarray, rows: np.ndarray, shape: Sequence[int], sharding: jax.sharding.Sharding
) -> jax.Array:
  """A global array of `shape` on `sharding` from this process's rows (`values[i]` is row
  `rows[i]`); every process passes its own rows, which must cover its devices' blocks."""
  shape = tuple(shape)
  rows = np.asarray(rows)
  if sharding.is_fully_addressable and np.shape(values) == shape and rows.shape == shape[:1]:
    # Every device is this process's: one batched transfer of the whole array. One device_put
    # per device costs about 5x as much (a rollout turn's 4 inputs on 8 CPU devices: 1.2 ms
    # against 0.23 ms).
    order = np.argsort(rows, kind='stable')
    if np.array_equal(rows[order], np.arange(shape[0])):
      # Indexing copies: a CPU device may alias the host buffer it is given.
      return jax.device_put(np.asarray(values)[order], sharding)
  position = {int(r): i for i, r in enumerate(rows.tolist())}

  def block(index):
    start, stop, _ = index[0].indices(shape[0])
    try:
      picked = [position[r] for r in range(start, stop)]
    except KeyError as e:
      raise ShardingError(f'put_rows: row {e.args[0]} of {shape} is not held here.') from None
    return np.ascontiguousarray(values[picked][(slice(None), *index[1:])])

  return _explicit(shape, sharding, block)


def _explicit(shape, sharding: jax.sharding.Sharding, block) -> jax.Array:
  """A global array from host blocks, one explicit transfer per addressable device (allowed
  under `jax.transfer_guard('disallow')`, which refuses implicit ones)."""
  arrays = [
    jax.device_put(block(index), device)
    for device, index in sharding.addressable_devices_indices_map(shape).items()
  ]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def put_replicated(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A small host value (the same on every process) replicated on `sharding`."""
  value = np.array(value)  # a copy: a CPU device may alias the host buffer it is given
  if sharding.is_fully_addressable:
    return jax.device_put(value, sharding)
  return _explicit(value.shape, sharding, lambda index: value[index])
