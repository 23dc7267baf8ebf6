"""Landing buffers: XLA:CPU only. Kernels that write their outputs into recycled memory.

XLA:CPU allocates every program output afresh, and a fresh block costs a first-touch page fault
and a kernel page clear per 4 KiB before the received bytes land in it, about as much as moving
the block over loopback (docs/results/from-docstrings.md, "Landing buffers and temporaries").
A recycling kernel (`recycling_kernel`, what `collectives.make_kernel(recycle=True)` returns)
therefore takes, for every field whose output is a new buffer (a received region, a slice or a
row gather: `landing_fields`), a donated landing buffer of the output's shape (`output_struct`)
that its output is written into; with `donate` it also hands back the source blocks of those
fields, spent and ready to land the next dispatch (`BufferPool`); a caller may also hand back a
batch it is done with (`Dispatcher.release`), which lands outputs larger than their sources. GPU
and TPU allocators already reuse freed device memory, so only CPU needs this (the dispatcher's
default there).

Temporaries. The received buffers of every round, and the send buffers, are a kernel's
temporary memory, and XLA:CPU allocates it afresh on every call too (above glibc's 32 MiB mmap
ceiling, with the same page faults). A gather output reads all received buffers at once, so all
are live together, and XLA:CPU's scheduler hoists every independent collective up front anyway
(it schedules for concurrency; `optimization_barrier` does not survive its pipeline). Plans made
for a landing kernel (`PlanOptions(land=True)`, when the rounds receive at least
`LAND_MIN_BYTES` per device) therefore write each round's buffer into the landing buffer as it
arrives ('scatter'), and each round's sends read their indices plus a zero computed from the
last writes (`after`), a data dependency XLA keeps: the kernel then holds about one round's
buffers instead of every round's.
"""

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from earl_jax.dispatch.layout import Layout
from earl_jax.dispatch.plan import OutOp, Plan

# The unsigned integer type of each item size (bitcasts that keep every bit).
WORD_TYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def after(arrays: Sequence[jax.Array]) -> Int[Array, '']:
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
      bits = jax.lax.bitcast_convert_type(bits, WORD_TYPES[np.dtype(bits.dtype).itemsize])
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
  sharding = NamedSharding(src.mesh, P(tuple(src.mesh.axis_names)))
  return jax.ShapeDtypeStruct(shape, f.dtype, sharding=sharding)


PerDevice = Callable[[list[Any], Sequence[Any], Mapping[int, Any] | None], list[Any]]


def recycling_kernel(
  per_device: PerDevice,
  plan: Plan,
  src: Layout,
  *,
  num_tables: int,
  donate: bool,
  shared: Mapping[int, int] | None = None,
) -> Callable[..., Any]:
  """The jitted kernel of `per_device` (collectives.make_kernel's interpreter of `plan`) that
  lands its outputs in donated buffers.

  The returned function takes (leaves, tables, landing) and returns (outputs, spent): `landing`
  holds one donated buffer per `landing_fields(plan)` (shaped as `output_struct`), which those
  outputs are written into; `spent` holds, with `donate`, those fields' source blocks, unchanged
  and aliased (no copy), for the caller to recycle; without `donate`, nothing. Donated buffers
  are listed in the order of the outputs they become (jit pairs each output with the first
  donated buffer of its shape), so every output lands in its own buffer. `shared` maps a field
  whose source is the same buffer as an earlier field's (e.g. reference log-probs that are the
  policy's) to that field: the buffer is passed, donated and spent once. `per_device(leaves,
  tables, bases)` writes a 'scatter' output into `bases[field]`; `num_tables` is the number of
  device tables it takes.
  """
  mesh = src.mesh
  axes = tuple(mesh.axis_names)
  n_fields = len(src.fields)
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
    [P(axes)] * num_tables,
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

  def landing_buffers(self, structs: Sequence[jax.ShapeDtypeStruct]) -> tuple[list[jax.Array], int]:
    """`landing` of every struct, and the bytes that came from the pool in all."""
    buffers, recycled = [], 0
    for struct in structs:
      buf, reused = self.landing(struct)
      buffers.append(buf)
      recycled += reused
    return buffers, recycled
