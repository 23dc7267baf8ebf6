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
key, so a new permutation with the same capacity buckets does not retrace.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int, Shaped, UInt

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


_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def to_words(x: Shaped[Array, '...'], lead: int) -> UInt[Array, 'lead words']:
  """[lead, ...] -> unsigned words of the same width, [lead, elements] (bit-exact, free: a
  same-width bitcast; bool becomes uint8 0/1)."""
  if x.dtype == jnp.bool_:
    w = x.astype(jnp.uint8)
  else:
    w = jax.lax.bitcast_convert_type(x, _WORDS[np.dtype(x.dtype).itemsize])
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
  collective, but on XLA:CPU a bitcast to uint8 (a new minor dimension) measured ~5x slower
  than the transfer it saves.
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


def make_kernel(
  plan: Plan,
  src: Layout,
  *,
  donate: bool = False,
  on_trace: Callable[[], None] | None = None,
) -> Callable[..., list[jax.Array]]:
  """The jitted dispatch kernel of a plan's structure.

  The returned function takes (leaves, tables): the batch's source fields in layout order and
  the plan's device tables (`device_tables(plan_tables(plan), mesh)`), and returns one array per
  field of global shape [n * b_dst, t_dst, ...] sharded over all axes of the source mesh on
  dimension 0, whose shard on device k is device k's target block. `rewrap` turns those into
  arrays with the target sharding.

  Per-shard shapes: see the module docstring. Depends only on `plan.structure()` and `src`.
  `on_trace` is called each time the kernel is traced (tests count retraces with it).
  """
  mesh = src.mesh
  axes = all_axes(mesh)
  n = plan.num_devices
  n_fields = len(src.fields)
  n_tables = sum(len(group_tables(g)) for g in plan.groups)

  def per_device(leaves, tables):
    if on_trace is not None:
      on_trace()
    rows = iter([t[0] for t in tables])
    send_idx, out_idx = [], []
    for g in plan.groups:
      send_idx.append([next(rows) if op.kind in ('slice', 'gather') else None for op in g.send_ops])
      out_idx.append(next(rows) if g.out_op.kind != 'full' else None)
    units = {
      f.index: leaves[f.index].reshape(g.src_units, *f.unit_shape)
      for g in plan.groups
      for f in g.fields
    }
    regions: dict[int, list[Any]] = {i: [u] for i, u in units.items()}
    for r, rnd in enumerate(plan.rounds):
      sent, bufs = [], []
      for gi, g in enumerate(plan.groups):
        op, cap, idx = g.send_ops[r], rnd.caps[gi], send_idx[gi][r]
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
      for i, y in zip(sent, _exchange(bufs, rnd, plan.collective, axes, n)):
        regions[i].append(y)
    outs: list[Any] = [None] * n_fields
    for gi, g in enumerate(plan.groups):
      op, idx = g.out_op, out_idx[gi]
      for f in g.fields:
        parts = regions[f.index]
        if op.kind == 'full':
          y = parts[op.region]
        elif op.kind == 'slice':
          y = jax.lax.dynamic_slice_in_dim(parts[op.region], idx, g.dst_units, axis=0)
        else:
          # 'update' from region 1: the pool of received buffers only (the local block is
          # written, not read, so a donated block is updated in place).
          skip = 1 if op.kind == 'update' and op.region == 1 else 0
          present = [p for p in parts[skip:] if p is not None]
          pool = present[0] if len(present) == 1 else jnp.concatenate(present, axis=0)
          if op.kind == 'update':  # idx [2, updates]: slots, then their pool indices
            y = parts[0].at[idx[0]].set(take_rows(pool, idx[1]), mode='drop')
          else:
            y = take_rows(pool, idx)
        outs[f.index] = y.reshape(f.dst_block)
    return outs

  in_specs = ([f.spec for f in src.fields], [P(axes)] * n_tables)
  out_specs = [P(axes)] * n_fields
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
