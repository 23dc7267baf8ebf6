"""Weights and optimizer state from one mesh to another, device to device.

Every stage mesh is built over the same canonical devices, so a layout switch is one jitted
identity whose `out_shardings` are the target layout: XLA turns it into local slices and
collectives, and nothing goes through the host (unlike `jax.device_put` between two shardings
over the same devices, which in this JAX version gathers to host numpy and scatters again).
The source is donated: leaves whose per-device shards keep their shape are aliased, the others
are freed right after the copy, so the old layout does not outlive the switch.

  targets = reshard.param_shardings(cfg, ParallelConfig(dp=2, tp=4))
  params = reshard.reshard_tree(params, targets)               # the old params are consumed
  state = reshard.reshard_tree(train_state, stages.train_state_shardings(cfg, pc, optim))

`prepare(tree, targets)` compiles the move ahead of time (from any thread, e.g. while a step runs);
`reshard_tree` then uses that executable, so a planned switch pays only for moving the bytes.
"""

import functools
import threading
import time
import warnings
from typing import Any

import jax

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.sharding import mesh as mesh_lib

_DONATION_WARNING = 'Some donated buffers were not usable'


@functools.lru_cache(maxsize=128)
def _identity(treedef: Any, targets: tuple[Any, ...], donate: bool) -> Any:
  """A jitted identity whose outputs have the target shardings (memoised per layout pair)."""
  out_shardings = jax.tree.unflatten(treedef, targets)
  return jax.jit(lambda tree: tree, out_shardings=out_shardings, donate_argnums=0 if donate else ())


class _Prepared:
  """AOT-compiled moves, keyed by (tree structure, source layout, target layout, donate)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._compiled: dict[Any, Any] = {}

  @staticmethod
  def key(leaves: list[Any], treedef: Any, targets: tuple[Any, ...], donate: bool) -> Any:
    source = tuple((x.shape, str(x.dtype), x.sharding) for x in leaves)
    return (treedef, source, targets, donate)

  def get(self, key: Any) -> Any:
    with self._lock:
      return self._compiled.get(key)

  def put(self, key: Any, compiled: Any) -> None:
    with self._lock:
      self._compiled[key] = compiled


_PREPARED = _Prepared()


def prepare(tree: Any, target_shardings: Any, *, donate: bool = True) -> None:
  """Compiles the move of `tree`'s layout to `target_shardings` ahead of time (thread-safe).

  `tree` may hold arrays or ShapeDtypeStructs with shardings: only structure, shapes, dtypes and
  shardings are used.
  """
  if not needs_reshard(tree, target_shardings):
    return
  leaves, treedef = jax.tree.flatten(tree)
  targets = tuple(treedef.flatten_up_to(target_shardings))
  key = _PREPARED.key(leaves, treedef, targets, donate)
  if _PREPARED.get(key) is not None:
    return
  abstract = mesh_lib.abstract_arrays(tree)
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', message=_DONATION_WARNING)
    compiled = _identity(treedef, targets, donate).lower(abstract).compile()
  _PREPARED.put(key, compiled)


def is_prepared(tree: Any, target_shardings: Any, *, donate: bool = True) -> bool:
  """Whether `prepare` already compiled this move."""
  leaves, treedef = jax.tree.flatten(tree)
  targets = tuple(treedef.flatten_up_to(target_shardings))
  return _PREPARED.get(_PREPARED.key(leaves, treedef, targets, donate)) is not None


def needs_reshard(tree: Any, target_shardings: Any) -> bool:
  """Whether any leaf of `tree` is not already laid out as its target sharding."""
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(target_shardings)
  return any(not leaf.sharding.is_equivalent_to(t, leaf.ndim) for leaf, t in zip(leaves, targets))


def reshard_tree(tree: Any, target_shardings: Any, *, donate: bool = True) -> Any:
  """Moves every leaf of `tree` to its target sharding, device to device.

  Args:
    tree: a pytree of jax Arrays (parameters, a TrainState, ...), all on the canonical devices.
    target_shardings: a pytree of the same structure whose leaves are the target shardings.
    donate: consume `tree` (its buffers are aliased where possible and deleted otherwise).

  Returns:
    The same values laid out as `target_shardings`. When nothing has to move, `tree` itself.
  """
  leaves, treedef = jax.tree.flatten(tree)
  targets = tuple(treedef.flatten_up_to(target_shardings))
  if not needs_reshard(tree, target_shardings):
    return tree
  fn = _PREPARED.get(_PREPARED.key(leaves, treedef, targets, donate))
  if fn is None:
    fn = _identity(treedef, targets, donate)
  with warnings.catch_warnings():
    # Leaves whose shard shape changes cannot be aliased; they are deleted below instead.
    warnings.filterwarnings('ignore', message=_DONATION_WARNING)
    out = fn(tree)
  if donate:
    for leaf in leaves:
      if not leaf.is_deleted():
        leaf.delete()
  return out


def timed_reshard(tree: Any, target_shardings: Any, *, donate: bool = True) -> tuple[Any, float]:
  """`reshard_tree`, waited for; returns (tree, milliseconds)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(reshard_tree(tree, target_shardings, donate=donate))
  return out, 1e3 * (time.perf_counter() - t0)


@functools.lru_cache(maxsize=64)
def param_shardings(model: ModelConfig, parallel: ParallelConfig) -> Any:
  """The model's parameter shardings on the mesh of `parallel` (over the canonical devices).

  Cached: the trainer asks for them every step, and building them traces the whole model.
  """
  mesh = mesh_lib.make_mesh(parallel)
  _, abstract = qwen2.abstract_model(model, mesh)
  return qwen2.state_shardings(abstract)
