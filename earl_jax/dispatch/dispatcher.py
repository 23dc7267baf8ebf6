"""The Data Dispatcher: move an RL batch from one stage layout to another.

  dispatcher = Dispatcher(DispatchConfig())       # the main job's settings
  batch_t, report = dispatcher.dispatch(batch, dst=train_layout, perm=perm)   # src from the batch

Strategies (`Strategy`, or per call with `strategy=`):
  layout_aware    the plan's shard_map kernels (earl_jax.dispatch.collectives): local slices
                  where a block is already on its device, ppermute rounds (or one all_to_all)
                  where it is not, the row permutation applied inside the same collectives, then
                  a zero-copy re-wrap onto the target sharding (only the re-wrap, no kernel,
                  when every target block already is a source block on its device). Device to
                  device; no host. Donating on CPU, the outputs land in the source blocks spent
                  by earlier dispatches or in batches the caller released (`release`;
                  `DispatchConfig.recycle_buffers`, landing.py), a large move's rounds written
                  into them as they arrive.
  auto            no-op when the layouts are the same sharding and there is no permutation; a
                  zero-copy re-wrap when every target block is exactly a source block on the same
                  device; otherwise layout_aware (which is a purely local slice when every target
                  block is already local, e.g. a replicated rollout layout).
  xla, gather_scatter, allgather
                  the baselines of Fig. 4 (baselines.py): XLA's own resharding, the paper's
                  single-controller baseline, and a host all-gather. For comparison.

`jax.device_put` between shardings over the same devices is never used as a device path: in
this JAX version it gathers through the host (jax-notes §2).

Caching: plans without a permutation are cached with their device tables; kernels are cached by
the plan's static structure (`Plan.structure()`), so a new balancing permutation with the same
capacity buckets reuses the compiled kernel (`Dispatcher.traces` counts kernel traces).

Stable kernels (`DispatchConfig.stable_kernels`, the main job's): the permuted plans of one
(layouts, shapes) get capacities per (source, target) pair that only grow (`Plan.floor`), so the
loop's permutations settle on a kernel whose capacities fit them all, and a pair that carries
nothing sends nothing. The first plan, and each growth, also provision the pairs a later
permutation may use (`schedule.stable_capacities`) while that keeps the wire within part of the
padding budget, so the kernel settles in one or two compiles.

The bound: padding beyond `max_padding` (1.5) times the bytes that must move does not last.
After `_SHED_AFTER` such moves in a row the floor is rebuilt from their own needs (one compile,
or a kernel still cached), which pad each pair by at most a capacity bucket
(1/buckets_per_octave) and merged rounds by at most `schedule.FIT_SLACK`. Where the layouts
move rows and the balancing a few more (the main job's rollout -> experience moves), every move
after the first few stays within the bound (tests/dispatch/dispatcher_test.py, over random
balanced permutations). Where a few rows move over pairs that change every move, no floor is
tight. Where the layouts alone move nothing (the default's dp4.tp2 or dp2.tp4 -> dp8: only the
balancing's rows move), the moves take capacity classes (`_class_plan`): every pair a
permutation may route units over gets one capacity, the capacity bucket of the move's largest
pair, one kernel per class, so the wire follows each move's own class down as well as up
(tests/dispatch/capacity_classes_test.py). Such a move is not held to `max_padding`: with 2-16
rows of 64 moving over changing pairs, a kernel that serves every move pays for the pairs it
does not use (docs/results/main-job.md, "The demo's first run with the selector's prior"). The
main job's balancing avoids that: its 'ring' permutations send j rows from every rank to the
next, one ring shift, whose class covers the pairs it uses only, so the wire carries exactly the
rows that move. Where the layouts move little, the plans fit per ring shift
(the earlier policy: every pair of a shift sends its one power-of-two capacity) after
`_FLOORS_BEFORE_SETTLING` floors that still left reachable pairs without capacity, and then
neither shed nor compile per move; fit 'shifts' also takes it where the layouts move nothing. An
identity permutation (balancing that moved no row) takes the stable kernel of its (layouts,
shapes) once there is one, instead of compiling its own.

Multi-process: every process calls `dispatch` with the same arguments (the permutation must be
identical everywhere, e.g. computed from lengths every process knows); plans are computed locally
and identically.
"""

import collections
import dataclasses
import enum
import hashlib
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np

from earl_jax.caching import LRUCache
from earl_jax.dispatch import baselines, collectives, landing
from earl_jax.dispatch.accounting import DispatchReport, hlo_received_bytes
from earl_jax.dispatch.balance import ring_rows, target_ranks
from earl_jax.dispatch.baselines import rotation_shift
from earl_jax.dispatch.layout import Layout, check_compatible
from earl_jax.dispatch.plan import (
  DEFAULT_PACK_MAX_BYTES,
  Floor,
  Plan,
  PlanOptions,
  check_permutation,
  make_plan,
)
from earl_jax.dispatch.schedule import pair_needs
from earl_jax.errors import ConfigError

__all__ = ['DispatchConfig', 'Dispatcher', 'Strategy', 'rotation_shift']

# Permuted plans are cached by the permutation's digest (a step that re-dispatches with the same
# permutation, e.g. several fields or a retry, reuses it); only a few are kept.
_PERMUTED_PLANS_KEPT = 4
# Kernels, xla programs and gather slices kept per dispatcher (least recently used go first).
_PROGRAMS_KEPT = 64
# Stable kernels: after this many moves in a row over `max_padding`, the floor is rebuilt from
# what those moves needed (fewer would compile on every dip; more would pay the padding longer).
_SHED_AFTER = 3
# Stable kernels: after this many floors (kernels) for one (layouts, shapes), its floor no longer
# sheds, and if it still leaves pairs that a permutation may use without capacity, its plans fit
# per ring shift (fit 'shifts'): moves too small for a tight stable kernel (a few rows over pairs
# that change every move) settle on a few padded kernels instead of compiling one per move.
_FLOORS_BEFORE_SETTLING = 4


class Strategy(enum.Enum):
  """How a dispatch moves the data (see the module docstring)."""

  AUTO = 'auto'
  LAYOUT_AWARE = 'layout_aware'
  XLA = 'xla'
  GATHER_SCATTER = 'gather_scatter'
  ALLGATHER = 'allgather'


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchConfig:
  """Dispatcher settings; the defaults are the main job's.

  Attributes:
    strategy: the default strategy (a Strategy or its value string).
    collective: 'ppermute' rounds (faster than all_to_all with gloo on CPU,
      docs/results/tried.md) or one 'all_to_all'.
    buckets_per_octave: capacity buckets per power of two for permuted dispatches; fewer buckets
      mean fewer compiles and more padding (at most 1/buckets_per_octave).
    pack_max_bytes: rounds whose buffer is at most this many bytes per device carry all their
      fields in one collective (latency-bound: fewer collectives); larger rounds send one
      collective per field and skip the packing copies (bandwidth-bound).
    gather_chunk_bytes: the largest global chunk the allgather strategy gathers at once.
    donate: donate the source batch to the layout_aware / xla programs (the caller must not use
      it afterwards).
    timed: block until the result is ready and report the wall time.
    recycle_buffers: land layout_aware outputs in the spent source blocks of earlier dispatches
      (needs `donate`; `landing.BufferPool`, at most two batches held) instead of fresh
      allocations. None (default): on when donating on CPU, where every fresh output costs a
      page fault and a page clear per 4 KiB (XLA:CPU has no caching allocator); off on GPU and
      TPU, whose allocators already reuse device memory.
    stable_kernels: layout_aware with a permutation that changes every call (token balancing
      in a training loop): capacities per (source, target) pair that only grow for the same
      (layouts, shapes) (`PlanOptions(stable=True, floor=...)`), so the loop's permutations
      settle on one kernel: some padding on the wire, no compile per step.
    stable_fit: how stable kernels size their rounds (`PlanOptions.fit`): 'pairs' (each pair
      its own capacity bucket) or 'shifts' (one power-of-two capacity per ring shift, sent by
      all of its pairs: the earlier policy, kept for comparison).
    max_padding: stable kernels: the padding bound (see dispatch/dispatcher.py): when more than
      this many times the bytes that must move go on the wire in several moves in a row, the
      capacities are rebuilt from those moves (a compile); growth provisions pairs for later
      moves only within part of it. inf: capacities only grow.
  """

  strategy: Strategy | str = Strategy.LAYOUT_AWARE
  collective: Literal['ppermute', 'all_to_all'] = 'ppermute'
  buckets_per_octave: int = 4
  pack_max_bytes: int = DEFAULT_PACK_MAX_BYTES
  gather_chunk_bytes: int = 64 << 20
  donate: bool = True
  timed: bool = False
  recycle_buffers: bool | None = None
  stable_kernels: bool = True
  stable_fit: Literal['pairs', 'shifts'] = 'pairs'
  max_padding: float = 1.5

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
    if self.stable_fit not in ('pairs', 'shifts'):
      raise ConfigError(
        f"DispatchConfig.stable_fit must be 'pairs' or 'shifts', got {self.stable_fit!r}."
      )
    if (
      isinstance(self.max_padding, bool)
      or not isinstance(self.max_padding, (int, float))
      or math.isnan(self.max_padding)
      or self.max_padding < 1
    ):
      raise ConfigError(
        f'DispatchConfig.max_padding must be a number >= 1 (inf: never shed capacity), got '
        f'{self.max_padding!r}.'
      )
    if not isinstance(self.gather_chunk_bytes, int) or self.gather_chunk_bytes < 1:
      raise ConfigError(
        f'DispatchConfig.gather_chunk_bytes must be a positive int, got {self.gather_chunk_bytes}.'
      )


@dataclasses.dataclass
class _Capacities:
  """The stable capacities of one (layouts, shapes): the last plan's floor, what each of the
  last moves needed alone, how many moves in a row padded more than `max_padding`, how many
  floors were made, whether it no longer sheds, whether its plans now fit per ring shift, and
  whether its moves take capacity classes (the layouts alone move nothing: `_class_plan`)."""

  floor: Floor
  needs: collections.deque[Floor] = dataclasses.field(
    default_factory=lambda: collections.deque(maxlen=_SHED_AFTER)
  )
  over: int = 0
  floors: int = 1
  settled: bool = False
  shifts: bool = False
  classes: bool = False


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


class Dispatcher:
  """Moves batches between layouts; holds the plan and kernel caches (see module docstring)."""

  def __init__(self, config: DispatchConfig | None = None):
    self.config = config or DispatchConfig()
    self._plans: collections.OrderedDict[tuple, tuple[Plan, list[jax.Array]]] = (
      collections.OrderedDict()
    )
    # Compiled programs, bounded and owned by this dispatcher (the caller keeps one per run).
    self._kernels: LRUCache[tuple, Any] = LRUCache(_PROGRAMS_KEPT)
    self.traces = 0
    # Stable kernels: the capacities so far, per (layouts, shapes, dtypes).
    self._capacities: dict[tuple, _Capacities] = {}
    self._pool = landing.BufferPool()
    self.controller = baselines.Controller(max_programs=_PROGRAMS_KEPT)
    self._xla = baselines.XlaBaseline(self.config.donate, max_programs=_PROGRAMS_KEPT)
    self._baselines: dict[Strategy, baselines.Baseline] = {
      Strategy.XLA: self._xla,
      Strategy.GATHER_SCATTER: self.controller,
      Strategy.ALLGATHER: baselines.AllgatherBaseline(
        self.config.gather_chunk_bytes, max_programs=_PROGRAMS_KEPT
      ),
    }

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

  def _plan_options(self, src: Layout, floor: Floor | None, shifts: bool = False) -> PlanOptions:
    return PlanOptions(
      collective=self.config.collective,
      buckets_per_octave=self.config.buckets_per_octave,
      pack_max_bytes=self.config.pack_max_bytes,
      stable=self.config.stable_kernels,
      fit='shifts' if shifts else self.config.stable_fit,
      floor=floor,
      max_padding=self.config.max_padding,
      land=self.recycles(src),
    )

  def _stable_plan(
    self,
    key: tuple,
    src: Layout,
    dst: Layout,
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[np.dtype],
    perm: np.ndarray,
  ) -> Plan:
    """A permuted plan with stable capacities: at least the floor of the last plan for the same
    (layouts, shapes) (so a permutation that fits reuses its kernel), rebuilt from the recent
    moves' own needs after `_SHED_AFTER` moves in a row over `max_padding`, fitted per ring shift
    after `_FLOORS_BEFORE_SETTLING` floors (see the module docstring). Every process keeps the
    same floors: they plan the same dispatches in the same order."""
    state = self._capacities.get(key)
    if state is None:
      # Where the layouts alone move nothing, only the permutation's few rows move, over pairs
      # that change every time: no floor is tight, so such moves take capacity classes (fit
      # 'pairs') or fit per ring shift at once (fit 'shifts').
      local = make_plan(src, dst, shapes, dtypes).is_local
      if local and self.config.stable_fit == 'pairs':
        plan = self._class_plan(src, dst, shapes, dtypes, perm)
        if plan.floor is not None:
          self._capacities[key] = _Capacities(floor=plan.floor, settled=True, classes=True)
        return plan
      shifts = self.config.stable_fit == 'shifts' or local
    elif state.classes:
      plan = self._class_plan(src, dst, shapes, dtypes, perm)
      state.floor = plan.floor or state.floor
      return plan
    else:
      shifts = state.shifts
    options = self._plan_options(src, state and state.floor, shifts)
    plan = make_plan(src, dst, shapes, dtypes, perm=perm, options=options)
    if plan.floor is None:  # not a stable plan (e.g. all_to_all)
      return plan
    if state is None:
      state = _Capacities(floor=plan.floor, settled=shifts, shifts=shifts)
      self._capacities[key] = state
    limits = [min(g.src_units, g.dst_units) for g in plan.groups]
    counts = [g.counts for g in plan.groups]
    need = pair_needs(counts, limits, self.config.stable_fit, self.config.buckets_per_octave)
    state.needs.append(Floor(pairs=tuple(need), local=plan.floor.local))
    padded = plan.scheduled_bytes > self.config.max_padding * plan.min_bytes
    state.over = state.over + 1 if padded and not state.settled else 0
    if state.over >= _SHED_AFTER:
      state.over = 0
      rebuilt = state.needs[0]
      for need_floor in list(state.needs)[1:]:
        rebuilt = rebuilt.merged(need_floor)
      options = self._plan_options(src, rebuilt)
      plan = make_plan(src, dst, shapes, dtypes, perm=perm, options=options)
    assert plan.floor is not None
    if not (plan.floor.fits(state.floor) and state.floor.fits(plan.floor)):
      state.floors += 1
      open_pairs = any(
        g.reach is not None and bool((g.reach & (f == 0)).any())
        for g, f in zip(plan.groups, plan.floor.pairs)
      )
      state.settled = state.settled or state.floors >= _FLOORS_BEFORE_SETTLING
      state.shifts = state.shifts or (state.settled and open_pairs)
    state.floor = plan.floor
    return plan

  def _class_plan(
    self,
    src: Layout,
    dst: Layout,
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[np.dtype],
    perm: np.ndarray,
  ) -> Plan:
    """A permuted plan between layouts that alone move nothing, by capacity class: every pair
    a permutation may route units over (`GroupPlan.reach`) gets the same capacity, the capacity
    bucket of this move's largest pair. One kernel per class, compiled once and kept by the
    kernel cache, so the class follows each move down as well as up: a move pays the reachable
    pairs once at its own class, instead of the largest class any earlier move needed. A ring
    permutation (`balance.ring_rows`: every target rank takes j rows of the previous one) takes
    the class over its own pairs only: the fixed routing gives every ring of j rows the same
    pairs (every pair of one shift on dp8 -> dp8; the two that cross a source block on dp2.tp4
    -> dp8), so one kernel per j, sending exactly what moves."""
    plan = make_plan(src, dst, shapes, dtypes, perm=perm, options=self._plan_options(src, None))
    if plan.floor is None or any(g.reach is None for g in plan.groups):
      return plan
    limits = [min(g.src_units, g.dst_units) for g in plan.groups]
    need = pair_needs(
      [g.counts for g in plan.groups], limits, 'pairs', self.config.buckets_per_octave
    )
    ring = ring_rows(perm, target_ranks(dst, shapes[0][0])) is not None
    pairs = tuple(
      np.maximum(n, np.where(g.reach & ((n > 0) if ring else True), int(n.max()), 0))
      for n, g in zip(need, plan.groups)
    )
    # The whole block as the landing width (a 'scatter' output): it does not vary by move.
    floor = Floor(pairs=pairs, local=tuple(g.dst_units for g in plan.groups))
    return make_plan(src, dst, shapes, dtypes, perm=perm, options=self._plan_options(src, floor))

  @staticmethod
  def _floor_key(leaves: Sequence[Any], src: Layout, dst: Layout) -> tuple:
    """(layouts, shapes, dtypes): what stable capacities are kept per."""
    shapes = tuple(tuple(x.shape) for x in leaves)
    return (src.key(), dst.key(), shapes, tuple(np.dtype(x.dtype).str for x in leaves))

  def _plan(
    self, leaves: Sequence[Any], src: Layout, dst: Layout, perm: np.ndarray | None
  ) -> tuple[Plan, list[jax.Array], float]:
    """The plan, its device tables and the seconds spent planning (cached)."""
    shapes = tuple(tuple(x.shape) for x in leaves)
    dtypes = tuple(np.dtype(x.dtype) for x in leaves)
    t0 = time.perf_counter()
    digest = None if perm is None else hashlib.blake2b(perm.tobytes(), digest_size=16).digest()
    key = (*self._floor_key(leaves, src, dst), digest)
    hit = self._plans.get(key)
    if hit is not None:
      self._plans.move_to_end(key)
      return hit[0], hit[1], time.perf_counter() - t0
    if self.config.stable_kernels and perm is not None:
      plan = self._stable_plan(key[:-1], src, dst, shapes, dtypes, perm)
    else:
      options = self._plan_options(src, None)
      plan = make_plan(src, dst, shapes, dtypes, perm=perm, options=options)
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

  # --------------------------------------------------------------------------- layout_aware

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
      [landing.output_struct(plan, src, i) for i in landing.landing_fields(plan)] if recycle else []
    )
    self._kernels.put(key, (kernel, structs))
    return kernel, structs, True

  def _run_kernel(
    self, plan: Plan, src: Layout, leaves: Sequence[Any], tables: list[jax.Array]
  ) -> tuple[list[jax.Array], bool, int]:
    """The layout_aware kernel's raw outputs, whether it was new, and the recycled bytes."""
    if not self.recycles(src):
      kernel, _, compiled = self._kernel(plan, src, False)
      return kernel(list(leaves), tables), compiled, 0
    kernel, structs, compiled = self._kernel(plan, src, True, _shared(leaves))
    buffers, recycled = self._pool.landing_buffers(structs)
    raw, spent = kernel(list(leaves), tables, buffers)
    self._pool.add(spent)
    return raw, compiled, recycled

  def _layout_aware(
    self, plan: Plan, tables: list[jax.Array], leaves: Sequence[Any], src: Layout, dst: Layout
  ) -> tuple[list[jax.Array], bool, int]:
    """The batch on `dst` by the plan: a zero-copy re-wrap when every target block already is a
    source block on its device, else the kernel. Returns (outputs, compiled, recycled bytes)."""
    if plan.is_zero_copy:  # every target block already is a source block on its device
      raw, compiled, recycled = list(leaves), False, 0
    else:
      raw, compiled, recycled = self._run_kernel(plan, src, leaves, tables)
    shapes = [tuple(x.shape) for x in leaves]
    outs = [collectives.rewrap(o, shapes[i], dst.sharding(i)) for i, o in enumerate(raw)]
    return outs, compiled, recycled

  # --------------------------------------------------------------------------- dispatch

  def _check(
    self, batch: Any, src: Layout, dst: Layout, perm: np.ndarray | Sequence[int] | None
  ) -> tuple[list[Any], np.ndarray | None]:
    """The batch's leaves, checked against both layouts, and the permutation (None for none or
    the identity). Raises LayoutError."""
    leaves = src.check(batch, placed=True, what='source batch')
    check_compatible(src, dst)
    dst.check(batch, what='batch (target layout)')
    p = None if perm is None else check_permutation(perm, leaves[0].shape[0])
    if p is not None and np.array_equal(p, np.arange(len(p))):
      p = None
    return leaves, p

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
    # Check.
    src = Layout.of(batch) if src is None else src
    leaves, p = self._check(batch, src, dst, perm)
    # Choose: nothing to do, the plan's kernel (or a zero-copy re-wrap), or a baseline.
    if requested == Strategy.AUTO and p is None and self._same_shardings(src, dst, len(leaves)):
      return batch, self._report('noop', requested)
    plan, plan_s, accounting_s = None, 0.0, 0.0
    if requested in (Strategy.AUTO, Strategy.LAYOUT_AWARE):
      if p is None and perm is not None and self._floor_key(leaves, src, dst) in self._capacities:
        p = np.arange(leaves[0].shape[0])  # the identity takes the stable kernel (no compile)
      plan, tables, plan_s = self._plan(leaves, src, dst, p)
      # Move.
      outs, compiled, recycled = self._layout_aware(plan, tables, leaves, src, dst)
      rewrapped = requested == Strategy.AUTO and plan.is_zero_copy
      name = 'rewrap' if rewrapped else Strategy.LAYOUT_AWARE.value
    else:
      if account:  # the plan's byte counts for the report, not timed
        plan, _, accounting_s = self._plan(leaves, src, dst, p)
      # Move.
      outs, compiled = self._baselines[requested].move(leaves, src, dst, p)
      recycled, name = 0, requested.value
    # Report.
    wall = None
    if self.config.timed:
      jax.block_until_ready(outs)
      wall = time.perf_counter() - t_start - accounting_s
    result = jax.tree.unflatten(dst.treedef, outs)
    return result, self._report(name, requested, plan, wall, plan_s, compiled, recycled)

  @staticmethod
  def _same_shardings(src: Layout, dst: Layout, num_fields: int) -> bool:
    return all(src.sharding(i) == dst.sharding(i) for i in range(num_fields))

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
      return self._xla.compiled_text(leaves, src, dst, p)
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
