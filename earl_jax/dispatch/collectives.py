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
             [cap_k, *U] received buffer into its slots as soon as it arrives
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

Landing buffers (`make_kernel(recycle=True)`). XLA:CPU allocates every program output afresh, and
a fresh block costs a first-touch page fault and a kernel page clear per 4 KiB before the
received bytes land in it: measured, 8 processes rotating 46 MiB each over gloo took 190-250 ms
into fresh outputs and 78 ms into reused ones, against 75 ms for raw sockets. A recycling kernel
therefore takes, for every field whose output is a new buffer (a received region, a slice or a
row gather), a donated landing buffer of the output's shape that its output is written into; with
`donate` it also hands back the source blocks of those fields, spent and ready to land the next
dispatch (`BufferPool`); a caller may also hand back a batch it is done with
(`Dispatcher.release`), which lands outputs larger than their sources. GPU and TPU allocators
already reuse freed device memory, so only CPU needs this (the dispatcher's default).

Temporaries. The received buffers of every round, and the send buffers, are a kernel's
temporary memory, and XLA:CPU allocates it afresh on every call too (above glibc's 32 MiB mmap
ceiling, with the same page faults). A gather output reads all received buffers at once, so all
are live together, and XLA:CPU's scheduler hoists every independent collective up front anyway
(it schedules for concurrency; `optimization_barrier` does not survive its pipeline). Plans made
for a landing kernel (`make_plan(land=True)`, when the rounds receive at least
`plan.LAND_MIN_BYTES` per device) therefore write each round's buffer into the landing buffer as
it arrives ('scatter'), and each round's sends read their indices plus a zero
computed from the last writes (`_after`), a data dependency XLA keeps: the kernel then holds
about one round's buffers (measured at 8K: 14 instead of 56 MiB per device for 7 rounds of
random rows, which moved 204 -> 166 ms).
"""

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int, Shaped, UInt

from earl_jax.dispatch.layout import Layout
from earl_jax.dispatch.plan import GroupPlan, OutOp, Plan, Round


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


def _after(arrays: Sequence[jax.Array]) -> Int[Array, '']:
  """An int32 zero that XLA cannot prove zero, computed from one element of each array.

  Adding it to a round's send indices makes the round's sends wait for those arrays (the
  outputs written with the previous round's buffers). XLA:CPU schedules for concurrency and
  hoists every collective of independent rounds up front, which keeps all received buffers
  live at once (`optimization_barrier` does not survive its pipeline); with this data
  dependency each round's buffers are dead before the next round's exist, so the kernel's
  temporary memory is about one round. The zero is the population count of the element's bits
  shifted past its largest possible value (at most 64 bits are set)."""
  zero = jnp.zeros((), jnp.int32)
  for a in arrays:
    v = a.reshape(-1)[0]
    bits = v.astype(jnp.uint8) if v.dtype == jnp.bool_ else v
    if not jnp.issubdtype(bits.dtype, jnp.unsignedinteger):
      bits = jax.lax.bitcast_convert_type(bits, _WORDS[np.dtype(bits.dtype).itemsize])
    zero = zero + (jax.lax.population_count(bits) >> 7).astype(jnp.int32)
  return zero


def _lands(op: OutOp) -> bool:
  """Whether a field's output is a new buffer (not its local block, kept or updated)."""
  return op.kind != 'update' and not (op.kind == 'full' and op.region == 0)


def landing_fields(plan: Plan) -> list[int]:
  """Indices of the fields whose kernel output is a new buffer: a recycling kernel lands them."""
  return sorted(f.index for g in plan.groups if _lands(g.out_op) for f in g.fields)


def output_struct(plan: Plan, src: Layout, index: int) -> jax.ShapeDtypeStruct:
  """The kernel's raw output for field `index`: [n * b_dst, ...] over all source-mesh axes."""
  f = next(f for g in plan.groups for f in g.fields if f.index == index)
  shape = (plan.num_devices * f.dst_block[0], *f.dst_block[1:])
  sharding = NamedSharding(src.mesh, P(all_axes(src.mesh)))
  return jax.ShapeDtypeStruct(shape, f.dtype, sharding=sharding)


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

  With `recycle` it takes (leaves, tables, landing) and returns (outputs, spent): `landing` holds
  one donated buffer per `landing_fields(plan)` (shaped as `output_struct`), which those outputs
  are written into; `spent` holds, with `donate`, those fields' source blocks, unchanged and
  aliased (no copy), for the caller to recycle; without `donate`, nothing. Donated buffers are
  listed in the order of the outputs they become (jit pairs each output with the first donated
  buffer of its shape), so every output lands in its own buffer. `shared` (recycling only) maps
  a field whose source is the same buffer as an earlier field's (e.g. reference log-probs that
  are the policy's) to that field: the buffer is passed, donated and spent once.

  Per-shard shapes: see the module docstring. Depends only on `plan.structure()` and `src`.
  `on_trace` is called each time the kernel is traced (tests count retraces with it).
  """
  mesh = src.mesh
  axes = all_axes(mesh)
  n = plan.num_devices
  n_fields = len(src.fields)
  n_tables = sum(len(group_tables(g)) for g in plan.groups)

  def per_device(leaves, tables, bases=None):
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
    # 'scatter' outputs: the landing buffer (zeros without one), the local units written first,
    # then each round's received buffer as soon as it arrives (slots in `table[0]`, in order).
    landed: dict[int, Any] = {}
    per_round = n if plan.collective == 'all_to_all' else 1  # received units per cap unit
    slots: dict[int, Any] = {}
    cursor: dict[int, int] = {}
    for gi, g in enumerate(plan.groups):
      if g.out_op.kind != 'scatter':
        continue
      table, width = out_idx[gi], g.out_op.updates
      # The local units in pieces of at most a round's buffer, each after the last, so the local
      # copy's temporary memory is no larger than a round's (one piece when nothing is received).
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
            take = take + _after([y])
          local = take_rows(units[f.index], take)
          y = y.at[table[0, start : start + piece]].set(local, mode='drop', indices_are_sorted=True)
        landed[f.index], slots[f.index], cursor[f.index] = y, table[0], width
    for r, rnd in enumerate(plan.rounds):
      after = _after(list(landed.values())) if landed else None
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
      for i, y in zip(sent, _exchange(bufs, rnd, plan.collective, axes, n)):
        if i in landed:
          at = slots[i][cursor[i] : cursor[i] + y.shape[0]]
          landed[i] = landed[i].at[at].set(y, mode='drop', indices_are_sorted=True)
          cursor[i] += y.shape[0]
        else:
          regions[i].append(y)
    outs: list[Any] = [None] * n_fields
    for gi, g in enumerate(plan.groups):
      op, idx = g.out_op, out_idx[gi]
      for f in g.fields:
        parts = regions[f.index]
        if op.kind == 'scatter':
          y = landed[f.index]
        elif op.kind == 'full':
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

  if not recycle:
    in_specs = ([f.spec for f in src.fields], [P(axes)] * n_tables)
    out_specs = [P(axes)] * n_fields
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(mapped, donate_argnums=(0,) if donate else ())

  repeats = dict(shared or {})
  land = landing_fields(plan)
  keep = [i for i in range(n_fields) if i not in land]
  # Kept / updated fields first: they alias their own source block.
  leaf_order = [i for i in keep + land if i not in repeats]
  out_order = land + keep
  spend = [i for i in land if i not in repeats] if donate else []

  scatter = {f.index for g in plan.groups if g.out_op.kind == 'scatter' for f in g.fields}

  def recycling(landing, ordered, tables):
    # A 'scatter' output is written into its landing buffer; any other output is aliased to
    # its landing buffer's memory (donated, same shape), which it overwrites whole.
    bases = {i: buf for i, buf in zip(land, landing) if i in scatter}
    leaves: list[Any] = [None] * n_fields
    for pos, i in enumerate(leaf_order):
      leaves[i] = ordered[pos]
    for i, j in repeats.items():
      leaves[i] = leaves[j]
    outs = per_device(leaves, tables, bases)
    return [outs[i] for i in out_order], [leaves[i] for i in spend]

  in_specs = (
    [P(axes)] * len(land),
    [src.fields[i].spec for i in leaf_order],
    [P(axes)] * n_tables,
  )
  out_specs = ([P(axes)] * n_fields, [src.fields[i].spec for i in spend])
  mapped = jax.shard_map(recycling, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  jitted = jax.jit(mapped, donate_argnums=(0, 1) if donate else (0,), keep_unused=True)

  def run(leaves, tables, landing):
    outs, spent = jitted(list(landing), [leaves[i] for i in leaf_order], tables)
    ordered: list[Any] = [None] * n_fields
    for pos, i in enumerate(out_order):
      ordered[i] = outs[pos]
    return ordered, spent

  run.lower = lambda leaves, tables, landing: jitted.lower(  # type: ignore[attr-defined]
    list(landing), [leaves[i] for i in leaf_order], tables
  )
  return run


class BufferPool:
  """Spent single-device buffers by (device, shape, dtype), to land later kernel outputs in.

  Holds the spent source blocks of the last `keep_calls` dispatches that added any (older ones
  are dropped, so the pool never holds more than that many batches); `landing` builds a kernel
  output's landing array from them, allocating (zeros) on a device where none fits.
  """

  def __init__(self, keep_calls: int = 2):
    self._calls: collections.deque[dict[tuple, list[jax.Array]]] = collections.deque(
      maxlen=keep_calls
    )

  def add(self, arrays: Sequence[jax.Array]) -> int:
    """Holds the arrays' addressable buffers as one call's; returns their bytes."""
    bucket: dict[tuple, list[jax.Array]] = {}
    seen = set()  # a buffer goes in once, however many arrays hold it
    for a in arrays:
      for shard in a.addressable_shards:
        data = shard.data
        at = (data.device, data.unsafe_buffer_pointer())
        if at not in seen:
          seen.add(at)
          bucket.setdefault((data.device, data.shape, data.dtype), []).append(data)
    if bucket:
      self._calls.append(bucket)
    return sum(a.nbytes for xs in bucket.values() for a in xs)

  @property
  def nbytes(self) -> int:
    """Bytes held on this process's devices."""
    return sum(a.nbytes for bucket in self._calls for xs in bucket.values() for a in xs)

  def _take(self, key: tuple) -> jax.Array | None:
    for bucket in reversed(self._calls):
      if bucket.get(key):
        return bucket[key].pop()
    return None

  def landing(self, struct: jax.ShapeDtypeStruct) -> tuple[jax.Array, int]:
    """An array shaped like `struct` (its sharding's addressable blocks from the pool where it
    has them), and the bytes that came from the pool."""
    sharding = struct.sharding
    block = sharding.shard_shape(struct.shape)
    dtype = np.dtype(struct.dtype)
    arrays, reused = [], 0
    for device in sharding.addressable_devices_indices_map(struct.shape):
      buf = self._take((device, block, dtype))
      if buf is None:
        buf = jnp.zeros(block, dtype, device=device)
      else:
        reused += buf.nbytes
      arrays.append(buf)
    return jax.make_array_from_single_device_arrays(struct.shape, sharding, arrays), reused


def rewrap(
  out: Shaped[Array, ' nB *rest'], shape: tuple[int, ...], sharding: NamedSharding
) -> Shaped[Array, '...']:
  """Zero-copy: the kernel output whose shard on device k is device k's target block, as an
  array of global `shape` with the target `sharding`."""
  return jax.make_array_from_single_device_arrays(
    shape, sharding, [s.data for s in out.addressable_shards]
  )
