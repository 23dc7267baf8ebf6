"""Pytrees of arrays from one layout to another over the same devices, device to device.

Every stage mesh is built over the same canonical devices, so a layout switch is one jitted
identity whose `out_shardings` are the target layout: XLA turns it into local slices and
collectives, and nothing goes through the host (unlike `jax.device_put` between two shardings
over the same devices, which in this JAX version gathers to host numpy and scatters again).
The source is donated: leaves whose per-device shards keep their shape are aliased, the others
are freed right after the copy, so the old layout does not outlive the switch. A move whose
compiled program would hold more temporary memory than its output (XLA rebuilding whole leaves on
every device, e.g. fsdp rows to tp columns replicated over dp) goes through a fully sharded
intermediate layout instead, when that holds less (`_spread`). XLA's warnings about the direct
move's rematerialization are held back: the move is measured and staged here.

A `Resharder` owns the compiled moves, keyed by (tree structure, source layout, target layout,
donation), in a bounded least-recently-used table: the object that owns a run's meshes owns its
moves too, and nothing outlives it.

  resharder = Resharder()
  params = resharder(params, targets)                # the old params are consumed
  resharder.prepare(abstract_params, targets)        # compile ahead (any thread), then move fast
  params, ms = resharder.timed(params, targets)
"""

import contextlib
import math
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from earl_jax.caching import LRUCache
from earl_jax.sharding import mesh as mesh_lib

_DONATION_WARNING = 'Some donated buffers were not usable'


def needs_reshard(tree: Any, target_shardings: Any) -> bool:
  """Whether any leaf of `tree` (arrays or ShapeDtypeStructs) is not laid out as its target."""
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(target_shardings)
  return any(not leaf.sharding.is_equivalent_to(t, leaf.ndim) for leaf, t in zip(leaves, targets))


def _spread(target: Any, shape: tuple[int, ...]) -> NamedSharding | None:
  """The target with its replicated mesh axes sharding one more dimension, or None.

  A target that replicates a leaf over some mesh axes (a tp layout's parameters over dp) can
  make XLA's partitioner give up on a move from another layout (fsdp rows to tp columns in
  another device order) and rebuild the whole leaf on every device ("involuntary full
  rematerialization"): temporary memory of every moved leaf's full size at once. Through this
  fully sharded intermediate the move is an all-to-all between two fully sharded layouts, then
  an all-gather over the replicated axes. The axes go after the target's own on the first
  dimension they divide, preferring a dimension the target already shards.
  """
  if not isinstance(target, NamedSharding):
    return None
  spec = list(target.spec) + [None] * (len(shape) - len(target.spec))
  axes = lambda entry: () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)  # noqa: E731
  used = {a for entry in spec for a in axes(entry)}
  free = tuple(a for a in target.mesh.axis_names if a not in used and target.mesh.shape[a] > 1)
  if not free:
    return None
  size = lambda names: math.prod(target.mesh.shape[a] for a in names)  # noqa: E731
  order = sorted(range(len(shape)), key=lambda d: spec[d] is None)  # sharded dimensions first
  for d in order:
    if shape[d] % (size(axes(spec[d])) * size(free)) == 0:
      spec[d] = (*axes(spec[d]), *free)
      return NamedSharding(target.mesh, P(*spec))
  return None


# What XLA's SPMD partitioner writes (C++ logging, straight to file descriptor 2) for each leaf
# of a move that it can only make by rebuilding the whole leaf on every device.
_REMATERIALIZATION = 'Involuntary full rematerialization'
_STDERR_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_rematerialization_warnings() -> Iterator[None]:
  """Inside, what is written to file descriptor 2 (by any thread) is held back, then passed on
  without XLA's rematerialization warnings. A file descriptor, not `sys.stderr`: XLA's C++
  logging writes to it directly."""
  with _STDERR_LOCK, tempfile.TemporaryFile() as held:
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      lines = held.read().decode(errors='replace').splitlines(keepends=True)
      kept = ''.join(line for line in lines if _REMATERIALIZATION not in line)
      if kept:
        os.write(2, kept.encode())


# XLA's temporaries and outputs of a compiled move; 0 where the backend gives no analysis (then
# no move is staged). Not `programs.memory.xla_memory`: `earl_jax.programs` imports this module.
def _temp_bytes(compiled: Any) -> int:
  memory = compiled.memory_analysis()
  return 0 if memory is None else memory.temp_size_in_bytes


def _output_bytes(compiled: Any) -> int:
  memory = compiled.memory_analysis()
  return 0 if memory is None else memory.output_size_in_bytes


class Resharder:
  """Device-to-device moves of pytrees between layouts, compiled once per layout pair.

  Thread-safe: `prepare` may run in a background thread while the step thread moves trees.
  At most `max_entries` compiled moves are kept (least recently used go first).
  """

  def __init__(self, max_entries: int = 64):
    if not isinstance(max_entries, int) or max_entries < 1:
      raise ValueError(f'Resharder.max_entries must be >= 1, got {max_entries!r}.')
    self._compiled: LRUCache[Any, Any] = LRUCache(max_entries)
    self.compiles = 0

  def __len__(self) -> int:
    return len(self._compiled)

  @staticmethod
  def _key(tree: Any, target_shardings: Any, donate: bool) -> tuple[Any, tuple[Any, ...]]:
    leaves, treedef = jax.tree.flatten(tree)
    targets = tuple(treedef.flatten_up_to(target_shardings))
    source = tuple((tuple(x.shape), str(x.dtype), x.sharding) for x in leaves)
    return (treedef, source, targets, donate), targets

  def _compile(self, key: Any, tree: Any, targets: tuple[Any, ...], donate: bool) -> Any:
    treedef = key[0]
    out_shardings = jax.tree.unflatten(treedef, targets)
    abstract = mesh_lib.abstract_arrays(tree)
    donated = 0 if donate else ()

    def compile_(fn):
      with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message=_DONATION_WARNING)
        return (
          jax.jit(fn, out_shardings=out_shardings, donate_argnums=donated).lower(abstract).compile()
        )

    # XLA reports a direct move that rebuilds whole leaves on stderr, one line per leaf; the
    # move is measured here and staged when that holds less, so the lines say nothing new.
    with _without_rematerialization_warnings():
      compiled = compile_(lambda t: t)
    shapes = [x.shape for x in jax.tree.leaves(abstract)]
    stages = [_spread(t, shape) for t, shape in zip(targets, shapes)]
    if any(stages) and _temp_bytes(compiled) > _output_bytes(compiled):

      def staged(t):
        leaves = jax.tree.leaves(t)
        leaves = [
          x if m is None else jax.lax.with_sharding_constraint(x, m) for x, m in zip(leaves, stages)
        ]
        return jax.tree.unflatten(treedef, leaves)

      alternative = compile_(staged)
      if _temp_bytes(alternative) < _temp_bytes(compiled):
        compiled = alternative
    self.compiles += 1
    return self._compiled.put(key, compiled)

  def prepare(self, tree: Any, target_shardings: Any, *, donate: bool = True) -> None:
    """Compiles the move of `tree`'s layout to `target_shardings` ahead of time.

    `tree` may hold arrays or ShapeDtypeStructs with shardings: only structure, shapes, dtypes
    and shardings are used.
    """
    if not needs_reshard(tree, target_shardings):
      return
    key, targets = self._key(tree, target_shardings, donate)
    if self._compiled.get(key) is None:
      self._compile(key, tree, targets, donate)

  def is_prepared(self, tree: Any, target_shardings: Any, *, donate: bool = True) -> bool:
    """Whether this move is compiled and cached."""
    key, _ = self._key(tree, target_shardings, donate)
    return key in self._compiled

  def __call__(self, tree: Any, target_shardings: Any, *, donate: bool = True) -> Any:
    """Moves every leaf of `tree` to its target sharding, device to device.

    Args:
      tree: a pytree of jax Arrays (parameters, a TrainState, ...), all on the canonical devices.
      target_shardings: a pytree of the same structure whose leaves are the target shardings.
      donate: consume `tree` (its buffers are aliased where possible and deleted otherwise).

    Returns:
      The same values laid out as `target_shardings`. When nothing has to move, `tree` itself.
    """
    if not needs_reshard(tree, target_shardings):
      return tree
    key, targets = self._key(tree, target_shardings, donate)
    fn = self._compiled.get(key) or self._compile(key, tree, targets, donate)
    with warnings.catch_warnings():
      # Leaves whose shard shape changes cannot be aliased; they are deleted below instead.
      warnings.filterwarnings('ignore', message=_DONATION_WARNING)
      out = fn(tree)
    if donate:
      for leaf in jax.tree.leaves(tree):
        if not leaf.is_deleted():
          leaf.delete()
    return out

  def timed(self, tree: Any, target_shardings: Any, *, donate: bool = True) -> tuple[Any, float]:
    """The move, waited for; returns (tree, milliseconds)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(self(tree, target_shardings, donate=donate))
    return out, 1e3 * (time.perf_counter() - t0)
