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

import contextlib
import errno
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from earl_jax import distributed
from earl_jax.errors import UserError, os_errno, storage_error


class CheckpointError(UserError):
  """A checkpoint directory or step that cannot be restored."""


CHECKSUMS = 'array_checksums'
# Room kept free beyond a checkpoint's bytes: Orbax's own files (manifests, the OCDBT index).
_SLACK_BYTES = 1 << 20


def _reason(error: Exception) -> str:
  """An exception as one short line."""
  text = ' '.join(str(error).split())
  return f'{type(error).__name__}: {text[:200]}' if text else type(error).__name__


@contextlib.contextmanager
def _quiet_if_it_fails() -> Iterator[None]:
  """Holds back what is written to stderr (the file descriptor, as C++ writes it) inside, and
  drops it when the block raises: a restore of damaged arrays leaves TensorStore reads whose
  callbacks print tracebacks into a closed event loop, which the one line about the skipped
  step says better. What a block that succeeds wrote is written out after it."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    failed = True
    try:
      yield
      failed = False
    finally:
      try:
        if failed:
          gc.collect()  # the abandoned reads end (and print) now, not later on the real stderr
          time.sleep(0.2)
        sys.stderr.flush()
      finally:
        os.dup2(saved, 2)
        os.close(saved)
      if not failed:
        held.seek(0)
        os.write(2, held.read())


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


def _agree(problem: BaseException | None) -> None:
  """Raises `problem`, or, where another process has one, an OSError saying so: every process
  of a multi-controller run takes the same path through a save (a collective)."""
  code = 0 if problem is None else os_errno(problem) or errno.EIO
  worst = distributed.process_max([code])[0]
  if problem is not None:
    raise problem
  if worst:
    raise OSError(worst, f'{os.strerror(worst)} (on another process)')


def checksums(tree: Any) -> list[int]:
  """One 32-bit checksum per array of `tree`, from its bits: the same on any mesh or process."""
  return [int(c) for c in jax.device_get(_leaf_checksums(jax.tree.leaves(tree)))]


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self._writing_step: int | None = None  # the save under way (or the last one)
    with self._writing():  # the folder is made here
      self._manager = self._open(max_to_keep, async_save)

  def _open(self, max_to_keep: int, async_save: bool) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
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
    """Saves `step` in the background (after the previous save's end, whose failure it raises).

    Raises:
      StorageError: this save or the one before could not be written (no space, read-only, not
        permitted); the checkpoints already complete are kept.
    """
    meta = {**meta, CHECKSUMS: checksums(state)}
    self._writing_step = step
    with self._writing():
      _agree(self._room_problem(state, meta))  # every process saves, or none
      self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
      )

  def _room_problem(self, state: Any, meta: dict) -> OSError | None:
    """Why a save cannot be written (ENOSPC, EROFS, EACCES), found before it starts: here the
    failure is one line; inside Orbax's writer threads it is dozens of tracebacks. The space
    needed is the arrays' bytes (every shard: an upper bound) and the metadata's."""
    needed = sum(x.nbytes for x in jax.tree.leaves(state)) + len(json.dumps(meta)) + _SLACK_BYTES
    try:
      fd, probe = tempfile.mkstemp(dir=self.directory, prefix='.write_check_')
      os.close(fd)
      os.remove(probe)
      free = shutil.disk_usage(self.directory).free
    except OSError as e:
      return e
    if free < needed:
      text = f'{os.strerror(errno.ENOSPC)}: {needed >> 10} KiB needed, {free >> 10} KiB free'
      return OSError(errno.ENOSPC, text)
    return None

  def check(self) -> None:
    """Raises StorageError at once when the save in the background has failed, on any process
    (a collective: every process calls it at the same point)."""
    with self._writing():
      try:
        self._manager.check_for_errors()
      except Exception as e:
        _agree(e)
        raise
      _agree(None)

  @contextlib.contextmanager
  def _writing(self) -> Iterator[None]:
    """Storage failures of the save under way (or the one before) as one-line StorageErrors."""
    try:
      yield
    except Exception as e:
      names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
      complete = sorted(int(n) for n in names if n.isdigit())
      kept = (
        f'the checkpoints already complete are kept (newest: step {complete[-1]})'
        if complete
        else 'no checkpoint was complete before it'
      )
      step = self._writing_step
      what = 'a checkpoint' if step is None else f'checkpoint step {step}'
      error = storage_error(e, what, self.directory, kept)
      if error is None:
        raise
      raise error from None

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

  def state_shapes(self, step: int | None = None) -> Any:
    """The saved state's tree (nested dicts, as Orbax stores a pytree) of `jax.ShapeDtypeStruct`s,
    read from the checkpoint's metadata at `step` (default: latest) without restoring an array."""
    step = self._step(step)
    path = os.path.join(self.directory, str(step), 'state')
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(path)).tree
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)

  def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, dict]:
    """Only the `params` field of a saved train state at `step` (default: latest), laid out as
    `abstract_params`' shardings say (its dtypes must be the saved ones), and the step's meta.

    The rest of the state (optimizer moments, counters) is not read. The parameters are
    verified against their checksums: they are the first leaves of the state's, in order.
    """
    step = self._step(step)
    target = {'params': abstract_params}
    out = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
          item=target,
          restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True,
        ),
        meta=ocp.args.JsonRestore(),
      ),
    )
    params, meta = out['state']['params'], dict(out['meta'])
    expected = meta.pop(CHECKSUMS, None)
    if expected is not None:
      got = checksums(params)
      if got != expected[: len(got)]:
        bad = sum(a != b for a, b in zip(got, expected))
        raise CheckpointError(
          f'checkpoint step {step} in {self.directory}: {bad} of {len(got)} parameter arrays do '
          'not match their checksums (corrupted data): expected the arrays as saved.'
        )
    return params, meta

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
    return self.newest_readable(
      lambda step, meta: (step, *self.restore(abstract_state(meta), step)),
      on_skip=on_skip,
      steps=steps,
    )

  def restore_newest_readable_params(
    self, abstract_params: Any, *, on_skip: Callable[[int, str], None], steps: list[int] | None
  ) -> tuple[int, Any]:
    """(step, parameters) of the newest of `steps` whose parameters restore and verify
    (`restore_params`), the others reported to `on_skip` as `restore_newest_readable` does."""
    return self.newest_readable(
      lambda step, meta: (step, self.restore_params(abstract_params, step)[0]),
      on_skip=on_skip,
      steps=steps,
    )

  def newest_readable(
    self,
    restore: Callable[[int, dict], Any],
    *,
    on_skip: Callable[[int, str], None],
    steps: list[int] | None = None,
  ) -> Any:
    """`restore(step, meta)` of the newest of `steps` (default: all, newest first) whose meta
    reads and for which it does not raise; the others reported to `on_skip(step, reason)`;
    CheckpointError when none is left."""
    for step, meta in self.readable_metas(steps, on_skip=on_skip):
      try:
        with _quiet_if_it_fails():
          return restore(step, meta)
      except Exception as e:  # any unreadable checkpoint is skipped, and said so
        on_skip(step, _reason(e))
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
    """Waits for the save under way; StorageError if it failed."""
    with self._writing():
      self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
