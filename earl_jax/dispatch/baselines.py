"""The baselines the Data Dispatcher is measured against (Fig. 4), behind one interface.

Every baseline moves a batch's fields from the source layout to the target one, rows permuted
by an optional `perm` (target row i is source row perm[i]):

  outs, compiled = baseline.move(leaves, src, dst, perm)

  xla             `XlaBaseline`: `jax.jit` with `out_shardings`, device-side, XLA's own choice of
                  collectives. A permutation is applied in the same program: a rotation of the
                  rows as `jnp.roll` (XLA lowers it to collective-permutes, its best case), any
                  other as `jnp.take` (XLA lowers it to an all-gather of the batch).
  allgather       `AllgatherBaseline`: a host all-gather (no controller): every process
                  `process_allgather`s each field to host (in column chunks of at most
                  `gather_chunk_bytes`, each a local slice of every source shard, so host and
                  device memory stay bounded), permutes rows on the host and builds only its own
                  target shards with explicit per-device `device_put`s. In one process,
                  `device_get` replaces the allgather. Every process receives the whole batch.
  gather_scatter  `Controller`: the single-controller baseline, what a single-controller RL
                  system (verl, ROLL, OpenRLHF on Ray) does between two stages and what the
                  paper's Fig. 4 baseline measures: the workers send their rows of the batch to
                  the controller, which holds the whole batch in its host memory, permutes the
                  rows there, and sends every worker the rows its next stage needs. N-1 transfers
                  go in and N-1 go out, and every one of them crosses the controller's links.

The controller's transport: JAX collectives between a worker's device and the controller's
device (gloo over TCP on CPU, NCCL on GPU), one point-to-point `ppermute` per block (all issued
before the controller reads the first, as a driver pulls its workers' objects), staged through
the controller's host memory (`device_get` on arrival, `device_put` before sending). These are
the same links the layout-aware dispatcher uses, so what the comparison measures is the path:
each byte crosses the controller's link twice, one transfer at a time, and is copied through its
host. (The other transport every process has, the coordination service's gRPC key-value store,
is much slower than the collectives (docs/results/from-docstrings.md, "The single controller's
key-value store"): a weaker stand-in for Ray's object
transfer, so it is not used.)

Per-transfer shapes of the controller (one 1-D mesh 'd' over the same devices, in the layout's
device order):
  gather   in  [n * b_src, ...] sharded P('d'): the owner's source block, zeros elsewhere
           out [n * b_src, ...]: the block on the controller's device
  scatter  in  [n * b_dst, ...]: the target block on the controller's device, zeros elsewhere
           out [n * b_dst, ...]: the block on its target device
where b_src / b_dst are the rows of a source / target block (the other dimensions are those of
the block too). A block replicated on several devices is sent once, by the first of them.
"""

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax.caching import LRUCache
from earl_jax.dispatch.layout import Layout


class Baseline(Protocol):
  """A strategy the dispatcher is compared with."""

  def move(
    self, leaves: Sequence[jax.Array], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> tuple[list[jax.Array], bool]:
    """The fields (placed on `src`, in layout order) on `dst`, rows permuted by `perm`, and
    whether a program was compiled for the call."""
    ...


def rotation_shift(perm: np.ndarray) -> int | None:
  """s when perm[i] == (i + s) % B for every row (a rotation), else None."""
  rows = len(perm)
  if rows == 0:
    return None
  shift = int(perm[0]) % rows
  return shift if np.array_equal(perm, (np.arange(rows) + shift) % rows) else None


def _replicated(value: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host array replicated on every device of `mesh` (explicit per-device transfers)."""
  sharding = NamedSharding(mesh, P())
  arrays = [
    jax.device_put(value, d) for d in mesh.devices.flat if d.process_index == jax.process_index()
  ]
  return jax.make_array_from_single_device_arrays(value.shape, sharding, arrays)


def _replicated(value: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host array replicated on every device of `mesh` (explicit per-device transfers)."""
  sharding = NamedSharding(mesh, P())
  arrays = [
    jax.device_put(value, d) for d in mesh.devices.flat if d.process_index == jax.process_index()
  ]
  return jax.make_array_from_single_device_arrays(value.shape, sharding, arrays)


def _fetch(x: jax.Array) -> np.ndarray:
  """The whole array on this host: process_allgather across processes, device_get in one."""
  if jax.process_count() > 1:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


# --------------------------------------------------------------------------- xla


class XlaBaseline:
  """xla: `jax.jit` with `out_shardings` (see the module docstring); programs are cached."""

  def __init__(self, donate: bool, max_programs: int = 64):
    self.donate = donate
    self._programs: LRUCache[tuple, Any] = LRUCache(max_programs)

  def program(
    self, leaves: Sequence[Any], src: Layout, dst: Layout, permuted: bool | int
  ) -> tuple[Any, bool]:
    """The xla program; `permuted` is False, True (a gather) or the shift of a rotation."""
    key = (
      src.key(),
      dst.key(),
      tuple((tuple(x.shape), np.dtype(x.dtype).str) for x in leaves),
      permuted,
      self.donate,
    )
    fn = self._programs.get(key)
    if fn is None:
      out_shardings = [dst.sharding(i) for i in range(len(leaves))]
      donate = (0,) if self.donate else ()
      if isinstance(permuted, int) and not isinstance(permuted, bool):
        shift = permuted  # a rotation: XLA lowers jnp.roll of a sharded dim to collective-permutes
        fn = jax.jit(
          lambda xs: [jnp.roll(x, -shift, axis=0) for x in xs],
          out_shardings=out_shardings,
          donate_argnums=donate,
        )
      elif permuted:
        fn = jax.jit(
          lambda xs, p: [jnp.take(x, p, axis=0) for x in xs],
          out_shardings=out_shardings,
          donate_argnums=donate,
        )
      else:
        fn = jax.jit(lambda xs: list(xs), out_shardings=out_shardings, donate_argnums=donate)
      self._programs.put(key, fn)
      return fn, True
    return fn, False

  def _call(
    self, leaves: Sequence[Any], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> tuple[Any, tuple, bool]:
    """The program for this call, its arguments and whether it is new."""
    shift = None if perm is None else rotation_shift(perm)
    if perm is None or shift is not None:
      fn, new = self.program(leaves, src, dst, False if perm is None else shift)
      return fn, (list(leaves),), new
    fn, new = self.program(leaves, src, dst, True)
    return fn, (list(leaves), _replicated(perm.astype(np.int32), src.mesh)), new

  def move(
    self, leaves: Sequence[jax.Array], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> tuple[list[jax.Array], bool]:
    fn, args, new = self._call(leaves, src, dst, perm)
    return fn(*args), new

  def compiled_text(
    self, leaves: Sequence[jax.Array], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> str:
    """Compiled HLO text of the program `move` runs."""
    fn, args, _ = self._call(leaves, src, dst, perm)
    return fn.lower(*args).compile().as_text()


# --------------------------------------------------------------------------- allgather


class AllgatherBaseline:
  """allgather: every process gathers each field on its host (see the module docstring)."""

  def __init__(self, gather_chunk_bytes: int, max_programs: int = 64):
    self.gather_chunk_bytes = gather_chunk_bytes
    self._slices: LRUCache[tuple, Any] = LRUCache(max_programs)

  def _column_chunk(self, x: jax.Array, shards: int, start: int, width: int) -> jax.Array:
    """Columns [start, start + width) of every one of the `shards` column shards of x, as a
    [B, shards * width, ...] array sharded like x (a local slice on every device)."""
    key = (tuple(x.shape), np.dtype(x.dtype).str, x.sharding, shards, start, width)
    fn = self._slices.get(key)
    if fn is None:
      rows, cols, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])

      def chunk(a):
        a = a.reshape(rows, shards, cols // shards, *rest)
        a = jax.lax.slice_in_dim(a, start, start + width, axis=2)
        return a.reshape(rows, shards * width, *rest)

      fn = jax.jit(chunk, out_shardings=x.sharding)
      self._slices.put(key, fn)
    return fn(x)

  def _allgather_field(
    self, x: jax.Array, src_sharding: NamedSharding, dst_sharding: NamedSharding, perm: Any
  ) -> jax.Array:
    shape = tuple(x.shape)
    targets = dst_sharding.addressable_devices_indices_map(shape)
    chunk = self.gather_chunk_bytes
    if x.ndim < 2 or x.nbytes <= chunk:
      host = _fetch(x)
      arrays = []
      for d, idx in targets.items():
        if perm is not None:  # only this device's rows are permuted, not the whole batch
          r0, r1, _ = idx[0].indices(shape[0])
          idx = (perm[r0:r1], *idx[1:])
        arrays.append(jax.device_put(np.ascontiguousarray(host[idx]), d))
      return jax.make_array_from_single_device_arrays(shape, dst_sharding, arrays)
    # Column chunks: each process gathers [B, shards * w, ...] at a time (w columns of each of
    # the source's column shards, so the chunk is a local slice everywhere) and keeps only its
    # own target blocks; host and device memory stay bounded by `gather_chunk_bytes`.
    cols = shape[1]
    shard_cols = src_sharding.shard_shape(shape)[1]
    shards = cols // shard_cols
    width = max(1, min(shard_cols, chunk // max(1, x.nbytes // cols) // shards))
    blocks: dict[tuple, np.ndarray] = {}
    key_of = {}
    for d, idx in targets.items():
      key = tuple(s.indices(n) for s, n in zip(idx, shape))
      key_of[d] = key
      if key not in blocks:
        blocks[key] = np.empty([stop - start for start, stop, _ in key], x.dtype)
    for c0 in range(0, shard_cols, width):
      w = min(width, shard_cols - c0)
      host = _fetch(self._column_chunk(x, shards, c0, w))  # [B, shards * w, ...]
      for key, block in blocks.items():
        (r0, r1, _), (b0, b1, _) = key[0], key[1]
        rows = slice(r0, r1) if perm is None else perm[r0:r1]
        for s in range(shards):
          g0 = s * shard_cols + c0  # global column of host[:, s * w]
          lo, hi = max(b0, g0), min(b1, g0 + w)
          if lo < hi:
            block[:, lo - b0 : hi - b0] = host[rows, s * w + lo - g0 : s * w + hi - g0]
      del host
    arrays = [jax.device_put(blocks[key_of[d]], d) for d in targets]
    return jax.make_array_from_single_device_arrays(shape, dst_sharding, arrays)

  def move(
    self, leaves: Sequence[jax.Array], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> tuple[list[jax.Array], bool]:
    outs = [
      self._allgather_field(x, src.sharding(i), dst.sharding(i), perm) for i, x in enumerate(leaves)
    ]
    return outs, False


# --------------------------------------------------------------------------- gather_scatter


_AXIS = 'd'


def _key(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _slices(key: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in key)


def controller_device(devices: Sequence[jax.Device], process: int = 0) -> jax.Device:
  """The controller's device: the first of `devices` on process `process`."""
  for d in devices:
    if d.process_index == process:
      return d
  raise ValueError(f'no device of process {process} among {len(devices)} devices.')


def _owners(sharding: NamedSharding, shape: tuple[int, ...]) -> dict[tuple, jax.Device]:
  """Every distinct block of `sharding` and the device that sends it: the first holder in mesh
  order (a block replicated on several devices is sent once)."""
  index = sharding.devices_indices_map(shape)
  owners: dict[tuple, jax.Device] = {}
  for d in sharding.mesh.devices.flat:
    owners.setdefault(_key(index[d], shape), d)
  return owners


def link_bytes(
  shape: Sequence[int], dtype: Any, src: NamedSharding, dst: NamedSharding, process: int = 0
) -> dict[str, int]:
  """Bytes that cross the controller process's links for one field: the unique source blocks
  held by other processes (in) and the target blocks of other processes' devices (out)."""
  shape = tuple(shape)
  item = np.dtype(dtype).itemsize
  owners = _owners(src, shape)
  size = lambda key: item * int(np.prod([b - a for a, b in key], dtype=np.int64))  # noqa: E731
  bytes_in = sum(size(k) for k, d in owners.items() if d.process_index != process)
  bytes_out = sum(
    size(_key(idx, shape))
    for d, idx in dst.devices_indices_map(shape).items()
    if d.process_index != process
  )
  return {'in': int(bytes_in), 'out': int(bytes_out)}


class Controller:
  """gather_scatter: moves fields through one controller process (see the module docstring).

  Every process calls `move` with the same arguments (SPMD: every process takes part in every
  point-to-point collective, with zeros where it sends nothing).
  """

  def __init__(self, process: int = 0, max_programs: int = 64):
    self.process = process
    self._programs: LRUCache[tuple, Any] = LRUCache(max_programs)
    self._zeros: LRUCache[tuple, jax.Array] = LRUCache(4 * max_programs)
    self.transfers = 0  # point-to-point collectives issued (in + out)

  def _zeros_on(self, block: tuple[int, ...], dtype: np.dtype, device: jax.Device) -> jax.Array:
    key = (block, dtype.str, device.id)
    z = self._zeros.get(key)
    if z is None:
      z = jax.device_put(np.zeros(block, dtype), device)
      self._zeros.put(key, z)
    return z

  def _send(
    self,
    mesh: Mesh,
    block: tuple[int, ...],
    dtype: np.dtype,
    data: jax.Array | None,
    src: int,
    dst: int,
  ) -> jax.Array | None:
    """One point-to-point move of a `block` from mesh device `src` to `dst` (linear indices);
    `data` is the block on `src` when this process holds it. Returns the block on `dst` when
    this process holds `dst`, else None."""
    devices = list(mesh.devices.flat)
    n = len(devices)
    key = (tuple(d.id for d in devices), block, dtype.str, src, dst)
    fn = self._programs.get(key)
    if fn is None:
      spec = P(_AXIS)
      fn = jax.jit(
        jax.shard_map(
          lambda x: jax.lax.ppermute(x, _AXIS, [(src, dst)]),
          mesh=mesh,
          in_specs=spec,
          out_specs=spec,
        )
      )
      self._programs.put(key, fn)
    me = jax.process_index()
    local = [
      data if i == src else self._zeros_on(block, dtype, d)
      for i, d in enumerate(devices)
      if d.process_index == me
    ]
    sharding = NamedSharding(mesh, P(_AXIS))
    x = jax.make_array_from_single_device_arrays((n * block[0], *block[1:]), sharding, local)
    out = fn(x)
    self.transfers += 1
    if devices[dst].process_index != me:
      return None
    return next(s.data for s in out.addressable_shards if s.device == devices[dst])

  def move(
    self, leaves: Sequence[jax.Array], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> tuple[list[jax.Array], bool]:
    """Every field through the controller (see `Baseline.move`); nothing is compiled."""
    del src  # each field's own sharding is its source
    return [self.move_field(x, dst.sharding(i), perm) for i, x in enumerate(leaves)], False

  def move_field(
    self, x: jax.Array, dst: NamedSharding, perm: np.ndarray | None = None
  ) -> jax.Array:
    """`x` (placed on its source sharding) on `dst`, rows permuted by `perm` (target row i is
    source row perm[i]), through the controller."""
    src = x.sharding
    assert isinstance(src, NamedSharding)
    shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    devices = list(src.mesh.devices.flat)
    if [d.id for d in dst.mesh.devices.flat] != [d.id for d in devices]:
      raise ValueError('the controller baseline moves between layouts over the same devices.')
    mesh = Mesh(np.array(devices), (_AXIS,))
    index_of = {d: i for i, d in enumerate(devices)}
    ctrl = controller_device(devices, self.process)
    me = jax.process_index()
    is_ctrl = me == self.process
    shards = {s.device: s.data for s in x.addressable_shards}

    # Gather: the controller assembles the whole field in its host memory.
    host = np.empty(shape, dtype) if is_ctrl else None
    owners = _owners(src, shape)
    src_block = tuple(src.shard_shape(shape))
    arrived = []  # every transfer is issued before the controller reads any (JAX is async)
    for key, owner in owners.items():
      if owner.process_index == self.process:
        arrived.append((key, shards.get(owner)))
        continue
      got = self._send(mesh, src_block, dtype, shards.get(owner), index_of[owner], index_of[ctrl])
      arrived.append((key, got))
    if is_ctrl:
      for key, got in arrived:
        host[_slices(key)] = np.asarray(got)

    # Scatter: every target block from the controller's host, rows permuted there.
    dst_block = tuple(dst.shard_shape(shape))
    targets = dst.devices_indices_map(shape)
    arrays = []
    for d in devices:
      idx = targets[d]
      block = None
      if is_ctrl:
        rows = idx[0] if perm is None else perm[idx[0]]
        block = np.ascontiguousarray(host[(rows, *idx[1:])])
      if d.process_index == self.process:
        if is_ctrl:
          arrays.append(jax.device_put(block, d))
        continue
      data = jax.device_put(block, ctrl) if is_ctrl else None
      got = self._send(mesh, dst_block, dtype, data, index_of[ctrl], index_of[d])
      if got is not None:
        arrays.append(got)
    return jax.make_array_from_single_device_arrays(shape, dst, arrays)
