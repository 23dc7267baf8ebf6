"""Orbax checkpoints of the train state plus JSON metadata, restorable onto any mesh.

Each step directory holds two items: 'state' (the TrainState pytree, saved sharded) and 'meta'
(JSON: the step, the config fingerprint, the selector's state, the statistics the next step's
decisions read, and a checksum of every array; the metrics history stays in metrics.jsonl). Restoring takes an abstract
target whose shardings decide where the arrays land, so a checkpoint saved on mesh (2, 4)
restores onto (8, 1) or onto a process with fewer devices (jax-notes §4), and checks the
restored arrays against their checksums: a corrupted checkpoint is an error, never silent.

  ckpt = Checkpointer(workdir / 'checkpoints', max_to_keep=3)
  ckpt.save(step, state, meta)                    # async; ckpt.wait() before exiting
  state, meta = ckpt.restore(abstract_state)      # latest step, verified
  step, state, meta = ckpt.restore_newest_readable(lambda meta: abstract_state, on_skip=print)
"""

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from earl_jax.errors import UserError


class CheckpointError(UserError):
  """A checkpoint directory or step that cannot be restored."""


CHECKSUMS = 'array_checksums'


def _reason(error: Exception) -> str:
  """An exception as one short line."""
  text = ' '.join(str(error).split())
  return f'{type(error).__name__}: {text[:200]}' if text else type(error).__name__


@jax.jit
def _leaf_checksums(leaves: list[jax.Array]) -> list[jax.Array]:
  out = []
  for x in leaves:
    flat = x.reshape(-1)
    if flat.dtype == jnp.bool_:
      bits = flat.astype(jnp.uint32)
    else:
      unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[flat.dtype.itemsize]
      bits = jax.lax.bitcast_convert_type(flat, unsigned).astype(jnp.uint32)
    # Position-weighted, so that moved or swapped elements show too; uint32 arithmetic wraps,
    # so the sum does not depend on how the array is sharded or reduced.
    weights = jnp.arange(flat.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    out.append(jnp.sum(bits * weights, dtype=jnp.uint32))
  return out


def checksums(tree: Any) -> list[int]:
  """One 32-bit checksum per array of `tree`, from its bits: the same on any mesh or process."""
  return [int(c) for c in jax.device_get(_leaf_checksums(jax.tree.leaves(tree)))]


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        create=True,
      ),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    meta = {**meta, CHECKSUMS: checksums(state)}
    self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )

  def read_meta(self, step: int | None = None) -> dict:
    step = self._step(step)
    out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    meta = dict(out['meta'])
    meta.pop(CHECKSUMS, None)
    return meta

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """The state at `step` (default: latest), laid out as `abstract_state`'s shardings say."""
    step = self._step(step)
    out = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
      ),
    )
    meta = dict(out['meta'])
    expected = meta.pop(CHECKSUMS, None)
    if expected is not None:
      got = checksums(out['state'])
      bad = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
      if bad or len(got) != len(expected):
        raise CheckpointError(
          f'checkpoint step {step} in {self.directory}: {len(bad)} of {len(expected)} arrays do '
          'not match their checksums (corrupted data): expected the arrays as saved.'
        )
    return out['state'], meta

  def readable_metas(
    self, steps: list[int] | None = None, *, on_skip: Callable[[int, str], None]
  ) -> Iterator[tuple[int, dict]]:
    """(step, meta) of `steps` (default: all, newest first) whose meta reads; a step whose meta
    does not is reported to `on_skip(step, reason)` and passed over."""
    for step in sorted(self.all_steps(), reverse=True) if steps is None else steps:
      try:
        meta = self.read_meta(step)
      except Exception as e:  # any unreadable checkpoint is skipped, and said so
        on_skip(step, _reason(e))
        continue
      yield step, meta

  def restore_newest_readable(
    self,
    abstract_state: Callable[[dict], Any],
    *,
    on_skip: Callable[[int, str], None],
    steps: list[int] | None = None,
  ) -> tuple[int, Any, dict]:
    """The newest of `steps` (default: all, newest first) that restores and verifies.

    `abstract_state(meta)` gives the restore target of a step from its meta. A step that cannot
    be read (truncated, corrupted, an item missing, checksums that do not match) is reported to
    `on_skip(step, reason)` and the next older one is tried; CheckpointError when none is left.
    """
    for step, meta in self.readable_metas(steps, on_skip=on_skip):
      try:
        state, meta = self.restore(abstract_state(meta), step)
      except Exception as e:  # any unreadable checkpoint is skipped, and said so
        on_skip(step, _reason(e))
        continue
      return step, state, meta
    raise CheckpointError(
      f'no readable checkpoint in {self.directory} (tried steps '
      f'{sorted(self.all_steps(), reverse=True) if steps is None else steps}): expected at '
      'least one that restores.'
    )

  def _step(self, step: int | None) -> int:
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(f'No checkpoint in {self.directory}.')
    elif step not in self.all_steps():
      raise CheckpointError(
        f'No checkpoint for step {step} in {self.directory}; have {self.all_steps()}.'
      )
    return step

  def set_aside(self, steps: list[int], *, suffix: str) -> None:
    """Renames the step directories `steps` to `<step>.<suffix>` (process 0), which Orbax no
    longer lists, so that those steps can be saved again; nothing is deleted."""
    if jax.process_index() == 0:
      for step in steps:
        path = os.path.join(self.directory, str(step))
        if os.path.isdir(path):
          os.rename(path, f'{path}.{suffix}-{time.strftime("%Y%m%d-%H%M%S", time.gmtime())}')
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('checkpoint_set_aside')
    self._manager.reload()

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
