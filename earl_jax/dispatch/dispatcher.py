"""The Data Dispatcher: move an RL batch from one stage layout to another, five ways.

  dispatcher = Dispatcher(DispatchConfig(strategy='auto'))
  batch_t, report = dispatcher.dispatch(batch, dst=train_layout, perm=perm)   # src from the batch

Strategies (`Strategy`, or per call with `strategy=`):
  layout_aware    the plan's shard_map kernels (earl_jax.dispatch.collectives): local slices
                  where a block is already on its device, ppermute rounds (or one all_to_all)
                  where it is not, the row permutation applied inside the same collectives, then
                  a zero-copy re-wrap onto the target sharding (only the re-wrap, no kernel,
                  when every target block already is a source block on its device). Device to
                  device; no host. Donating on CPU, the outputs land in the source blocks spent
                  by earlier dispatches or in batches the caller released (`release`;
                  `DispatchConfig.recycle_buffers`), a large move's rounds written into them as they
                  arrive.
  xla             `jax.jit` with `out_shardings`: device-side, XLA's own choice of collectives.
                  A permutation is applied in the same program: a rotation of the rows as
                  `jnp.roll` (XLA lowers it to collective-permutes, its best case), any other as
                  `jnp.take` (XLA lowers it to an all-gather of the batch). For comparison.
  gather_scatter  the single-controller baseline (the paper's, `dispatch.controller`): every
                  worker sends its blocks to one controller process, which holds the whole
                  batch in its host memory, permutes the rows there and sends every worker its
                  target blocks: N-1 transfers in, N-1 out, all through the controller's links.
  allgather       a host all-gather (no controller): every process `process_allgather`s each
                  field to host (in column chunks of at most `gather_chunk_bytes`, each a local
                  slice of every source shard, so host and device memory stay bounded),
                  permutes rows on the host and builds only its own target shards with
                  explicit per-device `device_put`s. In one process, `device_get` replaces the
                  allgather. Every process receives the whole batch.
  auto            no-op when the layouts are the same sharding and there is no permutation; a
                  zero-copy re-wrap when every target block is exactly a source block on the same
                  device; otherwise layout_aware (which is a purely local slice when every target
                  block is already local, e.g. a replicated rollout layout).

`jax.device_put` between shardings over the same devices is never used as a device path: in
this JAX version it gathers through the host (jax-notes §2).

Caching: plans without a permutation are cached with their device tables; kernels are cached by
the plan's static structure (`Plan.structure()`), so a new balancing permutation with the same
capacity buckets reuses the compiled kernel (`Dispatcher.traces` counts kernel traces).
Multi-process: every process calls `dispatch` with the same arguments (the permutation must be
identical everywhere, e.g. computed from lengths every process knows); plans are computed locally
and identically.
"""

import collections
import dataclasses
import enum
import hashlib
import time
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax.caching import LRUCache
from earl_jax.dispatch import collectives
from earl_jax.dispatch import controller as controller_lib
from earl_jax.dispatch.accounting import DispatchReport, hlo_received_bytes
from earl_jax.dispatch.layout import Layout, check_compatible
from earl_jax.dispatch.plan import (
  DEFAULT_PACK_MAX_BYTES,
  Plan,
  check_permutation,
  make_plan,
  stable_floor,
)
from earl_jax.errors import ConfigError

# Permuted plans are cached by the permutation's digest (a step that re-dispatches with the same
# permutation, e.g. several fields or a retry, reuses it); only a few are kept.
_PERMUTED_PLANS_KEPT = 4
# Kernels, xla programs and gather slices kept per dispatcher (least recently used go first).
_PROGRAMS_KEPT = 64


class Strategy(enum.Enum):
  """How a dispatch moves the data (see the module docstring)."""

  AUTO = 'auto'
  LAYOUT_AWARE = 'layout_aware'
  XLA = 'xla'
  GATHER_SCATTER = 'gather_scatter'
  ALLGATHER = 'allgather'


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchConfig:
  """Dispatcher settings.

  Attributes:
    strategy: the default strategy (a Strategy or its value string).
    collective: 'ppermute' rounds (fastest measured with gloo on CPU) or one 'all_to_all'.
    buckets_per_octave: capacity buckets per power of two for permuted dispatches; fewer buckets
      mean fewer compiles and more padding (at most 1/buckets_per_octave).
    pack_max_bytes: rounds whose buffer is at most this many bytes per device carry all their
      fields in one collective (latency-bound: fewer collectives); larger rounds send one
      collective per field and skip the packing copies (bandwidth-bound).
    gather_chunk_bytes: the largest global chunk the allgather strategy gathers at once.
    donate: donate the source batch to the layout_aware / xla programs.
    timed: block until the result is ready and report the wall time.
    recycle_buffers: land layout_aware outputs in the spent source blocks of earlier dispatches
      (needs `donate`; `collectives.BufferPool`, at most two batches held) instead of fresh
      allocations. None (default): on when donating on CPU, where every fresh output costs a
      page fault and a page clear per 4 KiB (XLA:CPU has no caching allocator); off on GPU and
      TPU, whose allocators already reuse device memory.
    stable_kernels: layout_aware with a permutation that changes every call (token balancing
      in a training loop): the ring shifts with a power-of-two capacity each, which only grow
      for the same (layouts, shapes) (`make_plan(stable=True, floor=...)`), so the loop's
      permutations settle on one kernel; more padding on the wire, no compile per step.
  """

  strategy: Strategy | str = Strategy.AUTO
  collective: Literal['ppermute', 'all_to_all'] = 'ppermute'
  buckets_per_octave: int = 4
  pack_max_bytes: int = DEFAULT_PACK_MAX_BYTES
  gather_chunk_bytes: int = 64 << 20
  donate: bool = False
  timed: bool = False
  recycle_buffers: bool | None = None
  stable_kernels: bool = False

  def __post_init__(self):
    try:
      object.__setattr__(self, 'strategy', Strategy(self.strategy))
    except ValueError:
      raise ConfigError(
        f'DispatchConfig.strategy must be one of {[s.value for s in Strategy]}, got '
        f'{self.strategy!r}.'
      ) from None
    if self.collective not in ('ppermute', 'all_to_all'):
      raise ConfigError(
        f"DispatchConfig.collective must be 'ppermute' or 'all_to_all', got {self.collective!r}."
      )
    if not isinstance(self.buckets_per_octave, int) or self.buckets_per_octave < 1:
      raise ConfigError(
        f'DispatchConfig.buckets_per_octave must be a positive int, got {self.buckets_per_octave}.'
      )
    if not isinstance(self.pack_max_bytes, int) or self.pack_max_bytes < 0:
      raise ConfigError(
        f'DispatchConfig.pack_max_bytes must be a non-negative int, got {self.pack_max_bytes}.'
      )
    if self.recycle_buffers and not self.donate:
      raise ConfigError(
        'DispatchConfig.recycle_buffers=True needs donate=True (the buffers it recycles are the '
        'donated source blocks).'
      )
    if not isinstance(self.gather_chunk_bytes, int) or self.gather_chunk_bytes < 1:
      raise ConfigError(
        f'DispatchConfig.gather_chunk_bytes must be a positive int, got {self.gather_chunk_bytes}.'
      )


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


def _shared(leaves: Sequence[jax.Array]) -> tuple[tuple[int, int], ...]:
  """(field, earlier field) for every field whose buffers are an earlier field's."""
  first: dict[tuple, int] = {}
  out = []
  for i, x in enumerate(leaves):
    shard = x.addressable_shards[0].data
    at = (shard.device, shard.unsafe_buffer_pointer(), x.shape, x.dtype, x.sharding)
    j = first.setdefault(at, i)
    if j != i:
      out.append((i, j))
  return tuple(out)


def _fetch(x: jax.Array) -> np.ndarray:
  """The whole array on this host: process_allgather across processes, device_get in one."""
  if jax.process_count() > 1:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


class Dispatcher:
  """Moves batches between layouts; holds the plan and kernel caches (see module docstring)."""

  def __init__(self, config: DispatchConfig | None = None):
    self.config = config or DispatchConfig()
    self._plans: collections.OrderedDict[tuple, tuple[Plan, list[jax.Array]]] = (
      collections.OrderedDict()
    )
    # Compiled programs, bounded and owned by this dispatcher (the caller keeps one per run).
    self._kernels: LRUCache[tuple, Any] = LRUCache(_PROGRAMS_KEPT)
    self._xla: LRUCache[tuple, Any] = LRUCache(_PROGRAMS_KEPT)
    self._slices: LRUCache[tuple, Any] = LRUCache(_PROGRAMS_KEPT)
    self.traces = 0
    # Stable kernels: the caps per ring shift so far, per (layouts, shapes, dtypes).
    self._floors: dict[tuple, dict[int, tuple[int, ...]]] = {}
    self._pool = collectives.BufferPool()
    self.controller = controller_lib.Controller(max_programs=_PROGRAMS_KEPT)

  # --------------------------------------------------------------------------- planning

  def plan(
    self,
    batch: Any,
    src: Layout,
    dst: Layout,
    *,
    perm: np.ndarray | Sequence[int] | None = None,
  ) -> Plan:
    """The routing plan for a batch (arrays or ShapeDtypeStructs)."""
    leaves = src.check(batch)
    return self._plan(leaves, src, dst, perm)[0]

  def _plan(
    self, leaves: Sequence[Any], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> tuple[Plan, list[jax.Array], float]:
    shapes = tuple(tuple(x.shape) for x in leaves)
    dtypes = tuple(np.dtype(x.dtype) for x in leaves)
    t0 = time.perf_counter()
    digest = None if perm is None else hashlib.blake2b(perm.tobytes(), digest_size=16).digest()
    key = (src.key(), dst.key(), shapes, tuple(d.str for d in dtypes), digest)
    hit = self._plans.get(key)
    if hit is not None:
      self._plans.move_to_end(key)
      return hit[0], hit[1], time.perf_counter() - t0
    # Stable kernels: caps per ring shift only grow for the same layouts and shapes, so the
    # permutations of a training loop settle on one kernel (every process keeps the same floor:
    # they plan the same dispatches in the same order).
    floor_key = key[:-1] if self.config.stable_kernels and perm is not None else None
    plan = make_plan(
      src,
      dst,
      shapes,
      dtypes,
      perm=perm,
      collective=self.config.collective,
      buckets_per_octave=self.config.buckets_per_octave,
      pack_max_bytes=self.config.pack_max_bytes,
      stable=self.config.stable_kernels,
      floor=self._floors.get(floor_key),
      land=self.recycles(src),
    )
    if floor_key is not None:
      self._floors[floor_key] = stable_floor(plan)
    tables = collectives.device_tables(collectives.plan_tables(plan), src.mesh)
    plan_s = time.perf_counter() - t0
    self._plans[key] = (plan, tables)
    # Keep every layout-only plan; keep only the few most recent permuted ones.
    permuted = [k for k in self._plans if k[-1] is not None]
    for k in permuted[: max(0, len(permuted) - _PERMUTED_PLANS_KEPT)]:
      del self._plans[k]
    return plan, tables, plan_s

  def recycles(self, src: Layout) -> bool:
    """Whether layout_aware dispatches from `src` land in recycled buffers (see the config)."""
    return self._recycles_on(src.mesh.devices.flat)

  def _recycles_on(self, devices) -> bool:
    if self.config.recycle_buffers is not None:
      return self.config.recycle_buffers
    return self.config.donate and all(d.platform == 'cpu' for d in devices)

  def release(self, batch: Any) -> int:
    """Hands back a batch the caller is done with (e.g. a step's train batch after its update),
    so that later recycling dispatches land their outputs in its device buffers.

    Only when recycling (`DispatchConfig.recycle_buffers`): otherwise a no-op. A spent source
    block lands only outputs of its own shape, and a dispatch whose target blocks are larger
    than its source blocks (e.g. a sequence split merged) would otherwise land every output in
    fresh memory. The buffers are donated to a later kernel, so neither the batch nor any array
    sharing its buffers may be used afterwards (JAX raises if one is: the array is deleted).
    Deleted arrays are skipped. The pool holds at most two released or spent batches.

    Returns:
      The bytes the pool took (0 when not recycling).
    """
    leaves = [x for x in jax.tree.leaves(batch) if isinstance(x, jax.Array) and not x.is_deleted()]
    if not leaves or not self._recycles_on(d for x in leaves for d in x.devices()):
      return 0
    return self._pool.add(leaves)

  def _kernel(
    self, plan: Plan, src: Layout, recycle: bool, shared: tuple[tuple[int, int], ...] = ()
  ) -> tuple[Any, list[jax.ShapeDtypeStruct], bool]:
    """The kernel, its landing buffers' shapes (recycling only) and whether it is new."""
    key = (plan.structure(), src.key(), self.config.donate, recycle, shared)
    hit = self._kernels.get(key)
    if hit is not None:
      return *hit, False

    def count_trace():
      self.traces += 1

    kernel = collectives.make_kernel(
      plan,
      src,
      donate=self.config.donate,
      recycle=recycle,
      shared=dict(shared),
      on_trace=count_trace,
    )
    structs = (
      [collectives.output_struct(plan, src, i) for i in collectives.landing_fields(plan)]
      if recycle
      else []
    )
    self._kernels.put(key, (kernel, structs))
    return kernel, structs, True

  def _run_kernel(
    self, plan: Plan, src: Layout, leaves: Sequence[Any], tables: list[jax.Array]
  ) -> tuple[list[jax.Array], bool, int]:
    """The layout_aware kernel's raw outputs, whether it was new, and the recycled bytes."""
    recycle = self.recycles(src)
    if not recycle:
      kernel, _, compiled = self._kernel(plan, src, False)
      return kernel(list(leaves), tables), compiled, 0
    kernel, structs, compiled = self._kernel(plan, src, True, _shared(leaves))
    landing, recycled = [], 0
    for struct in structs:
      buf, reused = self._pool.landing(struct)
      landing.append(buf)
      recycled += reused
    raw, spent = kernel(list(leaves), tables, landing)
    self._pool.add(spent)
    return raw, compiled, recycled

  # --------------------------------------------------------------------------- dispatch

  def dispatch(
    self,
    batch: Any,
    dst: Layout,
    *,
    src: Layout | None = None,
    perm: np.ndarray | Sequence[int] | None = None,
    strategy: Strategy | str | None = None,
    account: bool = True,
  ) -> tuple[Any, DispatchReport]:
    """Moves `batch` onto the layout `dst`.

    Args:
      batch: a pytree of jax.Arrays placed on `src` (rows leading, see layout.py).
      dst: the target layout.
      src: the source layout; defaults to the batch's own shardings (`Layout.of(batch)`).
      perm: optional int [B], identical on every process: target row i is source row perm[i]
        (e.g. from `balance.balanced_permutation`). Applied inside the same collectives.
      strategy: overrides the config's strategy for this call.
      account: compute the plan's byte counts for the report even when the strategy does not
        need a plan (xla, gather_scatter, allgather); that time is excluded from wall_s.

    Returns:
      (the batch on `dst`, a DispatchReport).

    Raises:
      LayoutError: the batch does not match the layouts, the layouts are over different
        devices or device orders, dtypes differ, rows do not divide, or perm is not a
        permutation.
    """
    t_start = time.perf_counter()
    requested = Strategy(strategy) if strategy is not None else self.config.strategy
    assert isinstance(requested, Strategy)
    src = Layout.of(batch) if src is None else src
    leaves = src.check(batch, placed=True, what='source batch')
    check_compatible(src, dst)
    dst.check(batch, what='batch (target layout)')
    shapes = [tuple(x.shape) for x in leaves]
    p = None if perm is None else check_permutation(perm, shapes[0][0])
    if p is not None and np.array_equal(p, np.arange(len(p))):
      p = None

    plan = tables = None
    plan_s = accounting_s = 0.0
    run = requested
    if requested == Strategy.AUTO:
      if p is None and all(src.sharding(i) == dst.sharding(i) for i in range(len(leaves))):
        return batch, self._report('noop', requested)
      plan, tables, plan_s = self._plan(leaves, src, dst, p)
      if plan.is_zero_copy:
        run = 'rewrap'
      else:
        run = Strategy.LAYOUT_AWARE
    elif requested == Strategy.LAYOUT_AWARE:
      plan, tables, plan_s = self._plan(leaves, src, dst, p)
    elif account:
      plan, tables, accounting_s = self._plan(leaves, src, dst, p)

    compiled, recycled = False, 0
    if run == 'rewrap':
      outs = [collectives.rewrap(x, shapes[i], dst.sharding(i)) for i, x in enumerate(leaves)]
      name = 'rewrap'
    elif run == Strategy.LAYOUT_AWARE and plan is not None and plan.is_zero_copy:
      # Every target block already is a source block on its device: the local slice is free.
      outs = [collectives.rewrap(x, shapes[i], dst.sharding(i)) for i, x in enumerate(leaves)]
      name = Strategy.LAYOUT_AWARE.value
    elif run == Strategy.LAYOUT_AWARE:
      assert plan is not None and tables is not None
      raw, compiled, recycled = self._run_kernel(plan, src, leaves, tables)
      outs = [collectives.rewrap(o, shapes[i], dst.sharding(i)) for i, o in enumerate(raw)]
      name = Strategy.LAYOUT_AWARE.value
    elif run == Strategy.XLA:
      outs, compiled = self._run_xla(leaves, src, dst, p)
      name = Strategy.XLA.value
    elif run == Strategy.GATHER_SCATTER:
      outs = [self.controller.move(x, dst.sharding(i), p) for i, x in enumerate(leaves)]
      name = Strategy.GATHER_SCATTER.value
    else:
      outs = self._run_allgather(leaves, src, dst, p)
      name = Strategy.ALLGATHER.value
    wall = None
    if self.config.timed:
      jax.block_until_ready(outs)
      wall = time.perf_counter() - t_start - accounting_s
    result = jax.tree.unflatten(dst.treedef, outs)
    return result, self._report(name, requested, plan, wall, plan_s, compiled, recycled)

  def _report(
    self,
    name: str,
    requested: Strategy,
    plan: Plan | None = None,
    wall: float | None = None,
    plan_s: float = 0.0,
    compiled: bool = False,
    recycled: int = 0,
  ) -> DispatchReport:
    if plan is None:
      return DispatchReport(
        strategy=name, requested=requested.value, wall_s=wall, compiled=compiled
      )
    layout_aware = name == Strategy.LAYOUT_AWARE.value
    acc = plan.accounting
    return DispatchReport(
      strategy=name,
      requested=requested.value,
      wall_s=wall,
      plan_s=plan_s,
      compiled=compiled,
      min_bytes=acc['min_bytes'],
      bytes_sent=acc['bytes_sent'],
      bytes_received=acc['bytes_received'],
      scheduled_sent=acc['scheduled_sent'] if layout_aware else None,
      scheduled_received=acc['scheduled_received'] if layout_aware else None,
      num_collectives=plan.num_collectives if layout_aware else 0,
      recycled_bytes=recycled,
    )

  # --------------------------------------------------------------------------- xla

  def _xla_fn(
    self, leaves: Sequence[Any], src: Layout, dst: Layout, permuted: bool | int
  ) -> tuple[Any, bool]:
    """The xla program; `permuted` is False, True (a gather) or the shift of a rotation."""
    key = (
      src.key(),
      dst.key(),
      tuple((tuple(x.shape), np.dtype(x.dtype).str) for x in leaves),
      permuted,
      self.config.donate,
    )
    fn = self._xla.get(key)
    if fn is None:
      out_shardings = [dst.sharding(i) for i in range(len(leaves))]
      donate = (0,) if self.config.donate else ()
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
      self._xla.put(key, fn)
      return fn, True
    return fn, False

  def _run_xla(
    self, leaves: Sequence[Any], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> tuple[list[jax.Array], bool]:
    shift = None if perm is None else rotation_shift(perm)
    if perm is None or shift is not None:
      fn, new = self._xla_fn(leaves, src, dst, False if perm is None else shift)
      return fn(list(leaves)), new
    fn, new = self._xla_fn(leaves, src, dst, True)
    return fn(list(leaves), _replicated(perm.astype(np.int32), src.mesh)), new

  # --------------------------------------------------------------------------- allgather

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
    chunk = self.config.gather_chunk_bytes
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

  def _run_allgather(
    self, leaves: Sequence[Any], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> list[jax.Array]:
    return [
      self._allgather_field(x, src.sharding(i), dst.sharding(i), perm) for i, x in enumerate(leaves)
    ]

  # --------------------------------------------------------------------------- inspection

  def compiled_text(
    self,
    batch: Any,
    dst: Layout,
    *,
    src: Layout | None = None,
    perm: np.ndarray | Sequence[int] | None = None,
    strategy: Strategy | str = Strategy.LAYOUT_AWARE,
  ) -> str:
    """Compiled HLO text of the device program a dispatch runs (layout_aware or xla)."""
    strategy = Strategy(strategy)
    src = Layout.of(batch) if src is None else src
    leaves = src.check(batch, placed=True, what='source batch')
    check_compatible(src, dst)
    p = None if perm is None else check_permutation(perm, leaves[0].shape[0])
    if strategy == Strategy.XLA:
      shift = None if p is None else rotation_shift(p)
      if p is None or shift is not None:
        fn, _ = self._xla_fn(leaves, src, dst, False if p is None else shift)
        return fn.lower(list(leaves)).compile().as_text()
      fn, _ = self._xla_fn(leaves, src, dst, True)
      return fn.lower(list(leaves), _replicated(p.astype(np.int32), src.mesh)).compile().as_text()
    if strategy != Strategy.LAYOUT_AWARE:
      raise ValueError(f'compiled_text: no device program for strategy {strategy.value!r}.')
    plan, tables, _ = self._plan(leaves, src, dst, p)
    if not self.recycles(src):
      kernel, _, _ = self._kernel(plan, src, False)
      return kernel.lower(list(leaves), tables).compile().as_text()
    kernel, structs, _ = self._kernel(plan, src, True, _shared(leaves))
    return kernel.lower(list(leaves), tables, structs).compile().as_text()

  def hlo_received_bytes(self, batch: Any, dst: Layout, **kwargs: Any) -> np.ndarray:
    """[n] bytes each device receives in the compiled program (see accounting.py)."""
    src = kwargs.get('src') or Layout.of(batch)
    return hlo_received_bytes(self.compiled_text(batch, dst, **kwargs), src.num_devices)
