"""Routing: which device sends each unit of the target layout (the first step of a plan).

Pure numpy. Fields are grouped by their block structure, each group is cut into units, and every
unit a target device needs is given a sending device (see the vocabulary in plan.py):

  fields   group_fields: fields that route identically, keyed by their (source, target) blocks.
  units    route_group: a group's unit (one row, or one row times a chunk of g columns, g the gcd
           of the source and target column block widths), its fields' block shapes, and
  route    route: for every target unit, the device that sends it and its local unit there; a
           unit the target already holds is copied locally, otherwise the least-loaded source
           replica (by bytes sent so far, ties towards the replica after the target in ring
           order) sends it, or for stable plans a fixed replica per (source block, target
           device), so that their pairs do not depend on the permutation (`reach`).
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

from earl_jax.dispatch.layout import Layout, LayoutError, check_compatible


@dataclasses.dataclass(frozen=True)
class FieldPlan:
  """One field of a group: its leaf index, shapes and per-device block shapes."""

  index: int
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  src_block: tuple[int, ...]
  dst_block: tuple[int, ...]
  unit_shape: tuple[int, ...]

  @property
  def unit_bytes(self) -> int:
    return math.prod(self.unit_shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class RoutedGroup:
  """One group of fields with the same block structure, routed unit by unit.

  Attributes:
    fields: the group's fields.
    src_units / dst_units: local units per device in the source / target layout.
    unit_bytes: bytes of one unit summed over the group's fields.
    src_dev: int64 [n, dst_units]: the device each target unit comes from.
    src_unit: int64 [n, dst_units]: its local unit index on that device.
    counts: int64 [n, n]: units sent from device s (row) to device d (column); the diagonal
      counts local copies.
    reach: with fixed routing (`route`), bool [n, n]: the pairs (s, d) between two devices that
      some permutation routes units over; else None.
  """

  fields: tuple[FieldPlan, ...]
  src_units: int
  dst_units: int
  unit_bytes: int
  src_dev: np.ndarray
  src_unit: np.ndarray
  counts: np.ndarray
  reach: np.ndarray | None = None


def device_blocks(layout: Layout, index: int, shape: tuple[int, ...]) -> np.ndarray:
  """[n, 4] (row start, row stop, col start, col stop) of field `index` on every device, in the
  mesh's flattened device order. Columns are dimension 1 ([0, 1) for 1-D fields)."""
  sharding = layout.sharding(index)
  indices = sharding.devices_indices_map(shape)
  out = np.zeros((layout.num_devices, 4), np.int64)
  for k, device in enumerate(layout.mesh.devices.flat):
    idx = indices[device]
    rows = idx[0].indices(shape[0])
    out[k, 0], out[k, 1] = rows[0], rows[1]
    if len(shape) >= 2:
      cols = idx[1].indices(shape[1])
      out[k, 2], out[k, 3] = cols[0], cols[1]
    else:
      out[k, 2], out[k, 3] = 0, 1
  return out


def check_permutation(perm: np.ndarray | Sequence[int], rows: int) -> np.ndarray:
  """Returns `perm` as int64 [B]; raises LayoutError unless it is a permutation of range(B)."""
  p = np.asarray(perm)
  if p.shape != (rows,) or not np.issubdtype(p.dtype, np.integer):
    raise LayoutError(
      f'A row permutation must be an integer array of shape ({rows},) for a batch of {rows} rows; '
      f'got {p.dtype} {p.shape}.'
    )
  p = p.astype(np.int64)
  seen = np.zeros(rows, bool)
  if rows and (p.min() < 0 or p.max() >= rows):
    raise LayoutError(f'Row permutation has entries outside [0, {rows}).')
  seen[p] = True
  if not seen.all():
    raise LayoutError(
      f'Row permutation of {rows} rows repeats rows (misses {int((~seen).sum())} of them); '
      f'a dispatch never duplicates or drops rows.'
    )
  return p


def checked_structs(
  src: Layout, dst: Layout, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype]
) -> list[jax.ShapeDtypeStruct]:
  """The fields as ShapeDtypeStructs, checked against both layouts (LayoutError)."""
  check_compatible(src, dst)
  if len(shapes) != len(src.fields) or len(dtypes) != len(src.fields):
    raise LayoutError(
      f'make_plan got {len(shapes)} shapes and {len(dtypes)} dtypes for {len(src.fields)} fields.'
    )
  structs = [jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for s, d in zip(shapes, dtypes)]
  for layout, role in ((src, 'source'), (dst, 'target')):
    layout.check(jax.tree.unflatten(layout.treedef, structs), what=f'batch ({role} layout)')
  return structs


def route(
  rows: int,
  cols: int,
  chunk: int,
  perm: np.ndarray | None,
  src_blocks: np.ndarray,
  dst_blocks: np.ndarray,
  unit_bytes: int,
  fixed: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """For every target device and local target unit: the sending device and its local unit.

  With `fixed`, a target device always takes a source block from the same replica, whatever the
  permutation (the replicas in ring order after the target, the next one for the next device
  that holds the same target block and for the next target block): stable plans then see the
  same pairs for every permutation, so their kernels settle sooner, and every replica sends.
  Otherwise the least-loaded replica.

  Returns:
    (src_dev, src_unit), each int64 [n, dst_units_per_device], and with `fixed` the reach (see
    RoutedGroup), else None.
  """
  n = len(src_blocks)
  src_block_rows = int(src_blocks[0, 1] - src_blocks[0, 0])
  src_block_cols = int(src_blocks[0, 3] - src_blocks[0, 2])
  src_chunks_per_row = src_block_cols // chunk
  src_col_blocks = cols // src_block_cols
  block_of_dev = (src_blocks[:, 0] // src_block_rows) * src_col_blocks + (
    src_blocks[:, 2] // src_block_cols
  )
  holders: dict[int, list[int]] = {}
  for s in range(n):
    holders.setdefault(int(block_of_dev[s]), []).append(s)
  load = np.zeros(n, np.int64)
  dst_block_rows = int(dst_blocks[0, 1] - dst_blocks[0, 0])
  dst_chunks_per_row = int(dst_blocks[0, 3] - dst_blocks[0, 2]) // chunk
  dst_units_per_device = dst_block_rows * dst_chunks_per_row
  src_dev = np.zeros((n, dst_units_per_device), np.int64)
  src_unit = np.zeros((n, dst_units_per_device), np.int64)
  unit = np.arange(dst_units_per_device)
  # Each target device's index among the devices that hold its target block, and the index of
  # that block among the distinct target blocks.
  same_block = [int(np.sum(np.all(dst_blocks[:d] == dst_blocks[d], axis=1))) for d in range(n)]
  distinct = {tuple(b): None for b in dst_blocks.tolist()}
  block_index = {b: i for i, b in enumerate(distinct)}
  target_block = [block_index[tuple(b)] for b in dst_blocks.tolist()]

  def replica(b: int, d: int) -> int:
    """The replica of source block b that sends to device d, with fixed routing: the devices
    that hold one target block take it from different replicas, and so do consecutive target
    blocks, so that every replica sends (fewer rounds than one replica sending to all)."""
    ring = sorted(holders[b], key=lambda h: (h - d) % n)
    return ring[(same_block[d] + target_block[d]) % len(ring)]

  for d in range(n):
    target_row = dst_blocks[d, 0] + unit // dst_chunks_per_row
    col_chunk = dst_blocks[d, 2] // chunk + unit % dst_chunks_per_row
    row = target_row if perm is None else perm[target_row]
    col = col_chunk * chunk
    block = (row // src_block_rows) * src_col_blocks + col // src_block_cols
    src_unit[d] = (row % src_block_rows) * src_chunks_per_row + (
      col_chunk - (col // src_block_cols) * src_chunks_per_row
    )
    chosen = np.empty(dst_units_per_device, np.int64)
    uniq, inverse, sizes = np.unique(block, return_inverse=True, return_counts=True)
    for j, (b, size) in enumerate(zip(uniq, sizes)):
      replicas = holders[int(b)]
      if d in replicas:
        pick = d
      elif fixed:
        pick = replica(int(b), d)
      else:
        pick = min(replicas, key=lambda h: (load[h], (h - d) % n))
        load[pick] += int(size) * unit_bytes
      chosen[inverse == j] = pick
    src_dev[d] = chosen
  if not fixed:
    return src_dev, src_unit, None
  # Any row may come to any target device: every source block over its columns may send to it.
  reach = np.zeros((n, n), bool)
  for d in range(n):
    first = int(dst_blocks[d, 2]) // src_block_cols
    last = -(-int(dst_blocks[d, 3]) // src_block_cols)
    for row_block in range(rows // src_block_rows):
      for col_block in range(first, last):
        b = row_block * src_col_blocks + col_block
        if d not in holders[b]:
          reach[replica(b, d), d] = True
  return src_dev, src_unit, reach


def _block_shape(blocks: np.ndarray, shape: tuple[int, ...], col_split: bool) -> tuple[int, ...]:
  """A device's block of a field: [rows, cols (split or whole), rest...]."""
  rows = int(blocks[0, 1] - blocks[0, 0])
  if len(shape) < 2:
    return (rows,)
  cols = int(blocks[0, 3] - blocks[0, 2]) if col_split else shape[1]
  return (rows, cols, *shape[2:])


def group_fields(
  src: Layout, dst: Layout, structs: Sequence[jax.ShapeDtypeStruct]
) -> dict[tuple, list[tuple[int, np.ndarray, np.ndarray]]]:
  """Fields grouped by their (source, target) block structure: one routing per group. Each
  member is (field index, source blocks, target blocks)."""
  members: dict[tuple, list[tuple[int, np.ndarray, np.ndarray]]] = {}
  for i, struct in enumerate(structs):
    sb = device_blocks(src, i, struct.shape)
    db = device_blocks(dst, i, struct.shape)
    cols = struct.shape[1] if len(struct.shape) >= 2 else 1
    full_s = np.all(sb[:, 2] == 0) and np.all(sb[:, 3] == cols)
    full_d = np.all(db[:, 2] == 0) and np.all(db[:, 3] == cols)
    if full_s and full_d:
      sb, db = sb.copy(), db.copy()
      sb[:, 2:], db[:, 2:] = (0, 1), (0, 1)
      key = ('rows', sb[:, :2].tobytes(), db[:, :2].tobytes())
    else:
      key = ('cols', cols, sb.tobytes(), db.tobytes())
    members.setdefault(key, []).append((i, sb, db))
  return members


def route_group(
  src: Layout,
  key: tuple,
  group: list[tuple[int, np.ndarray, np.ndarray]],
  structs: Sequence[jax.ShapeDtypeStruct],
  perm: np.ndarray | None,
  fixed: bool = False,
) -> RoutedGroup:
  """The unit size of a group, its fields' block shapes, and where every target unit comes from
  (`fixed`: see `route`)."""
  _, sb, db = group[0]
  n = src.num_devices
  rows = structs[0].shape[0]
  col_split = key[0] == 'cols'
  cols = key[1] if col_split else 1
  chunk = math.gcd(int(sb[0, 3] - sb[0, 2]), int(db[0, 3] - db[0, 2])) if col_split else 1
  src_units = int(sb[0, 1] - sb[0, 0]) * (int(sb[0, 3] - sb[0, 2]) // chunk)
  dst_units = int(db[0, 1] - db[0, 0]) * (int(db[0, 3] - db[0, 2]) // chunk)
  fields = tuple(
    FieldPlan(
      index=i,
      path=src.fields[i].path,
      shape=structs[i].shape,
      dtype=structs[i].dtype,
      src_block=_block_shape(sb, structs[i].shape, col_split),
      dst_block=_block_shape(db, structs[i].shape, col_split),
      unit_shape=(chunk, *structs[i].shape[2:]) if col_split else tuple(structs[i].shape[1:]),
    )
    for i, _, _ in group
  )
  unit_bytes = sum(f.unit_bytes for f in fields)
  src_dev, src_unit, reach = route(rows, cols, chunk, perm, sb, db, max(1, unit_bytes), fixed)
  counts = np.zeros((n, n), np.int64)
  for d in range(n):
    counts[:, d] = np.bincount(src_dev[d], minlength=n)
  return RoutedGroup(fields, src_units, dst_units, unit_bytes, src_dev, src_unit, counts, reach)
