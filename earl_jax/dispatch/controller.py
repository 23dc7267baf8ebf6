"""The single-controller baseline: every block to one controller process, then out from it.

This is what a single-controller RL system (verl, ROLL, OpenRLHF on Ray) does between two stages
and what the paper's Fig. 4 baseline measures: the workers send their rows of the batch to the
controller, which holds the whole batch in its host memory, permutes the rows there, and sends
every worker the rows its next stage needs. N-1 transfers go in and N-1 go out, and every one of
them crosses the controller's links.

Transport: JAX collectives between a worker's device and the controller's device (gloo over TCP
on CPU, NCCL on GPU), one point-to-point `ppermute` per block (all issued before the controller
reads the first, as a driver pulls its workers' objects), staged through the controller's host
memory (`device_get` on arrival, `device_put` before sending). These are the same links the
layout-aware dispatcher uses, so what the comparison measures is the path: each byte crosses the
controller's link twice, one transfer at a time, and is copied through its host. (The other
transport every process has, the coordination service's gRPC key-value store, moved 40 MB/s on
loopback here, about ten times slower than the collectives: a weaker stand-in for Ray's object
transfer, so it is not used.)

Per-transfer shapes (one 1-D mesh 'd' over the same devices, in the layout's device order):
  gather   in  [n * b_src, ...] sharded P('d'): the owner's source block, zeros elsewhere
           out [n * b_src, ...]: the block on the controller's device
  scatter  in  [n * b_dst, ...]: the target block on the controller's device, zeros elsewhere
           out [n * b_dst, ...]: the block on its target device
where b_src / b_dst are the rows of a source / target block (the other dimensions are those of
the block too). A block replicated on several devices is sent once, by the first of them.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax.caching import LRUCache

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
  """Moves fields through one controller process (see the module docstring).

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

  def move(self, x: jax.Array, dst: NamedSharding, perm: np.ndarray | None = None) -> jax.Array:
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
