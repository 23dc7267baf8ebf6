"""The routing plan of a dispatch: which device sends which blocks to which device.

Pure numpy and Python: a plan is a deterministic function of (source layout, target layout,
field shapes and dtypes, optional row permutation, `PlanOptions`), so every process computes the
same plan without talking to the others, and no payload is ever touched.

  plan = make_plan(src, dst, shapes, dtypes, perm=perm, options=PlanOptions(stable=True))

Vocabulary
  rows       B, dimension 0 of every field.
  perm       optional int array [B]: target row i holds source row perm[i].
  group      fields that route identically: same row blocks and same column blocks in source
             and target. [B] fields and [B, T] fields whose T is split in neither layout share a
             group; sequence-sharded fields form their own.
  unit       the smallest block a group moves: one row, or, when T is split differently in the
             two layouts, one row times a chunk of g columns, where g is the gcd of the source
             and target column block widths (so every unit lies inside one source block and one
             target block). A device's local block is a [units, unit...] array by a free reshape
             ([b, t, ...] -> [b * t/g, g, ...]), unit-major.
  route      for every unit a target device needs, the device that sends it (routing.py).
  round      one collective step shared by all groups, with a static capacity per group
             (schedule.py: `Round`).
  schedule   the rounds that carry every remote unit: exact caps over an edge colouring (no
             permutation), bucketed caps over ring shifts (a permutation), capacities per pair
             that only grow until the caller sheds them (stable: `Plan.floor`), or one
             all_to_all (schedule.py).
  tables     per device int32 index tables the kernels read: what each round sends and where
             each target unit is read from (tables.py: `SendOp`, `OutOp`).

Accounting: `min_bytes` is what must move (every unit a target device lacks, once);
`scheduled_bytes` is what the rounds move including padding. For a static plan with uniform
rounds they are equal; tests check the compiled HLO's collectives against `scheduled_*`.
"""

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from earl_jax.dispatch.layout import Layout
from earl_jax.dispatch.routing import (
  FieldPlan,
  RoutedGroup,
  check_permutation,
  checked_structs,
  group_fields,
  route_group,
)
from earl_jax.dispatch.schedule import (
  COLOURING_GAIN,
  DEFAULT_PACK_MAX_BYTES,
  FIT_SLACK,
  LAND_MIN_BYTES,
  ROUND_COST_BYTES,
  Collective,
  Fit,
  Floor,
  PlanOptions,
  Round,
  capacity_bucket,
  schedule,
  stable_capacities,
)
from earl_jax.dispatch.tables import OutOp, SendOp, build_tables

__all__ = [
  'COLOURING_GAIN',
  'DEFAULT_PACK_MAX_BYTES',
  'FIT_SLACK',
  'LAND_MIN_BYTES',
  'ROUND_COST_BYTES',
  'Collective',
  'FieldPlan',
  'Fit',
  'Floor',
  'GroupPlan',
  'OutOp',
  'Plan',
  'PlanOptions',
  'Round',
  'SendOp',
  'capacity_bucket',
  'check_permutation',
  'make_plan',
]


@dataclasses.dataclass(frozen=True, eq=False)
class GroupPlan:
  """Routing of one group of fields (see the module docstring).

  Attributes:
    fields: the group's fields.
    num_devices: n.
    src_units / dst_units: local units per device in the source / target layout.
    unit_bytes: bytes of one unit summed over the group's fields.
    counts: [n, n] units sent from device s (row) to device d (column); the diagonal counts
      local copies.
    reach: stable plans: bool [n, n], the pairs some permutation routes units over (fixed
      routing, `routing.route`); else None.
    send_ops: one per plan round.
    out_op: how the output is read from the pool.
    send_tables: per plan round, int32 [n, cap] ('gather') or [n] ('slice') or None.
    out_table: int32 [n, dst_units] ('gather'), [n] ('slice'), [n, 2, updates] ('update':
      the slots, then their pool indices; padding slots are dst_units, dropped), [n, 2,
      updates + received units] ('scatter': row 0 the slot of each local unit, then of each
      received unit of every round in pool order; row 1 the local units' indices; padding
      slots are dst_units, dropped) or None.
  """

  fields: tuple[FieldPlan, ...]
  num_devices: int
  src_units: int
  dst_units: int
  unit_bytes: int
  counts: np.ndarray
  send_ops: tuple[SendOp, ...]
  out_op: OutOp
  send_tables: tuple[np.ndarray | None, ...]
  out_table: np.ndarray | None
  reach: np.ndarray | None = None

  def structure(self) -> tuple:
    """The static structure a compiled kernel depends on (tables excluded)."""
    return (
      tuple(
        (f.index, f.shape, f.dtype.str, f.src_block, f.dst_block, f.unit_shape) for f in self.fields
      ),
      self.src_units,
      self.dst_units,
      self.send_ops,
      self.out_op,
    )

  def remote_matrix(self) -> np.ndarray:
    """[n, n] bytes device s must send device d (diagonal zero)."""
    m = self.counts.astype(np.int64) * self.unit_bytes
    np.fill_diagonal(m, 0)
    return m


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """The routing plan of one dispatch (see the module docstring).

  Attributes:
    groups: one GroupPlan per routing group.
    rounds: the schedule, shared by all groups.
    collective: 'ppermute' or 'all_to_all'.
    num_devices: n, the devices of both meshes (same order).
    rows: B.
    static: exact capacities and colouring-based rounds (no permutation), or bucketed
      capacities over fixed ring-shift rounds (a permutation that changes every step; a
      colouring when pair sizes are very uneven).
    floor: a stable plan's capacities (`PlanOptions.stable`): the floor of the next plan for the
      same layouts and shapes, whose permutation then reuses this plan's kernel if it fits;
      None for other plans.
  """

  groups: tuple[GroupPlan, ...]
  rounds: tuple[Round, ...]
  collective: Collective
  num_devices: int
  rows: int
  static: bool
  floor: Floor | None = None

  def round_bytes(self, r: int) -> int:
    """Bytes of round r's buffer per (source, target) pair."""
    return sum(c * g.unit_bytes for c, g in zip(self.rounds[r].caps, self.groups))

  @functools.cached_property
  def min_matrix(self) -> np.ndarray:
    return sum(
      (g.remote_matrix() for g in self.groups), np.zeros((self.num_devices,) * 2, np.int64)
    )

  @functools.cached_property
  def scheduled_matrix(self) -> np.ndarray:
    """[n, n] bytes the schedule moves from s to d, padding included (diagonal zero)."""
    n = self.num_devices
    m = np.zeros((n, n), np.int64)
    for r, rnd in enumerate(self.rounds):
      size = self.round_bytes(r)
      for s, d in rnd.pairs:
        if s != d:
          m[s, d] += size
    return m

  @property
  def min_bytes(self) -> int:
    """Bytes that must move between devices (each unit a target lacks, once)."""
    return int(self.min_matrix.sum())

  @property
  def scheduled_bytes(self) -> int:
    """Bytes the schedule moves, padding included."""
    return int(self.scheduled_matrix.sum())

  @property
  def bytes_sent(self) -> np.ndarray:
    """[n] minimum bytes each device sends."""
    return self.min_matrix.sum(axis=1)

  @property
  def bytes_received(self) -> np.ndarray:
    """[n] minimum bytes each device receives."""
    return self.min_matrix.sum(axis=0)

  @property
  def scheduled_sent(self) -> np.ndarray:
    return self.scheduled_matrix.sum(axis=1)

  @property
  def scheduled_received(self) -> np.ndarray:
    return self.scheduled_matrix.sum(axis=0)

  @property
  def num_collectives(self) -> int:
    """Collectives the kernel issues: per round, one per item size present when packed, else
    one per field sent."""
    total = 0
    for r in self.rounds:
      fields = [f for c, g in zip(r.caps, self.groups) if c for f in g.fields]
      total += len({f.dtype.itemsize for f in fields}) if r.packed else len(fields)
    return total

  @property
  def is_local(self) -> bool:
    """Whether every target block is already on its device (no communication)."""
    return not self.rounds

  @property
  def is_zero_copy(self) -> bool:
    """Whether every target block is exactly a source block on the same device."""
    return not self.rounds and all(
      g.out_op.kind == 'full' and all(f.src_block == f.dst_block for f in g.fields)
      for g in self.groups
    )

  @functools.cached_property
  def _structure(self) -> tuple:
    return (
      self.num_devices,
      self.rows,
      self.collective,
      self.rounds,
      tuple(g.structure() for g in self.groups),
    )

  def structure(self) -> tuple:
    """The static structure compiled kernels depend on (hashable; tables excluded)."""
    return self._structure

  @functools.cached_property
  def accounting(self) -> dict[str, tuple[int, ...] | int]:
    """Byte counts as plain ints (computed once): min_bytes, bytes_sent / bytes_received and
    scheduled_sent / scheduled_received per device."""
    return {
      'min_bytes': self.min_bytes,
      'bytes_sent': tuple(int(b) for b in self.bytes_sent),
      'bytes_received': tuple(int(b) for b in self.bytes_received),
      'scheduled_sent': tuple(int(b) for b in self.scheduled_sent),
      'scheduled_received': tuple(int(b) for b in self.scheduled_received),
    }

  def summary(self) -> dict:
    """A JSON-friendly summary."""
    return {
      'rows': self.rows,
      'num_devices': self.num_devices,
      'static': self.static,
      'collective': self.collective,
      'rounds': [
        {'pairs': len(r.pairs), 'caps': list(r.caps), 'packed': r.packed} for r in self.rounds
      ],
      'num_collectives': self.num_collectives,
      'groups': [
        {
          'fields': [f.path for f in g.fields],
          'unit_bytes': g.unit_bytes,
          'send_ops': [s.kind for s in g.send_ops],
          'out_op': g.out_op.kind,
        }
        for g in self.groups
      ],
      'min_bytes': self.min_bytes,
      'scheduled_bytes': self.scheduled_bytes,
      'bytes_sent': self.bytes_sent.tolist(),
      'bytes_received': self.bytes_received.tolist(),
    }


def _resolve(options: PlanOptions, *, perm_given: bool, permuted: bool) -> PlanOptions:
  """The options a plan is built with: `static` defaults to "no permutation given"; `stable`
  holds only for a bucketed plan that permutes rows, or is given the identity and a floor (it
  then takes the floor's kernel). `land` is resolved once the schedule is known (make_plan)."""
  static = (not perm_given) if options.static is None else options.static
  floored = perm_given and options.floor is not None
  stable = options.stable and (permuted or floored) and not static
  return dataclasses.replace(
    options, static=static, stable=stable, floor=options.floor if stable else None
  )


def _received_bytes(
  rounds: Sequence[Round], groups: Sequence[RoutedGroup], collective: Collective
) -> int:
  """Bytes the rounds deliver to each device (their capacities, padding included)."""
  per_pair = len(groups[0].counts) if collective == 'all_to_all' else 1
  return sum(c * g.unit_bytes * per_pair for rnd in rounds for c, g in zip(rnd.caps, groups))


def _group_plan(
  index: int, routed: RoutedGroup, rounds: Sequence[Round], options: PlanOptions
) -> GroupPlan:
  send_ops, send_tables, out_op, out_table = build_tables(index, routed, rounds, options)
  return GroupPlan(
    fields=routed.fields,
    num_devices=len(routed.counts),
    src_units=routed.src_units,
    dst_units=routed.dst_units,
    unit_bytes=routed.unit_bytes,
    counts=routed.counts,
    send_ops=send_ops,
    out_op=out_op,
    send_tables=send_tables,
    out_table=out_table,
    reach=routed.reach,
  )


def make_plan(
  src: Layout,
  dst: Layout,
  shapes: Sequence[tuple[int, ...]],
  dtypes: Sequence[np.dtype],
  *,
  perm: np.ndarray | Sequence[int] | None = None,
  options: PlanOptions | None = None,
) -> Plan:
  """Computes the routing plan of moving a batch from `src` to `dst`.

  Args:
    src: the source layout.
    dst: the target layout (same devices, same order, same fields).
    shapes: the global shape of every field, in layout order.
    dtypes: the dtype of every field, in layout order.
    perm: optional int [B]: target row i holds source row perm[i].
    options: how to schedule and build the tables (`PlanOptions`; its defaults when None).

  Returns:
    The Plan.

  Raises:
    LayoutError: incompatible layouts, fields that do not divide, a bad permutation.
  """
  options = PlanOptions() if options is None else options
  structs = checked_structs(src, dst, shapes, dtypes)
  rows = structs[0].shape[0]
  p = None if perm is None else check_permutation(perm, rows)
  if p is not None and np.array_equal(p, np.arange(rows)):
    p = None
  n = src.num_devices
  resolved = _resolve(options, perm_given=perm is not None, permuted=p is not None)
  # Stable plans fitted per pair take each source block from a fixed replica (routing.route).
  stable = resolved.stable and resolved.collective == 'ppermute'
  fixed = stable and resolved.fit == 'pairs'
  routed = [
    route_group(src, key, group, structs, p, fixed)
    for key, group in group_fields(src, dst, structs).items()
  ]
  capacities = stable_capacities(routed, resolved) if stable else None
  rounds = schedule(routed, n, resolved, capacities)
  received = _received_bytes(rounds, routed, resolved.collective)
  # A landing plan scatters only when the rounds carry enough bytes (see PlanOptions.land).
  resolved = dataclasses.replace(
    resolved, land=resolved.land and received >= options.land_min_bytes
  )
  groups = tuple(_group_plan(i, group, rounds, resolved) for i, group in enumerate(routed))
  floor = None
  if capacities is not None:
    local = tuple(g.out_op.updates if g.out_op.kind == 'scatter' else 0 for g in groups)
    floor = Floor(pairs=tuple(capacities), local=local)
  return Plan(
    groups=groups,
    rounds=rounds,
    collective=resolved.collective,
    num_devices=n,
    rows=rows,
    static=bool(resolved.static),
    floor=floor,
  )
