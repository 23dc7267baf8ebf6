"""The ops and index tables a plan's kernel reads (pure numpy).

Per device int32 index tables: for every round the source units to send (or an offset when they
are one contiguous run, or nothing when it is the whole local block), and for the output the
position of every target unit in the "pool" [local units, round 0 section, round 1 section, ...]
(or an offset into one pool region when the output is one contiguous run of it, or nothing when
it is a whole region). The op kinds (`SendOp`, `OutOp`) are static; the tables are data. A plan
for a kernel that writes into landing buffers (`PlanOptions.land`) replaces the gather by the
inverse table: the slot of every local and every received unit, so each round's buffer is
written as it arrives ('scatter').
"""

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from earl_jax.dispatch.routing import RoutedGroup
from earl_jax.dispatch.schedule import PlanOptions, Round, capacity_bucket


@dataclasses.dataclass(frozen=True)
class SendOp:
  """How a group's section of a round is cut from its local units: 'full' (the whole local
  block), 'slice' (a contiguous run at a per-device offset), 'gather' (per-device indices) or
  'none' (the group sends nothing in this round)."""

  kind: Literal['full', 'slice', 'gather', 'none']


@dataclasses.dataclass(frozen=True)
class OutOp:
  """How the output block is read from the pool: 'full' (one region, whole), 'slice' (one
  region at a per-device offset), 'gather' (per-device indices into the whole pool), 'update'
  (the local block with `updates` units overwritten from the pool: the units that stay in their
  slot are not copied when the source is donated) or 'scatter' (a landing buffer the regions
  are written into as they arrive: first `updates` local units, then each round's received
  buffer into its slots, so a round's buffer is dead once written and the next round reuses
  its memory; the kernel holds about one round in flight instead of every received buffer)."""

  kind: Literal['full', 'slice', 'gather', 'update', 'scatter']
  region: int = -1  # 0 = local units, r + 1 = this group's section of round r ('update': 1 =
  # the written units come from the received buffers alone, 0 = from the whole pool)
  updates: int = 0  # 'update': the slots written per device (a capacity bucket, padded);
  # 'scatter': the local units written per device (a power of two, or the exact count)


SendTable = np.ndarray | None
OutTable = np.ndarray | None


def _contiguous(rows: np.ndarray) -> bool:
  return len(rows) <= 1 or bool(np.all(np.diff(rows) == 1))


def _send_op(
  units_of_sender: dict[int, np.ndarray],
  cap: int,
  n: int,
  src_units_per_device: int,
  stable: bool,
) -> tuple[SendOp, SendTable]:
  """The cheapest op that sends every sender's units in one ppermute round, and its table:
  the whole block, one contiguous run per sender, or (always, when `stable`) a row gather."""
  senders = [u for u in units_of_sender.values() if len(u)]
  whole = np.arange(src_units_per_device)
  if not stable:
    if cap == src_units_per_device and all(
      len(u) == src_units_per_device and np.array_equal(u, whole) for u in senders
    ):
      return SendOp('full'), None
    if all(_contiguous(u) for u in senders) and all(
      (u[0] if len(u) else 0) + cap <= src_units_per_device for u in units_of_sender.values()
    ):
      table = np.zeros((n,), np.int64)
      for s, units in units_of_sender.items():
        table[s] = units[0] if len(units) else 0
      return SendOp('slice'), table.astype(np.int32)
  table = np.zeros((n, cap), np.int64)
  for s, units in units_of_sender.items():
    table[s, : len(units)] = units
  return SendOp('gather'), table.astype(np.int32)


def _scatter_out(
  pool_idx: np.ndarray, region_of: np.ndarray, sizes: Sequence[int], local_cap: int
) -> tuple[OutOp, OutTable]:
  """The 'scatter' output op and its table [n, 2, local_cap + received units] (see OutOp)."""
  n, dst_units_per_device = pool_idx.shape
  received = int(sum(sizes[1:]))
  table = np.zeros((n, 2, local_cap + received), np.int64)
  table[:, 0, :] = dst_units_per_device  # padding: out of bounds, dropped by the scatter
  for d in range(n):
    local = np.nonzero(region_of[d] == 0)[0]
    table[d, 0, : len(local)] = local
    table[d, 1, : len(local)] = pool_idx[d, local]
    remote = np.nonzero(region_of[d] > 0)[0]
    # Pool positions past the local region are the received units in pool order.
    table[d, 0, local_cap + pool_idx[d, remote] - sizes[0]] = remote
  return OutOp('scatter', updates=local_cap), table.astype(np.int32)


def _local_cap(region_of: np.ndarray, options: PlanOptions, group: int) -> int:
  """Width of a 'scatter' table's local section: the most units a device keeps, exact (static
  plans), a power of two at least the floor's (stable plans, `Floor.local`), or a capacity bucket
  (other permuted plans), so that the kernels of a stream of permutations repeat."""
  dst_units_per_device = region_of.shape[1]
  most = int((region_of == 0).sum(axis=1).max())
  if options.static:
    return most
  if options.stable:
    least = options.floor.local[group] if options.floor is not None else 0
    return max(capacity_bucket(most, dst_units_per_device, 1), min(least, dst_units_per_device))
  return capacity_bucket(most, dst_units_per_device, options.buckets_per_octave)


def _single_region_out(
  pool_idx: np.ndarray, region_of: np.ndarray, offsets: np.ndarray, sizes: Sequence[int], options
) -> tuple[OutOp, OutTable] | None:
  """'full' or 'slice' when every target unit of every device comes from one pool region as one
  contiguous run; else None."""
  n, dst_units_per_device = pool_idx.shape
  regions = np.unique(region_of)
  if len(regions) != 1:
    return None
  region = int(regions[0])
  local = pool_idx - offsets[region]
  if (region == 0 or options.collective != 'all_to_all') and all(
    _contiguous(local[d]) for d in range(n)
  ):
    starts = local[:, 0]
    if np.all(starts == 0) and dst_units_per_device == sizes[region]:
      return OutOp('full', region), None
    return OutOp('slice', region), starts.astype(np.int32)
  return None


def _update_out(pool_idx: np.ndarray, sizes: Sequence[int]) -> tuple[OutOp, OutTable] | None:
  """'update' when at most half of every device's slots change (the units already in their slot,
  local unit j at slot j, need no write); else None."""
  n, dst_units_per_device = pool_idx.shape
  changed = pool_idx != np.arange(dst_units_per_device)[None, :]
  most = int(changed.sum(axis=1).max())
  if not 0 < most <= dst_units_per_device // 2:
    return None
  width = capacity_bucket(most, dst_units_per_device, per_octave=2)
  # When every written unit was received (none moves within its device), the sources index
  # the received buffers alone (region 1), so the write never reads the block it updates.
  received_only = bool((pool_idx[changed] >= sizes[0]).all())
  shift = sizes[0] if received_only else 0
  table = np.zeros((n, 2, width), np.int64)
  table[:, 0, :] = dst_units_per_device  # padding: out of bounds, dropped by the scatter
  for d in range(n):
    slots = np.nonzero(changed[d])[0]
    table[d, 0, : len(slots)] = slots
    table[d, 1, : len(slots)] = pool_idx[d, slots] - shift
  region = 1 if received_only else 0
  return OutOp('update', region=region, updates=width), table.astype(np.int32)


def _out_op(
  pool_idx: np.ndarray,
  region_of: np.ndarray,
  offsets: np.ndarray,
  sizes: Sequence[int],
  options: PlanOptions,
  group: int,
) -> tuple[OutOp, OutTable]:
  """The output op: one region read whole or as one run, else the local block with the changed
  slots written, else, with `land` (the kernel writes into landing buffers), a scatter of every
  region into the landing buffer as it arrives (its local section sized by `_local_cap`), else
  a gather over the pool. When `stable`: always a scatter or a gather (whether and how wide an
  update is depends on the permutation, which would multiply kernels)."""
  if options.land and options.stable:
    return _scatter_out(pool_idx, region_of, sizes, _local_cap(region_of, options, group))
  if not options.stable:
    single = _single_region_out(pool_idx, region_of, offsets, sizes, options)
    if single is not None:
      return single
    if sizes[0] == pool_idx.shape[1]:
      update = _update_out(pool_idx, sizes)
      if update is not None:
        return update
  if options.land:
    return _scatter_out(pool_idx, region_of, sizes, _local_cap(region_of, options, group))
  return OutOp('gather'), pool_idx.astype(np.int32)


def _all_to_all_table(
  routed: RoutedGroup,
  cap: int,
  pool_offset: int,
  pool_idx: np.ndarray,
  region_of: np.ndarray,
  round_index: int,
) -> np.ndarray:
  """The all_to_all round's send table [n, n * cap] (chunk d for device d); records where each
  received unit lands in the pool."""
  n = len(routed.src_dev)
  table = np.zeros((n, n * cap), np.int64)
  for s in range(n):
    for d in range(n):
      if s == d:
        continue
      pos = np.nonzero(routed.src_dev[d] == s)[0]
      table[s, d * cap : d * cap + len(pos)] = routed.src_unit[d, pos]
      pool_idx[d, pos] = pool_offset + s * cap + np.arange(len(pos))
      region_of[d, pos] = round_index + 1
  return table.astype(np.int32)


def _ppermute_units(
  routed: RoutedGroup,
  rnd: Round,
  cap: int,
  pool_offset: int,
  pool_idx: np.ndarray,
  region_of: np.ndarray,
  round_index: int,
) -> dict[int, np.ndarray]:
  """The source units every sender of a ppermute round sends; records where they land."""
  units_of_sender = {}
  for s, d in rnd.pairs:
    # A pair cut into chunks appears in several rounds: each carries its next units (not yet
    # received; a self pair takes the local ones).
    pos = np.nonzero((routed.src_dev[d] == s) & (region_of[d] <= 0))[0][:cap]
    pool_idx[d, pos] = pool_offset + np.arange(len(pos))
    region_of[d, pos] = round_index + 1
    units_of_sender[s] = routed.src_unit[d, pos]
  return units_of_sender


def build_tables(
  group: int, routed: RoutedGroup, rounds: Sequence[Round], options: PlanOptions
) -> tuple[tuple[SendOp, ...], tuple[SendTable, ...], OutOp, OutTable]:
  """Send ops and tables of group `group` for every round, and its output op and table.

  `options` are resolved (see make_plan): `stable` means row gathers throughout, so that the
  ops never depend on the permutation; `land` and the local cap: see `_out_op`."""
  n, dst_units_per_device = routed.src_dev.shape
  caps = [r.caps[group] for r in rounds]
  per_pair = n if options.collective == 'all_to_all' else 1
  sizes = [routed.src_units, *(per_pair * c for c in caps)]
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
  pool_idx = np.full((n, dst_units_per_device), -1, np.int64)  # where each unit lands in the pool
  region_of = np.full((n, dst_units_per_device), -1, np.int64)  # 0: local; k + 1: round k
  for d in range(n):
    mine = routed.src_dev[d] == d
    pool_idx[d, mine] = routed.src_unit[d, mine]
    region_of[d, mine] = 0
  send_ops, send_tables = [], []
  for k, (rnd, cap) in enumerate(zip(rounds, caps)):
    if not cap:
      op, table = SendOp('none'), None
    elif options.collective == 'all_to_all':
      op = SendOp('gather')
      table = _all_to_all_table(routed, cap, int(offsets[k + 1]), pool_idx, region_of, k)
    else:
      units = _ppermute_units(routed, rnd, cap, int(offsets[k + 1]), pool_idx, region_of, k)
      op, table = _send_op(units, cap, n, routed.src_units, options.stable)
    send_ops.append(op)
    send_tables.append(table)
  if (pool_idx < 0).any():
    raise AssertionError('dispatch plan left target units unrouted')
  out_op, out_table = _out_op(pool_idx, region_of, offsets, sizes, options, group)
  return tuple(send_ops), tuple(send_tables), out_op, out_table
