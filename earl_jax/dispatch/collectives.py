"""`jax.shard_map` kernels that carry out a dispatch plan, and the zero-copy re-wrap.

A kernel runs over the SOURCE mesh. Collectives name every mesh axis at once, so a device is
addressed by its linear index in mesh order (the plan's device index). On each device it leaves
exactly that device's block of the target layout; `rewrap` then presents those buffers as arrays
with the target sharding (`jax.make_array_from_single_device_arrays`: no copy, and it works on
the addressable shards of a multi-process array). Nothing goes through the host: the only host
data are the plan's small int32 tables, placed explicitly with `jax.device_put`.

Per-shard shapes for one field of a group (n devices, U = the group's unit shape, e.g. [] for
[B] fields, [T] for unsplit [B, T] fields, [g] for sequence-split ones):

  field in : [b_src, t_src, ...]           the device's source block
  units    : [src_units, *U]               free reshape (unit-major)
  round k  : send [cap_k, *U]              whole block / dynamic_slice / row gather
             recv [cap_k, *U]              lax.ppermute over all mesh axes (pairs of the round)
             or, with all_to_all, send [n * cap, *U] -> recv [n * cap, *U] (chunk j to device j)
             packed rounds: the fields of every group with the same item size -> unsigned
             words [sum of elements] (all_to_all: [n, words per peer]), one collective per
             item size, then sliced and bitcast back
  pool     : [local units | recv 0 | recv 1 | ...]
  output   : [dst_units, *U]               one whole region / dynamic_slice / row gather, or
             (update) the local units with [updates, *U] rows of the pool scattered into their
             slots: in place when the source is donated, so units that stay are not copied
             (scatter, plans made with `land`) a landing buffer [dst_units, *U] written region
             by region: the local units in pieces of at most a round's cap, then each round's
             [cap_k, *U] received buffer into its slots as soon as it arrives (landing.py)
  field out: [b_dst, t_dst, ...]           free reshape

Ragged sends are padded to the round's static `cap`; the receiver's table only ever points at
real rows, so padding is never read (the validity mask is implicit in the tables). The pool is
never materialised: XLA fuses the concatenation into the output gather (one loop fusion reading
the local block and the received buffers, checked in compiled HLO), so each unit is copied once.
`check_vma` stays on: replicated inputs (e.g. rows replicated over 'tensor') are invariant over
some axes, and every collective names all axes, which JAX accepts by marking them varying.

Kernels of unpacked plans are differentiable (the gradient is the reverse move, tested against a
dense reference); a packed round bitcasts its fields to shared words, which has no gradient. The
dispatcher moves data between stages, never inside a differentiated step.

Compiled kernels depend only on the plan's static structure (`Plan.structure()`: shapes, caps,
op kinds) and the source layout; tables are arguments. Callers cache the jitted kernel by that
key, so a new permutation with the same capacity buckets does not retrace. On XLA:CPU the
dispatcher uses the recycling kernels of landing.py (`make_kernel(recycle=True)`).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int, Shaped, UInt

from earl_jax.dispatch import landing
from earl_jax.dispatch.landing import WORD_TYPES
from earl_jax.dispatch.layout import Layout
from earl_jax.dispatch.plan import GroupPlan, Plan, Round


def all_axes(mesh: Mesh) -> tuple[str, ...]:
  """Every axis of the mesh, in mesh order: collectives over them use linear device indices."""
  return tuple(mesh.axis_names)


def take_rows(
  x: Shaped[Array, ' units *U'], idx: Int[Array, ' picks']
) -> Shaped[Array, ' picks *U']:
  """Rows `idx` of `x`. Indices are valid by construction (plan tables), so no bounds code."""
  return x.at[idx].get(mode='promise_in_bounds')


def group_tables(group: GroupPlan) -> list[np.ndarray]:
  """The group's host tables, in the order the kernel takes them (each [n, ...] int32)."""
  out = [t for t in group.send_tables if t is not None]
  if group.out_table is not None:
    out.append(group.out_table)
  return out


def plan_tables(plan: Plan) -> list[np.ndarray]:
  return [t for g in plan.groups for t in group_tables(g)]


def device_tables(tables: Sequence[np.ndarray], mesh: Mesh) -> list[jax.Array]:
  """Places host tables [n, ...] with row k on device k (explicit, per addressable device)."""
  sharding = NamedSharding(mesh, P(all_axes(mesh)))
  devices = list(mesh.devices.flat)
  out = []
  for table in tables:
    arrays = [
      jax.device_put(table[k : k + 1], d)
      for k, d in enumerate(devices)
      if d.process_index == jax.process_index()
    ]
    out.append(jax.make_array_from_single_device_arrays(table.shape, sharding, arrays))
  return out


def to_words(x: Shaped[Array, '...'], lead: int) -> UInt[Array, 'lead words']:
  """[lead, ...] -> unsigned words of the same width, [lead, elements] (bit-exact, free: a
  same-width bitcast; bool becomes uint8 0/1)."""
  if x.dtype == jnp.bool_:
    w = x.astype(jnp.uint8)
  else:
    w = jax.lax.bitcast_convert_type(x, WORD_TYPES[np.dtype(x.dtype).itemsize])
  return w.reshape(lead, -1)


def from_words(
  w: UInt[Array, 'lead words'], dtype: np.dtype, shape: tuple[int, ...]
) -> Shaped[Array, '...']:
  """Inverse of `to_words`."""
  if dtype == np.dtype(bool):
    return w.reshape(shape) != 0
  return jax.lax.bitcast_convert_type(w.reshape(shape), dtype)


def pack_classes(dtypes: Sequence[np.dtype]) -> list[list[int]]:
  """Indices of the buffers a packed round concatenates together: one class per item size."""
  classes: dict[int, list[int]] = {}
  for i, dtype in enumerate(dtypes):
    classes.setdefault(np.dtype(dtype).itemsize, []).append(i)
  return [classes[k] for k in sorted(classes, reverse=True)]


def _exchange(
  bufs: Sequence[jax.Array], rnd: Round, collective: str, axes: tuple[str, ...], n: int
) -> list[jax.Array]:
  """One round: per-field buffers [cap, *U] (all_to_all: [n * cap, *U]) -> received buffers.

  Packed: buffers of the same item size are bitcast to unsigned words of that size (free) and
  concatenated, so the round is one collective per item size present (ppermute: [words];
  all_to_all: [n, words per peer]). Converting everything to bytes instead would be a single
  collective, but on XLA:CPU a bitcast to uint8 (a new minor dimension) costs more than the
  transfer it saves (docs/results/tried.md, "The collective, and packing rounds into bytes").
  """

  def move(x):
    if collective == 'all_to_all':
      return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)
    return jax.lax.ppermute(x, axes, list(rnd.pairs))

  if not rnd.packed:
    return [move(b) for b in bufs]
  lead = n if collective == 'all_to_all' else 1
  out: list[Any] = [None] * len(bufs)
  for members in pack_classes([b.dtype for b in bufs]):
    parts = [to_words(bufs[i], lead) for i in members]
    received = move(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1))
    start = 0
    for i, part in zip(members, parts):
      width = part.shape[1]
      piece = jax.lax.slice_in_dim(received, start, start + width, axis=1)
      out[i] = from_words(piece, np.dtype(bufs[i].dtype), bufs[i].shape)
      start += width
  return out


def _split_tables(plan: Plan, tables: Sequence[Any]) -> tuple[list[list[Any]], list[Any]]:
  """Each group's per-round send indices (None where the op needs none) and output indices, from
  the device's rows of the tables (in `group_tables` order)."""
  rows = iter([t[0] for t in tables])
  send_idx, out_idx = [], []
  for g in plan.groups:
    send_idx.append([next(rows) if op.kind in ('slice', 'gather') else None for op in g.send_ops])
    out_idx.append(next(rows) if g.out_op.kind != 'full' else None)
  return send_idx, out_idx


class _Scatters:
  """The 'scatter' outputs of one device (plans made with `land`): each landing buffer (zeros
  without one), its slots (`table[0]`) and how many of them are written so far."""

  def __init__(self):
    self.landed: dict[int, Any] = {}
    self.slots: dict[int, Any] = {}
    self.cursor: dict[int, int] = {}

  def start(
    self, plan: Plan, units: dict[int, Any], out_idx: list[Any], bases: Mapping[int, Any] | None
  ) -> None:
    """Writes the local units of every 'scatter' field into its landing buffer, in pieces of at
    most a round's buffer, each after the last, so the local copy's temporary memory is no
    larger than a round's (one piece when nothing is received)."""
    per_round = plan.num_devices if plan.collective == 'all_to_all' else 1
    for gi, g in enumerate(plan.groups):
      if g.out_op.kind != 'scatter':
        continue
      table, width = out_idx[gi], g.out_op.updates
      piece = max([rnd.caps[gi] * per_round for rnd in plan.rounds] + [0]) or max(width, 1)
      for f in g.fields:
        base = (bases or {}).get(f.index)
        if base is None:
          y = jnp.zeros((g.dst_units, *f.unit_shape), f.dtype)
        else:
          y = base.reshape(g.dst_units, *f.unit_shape)
        for start in range(0, width, piece):
          take = table[1, start : start + piece]
          if start:
            take = take + landing.after([y])
          local = take_rows(units[f.index], take)
          y = y.at[table[0, start : start + piece]].set(local, mode='drop', indices_are_sorted=True)
        self.landed[f.index], self.slots[f.index], self.cursor[f.index] = y, table[0], width

  def after_writes(self) -> Int[Array, ''] | None:
    """A zero that depends on every write so far (`landing.after`); None without scatters."""
    return landing.after(list(self.landed.values())) if self.landed else None

  def write(self, i: int, received: jax.Array) -> bool:
    """Writes a round's received buffer of field i into its slots; False if i is no scatter."""
    if i not in self.landed:
      return False
    at = self.slots[i][self.cursor[i] : self.cursor[i] + received.shape[0]]
    self.landed[i] = self.landed[i].at[at].set(received, mode='drop', indices_are_sorted=True)
    self.cursor[i] += received.shape[0]
    return True


def _send_buffers(
  plan: Plan,
  r: int,
  units: dict[int, Any],
  send_idx: list[list[Any]],
  regions: dict[int, list[Any]],
  after: Any,
) -> tuple[list[int], list[Any]]:
  """Round r's send buffers: (field indices, buffers); fields that send nothing get a None
  region. `after` (or None) is added to the indices to order the round after earlier writes."""
  rnd = plan.rounds[r]
  sent, bufs = [], []
  for gi, g in enumerate(plan.groups):
    op, cap, idx = g.send_ops[r], rnd.caps[gi], send_idx[gi][r]
    if after is not None and idx is not None:
      idx = idx + after
    for f in g.fields:
      x = units[f.index]
      if op.kind == 'none':
        regions[f.index].append(None)
        continue
      if op.kind == 'full':
        buf = x
      elif op.kind == 'slice':
        buf = jax.lax.dynamic_slice_in_dim(x, idx, cap, axis=0)
      else:
        buf = take_rows(x, idx)
      sent.append(f.index)
      bufs.append(buf)
  return sent, bufs


def _output(group: GroupPlan, parts: list[Any], idx: Any) -> Any:
  """One field's output units [dst_units, *U] read from its pool regions (not 'scatter')."""
  op = group.out_op
  if op.kind == 'full':
    return parts[op.region]
  if op.kind == 'slice':
    return jax.lax.dynamic_slice_in_dim(parts[op.region], idx, group.dst_units, axis=0)
  # 'update' from region 1: the pool of received buffers only (the local block is written, not
  # read, so a donated block is updated in place).
  skip = 1 if op.kind == 'update' and op.region == 1 else 0
  present = [p for p in parts[skip:] if p is not None]
  pool = present[0] if len(present) == 1 else jnp.concatenate(present, axis=0)
  if op.kind == 'update':  # idx [2, updates]: slots, then their pool indices
    return parts[0].at[idx[0]].set(take_rows(pool, idx[1]), mode='drop')
  return take_rows(pool, idx)


def _per_device_fn(
  plan: Plan, axes: tuple[str, ...], num_fields: int, on_trace: Callable[[], None] | None
) -> landing.PerDevice:
  """The kernel body on one device: (leaves, tables, bases=None) -> outputs, one per field
  ([dst block]); `bases` are landing buffers for 'scatter' outputs (landing.py)."""

  def per_device(leaves, tables, bases=None):
    if on_trace is not None:
      on_trace()
    send_idx, out_idx = _split_tables(plan, tables)
    units = {
      f.index: leaves[f.index].reshape(g.src_units, *f.unit_shape)
      for g in plan.groups
      for f in g.fields
    }
    regions: dict[int, list[Any]] = {i: [u] for i, u in units.items()}
    scatters = _Scatters()
    scatters.start(plan, units, out_idx, bases)
    for r, rnd in enumerate(plan.rounds):
      sent, bufs = _send_buffers(plan, r, units, send_idx, regions, scatters.after_writes())
      for i, y in zip(sent, _exchange(bufs, rnd, plan.collective, axes, plan.num_devices)):
        if not scatters.write(i, y):
          regions[i].append(y)
    outs: list[Any] = [None] * num_fields
    for gi, g in enumerate(plan.groups):
      for f in g.fields:
        if g.out_op.kind == 'scatter':
          y = scatters.landed[f.index]
        else:
          y = _output(g, regions[f.index], out_idx[gi])
        outs[f.index] = y.reshape(f.dst_block)
    return outs

  return per_device


def make_kernel(
  plan: Plan,
  src: Layout,
  *,
  donate: bool = False,
  recycle: bool = False,
  shared: Mapping[int, int] | None = None,
  on_trace: Callable[[], None] | None = None,
) -> Callable[..., Any]:
  """The jitted dispatch kernel of a plan's structure.

  The returned function takes (leaves, tables): the batch's source fields in layout order and
  the plan's device tables (`device_tables(plan_tables(plan), mesh)`), and returns one array per
  field of global shape [n * b_dst, t_dst, ...] sharded over all axes of the source mesh on
  dimension 0, whose shard on device k is device k's target block. `rewrap` turns those into
  arrays with the target sharding. With `donate` the source fields are consumed.

  With `recycle` (XLA:CPU) it is `landing.recycling_kernel`: it takes (leaves, tables, landing)
  and returns (outputs, spent), the outputs written into the donated `landing` buffers; `shared`
  (recycling only) names fields whose source buffer is an earlier field's.

  Per-shard shapes: see the module docstring. Depends only on `plan.structure()` and `src`.
  `on_trace` is called each time the kernel is traced (tests count retraces with it).
  """
  mesh = src.mesh
  axes = all_axes(mesh)
  num_fields = len(src.fields)
  num_tables = sum(len(group_tables(g)) for g in plan.groups)
  per_device = _per_device_fn(plan, axes, num_fields, on_trace)
  if recycle:
    return landing.recycling_kernel(
      per_device, plan, src, num_tables=num_tables, donate=donate, shared=shared
    )
  in_specs = ([f.spec for f in src.fields], [P(axes)] * num_tables)
  out_specs = [P(axes)] * num_fields
  mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  return jax.jit(mapped, donate_argnums=(0,) if donate else ())


def rewrap(
  out: Shaped[Array, ' nB *rest'], shape: tuple[int, ...], sharding: NamedSharding
) -> Shaped[Array, '...']:
  """Zero-copy: the kernel output whose shard on device k is device k's target block, as an
  array of global `shape` with the target `sharding`."""
  return jax.make_array_from_single_device_arrays(
    shape, sharding, [s.data for s in out.addressable_shards]
  )
