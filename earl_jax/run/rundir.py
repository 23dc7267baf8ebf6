"""The run directory: who may write it, which checkpoint a resume continues, and what it keeps.

A workdir holds one run of a job (the RL `Trainer`, the supervised `SFTRun`): `metrics.jsonl`,
`tb/`, `checkpoints/<step>/` (the train state and its metadata: the step, the config and its
fingerprint, and what the job keeps for its resume, e.g. the RL job's selector state and the
profile its decisions were taken on), `config.json`, `summary.json` and plots. `RunDir.open`
checks all of it before anything compiles, and says what a resume will continue from; nothing
here compiles or touches a device except the checkpoint restore.

  run_dir, resume_point = RunDir.open('runs/default', config, resume=True, log=print)
  resume_point.meta                                      # the checkpoint's metadata
  restored = run_dir.restore(resume_point, lambda meta: abstract_state_for(meta))
  restored.step, restored.state, restored.rows          # rows: metrics.jsonl up to the step
  run_dir.save(step, state, {'train_config': 'dp8.tp1', ...})   # the job's metadata
  run_dir.close()                                        # waits for the save, frees the workdir

One run per workdir: `RunDir.open` takes the workdir's lock (`workdir_lock.WorkdirLock`, on
process 0) before anything is written, and `close` frees it."""

import contextlib
import dataclasses
import json
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from earl_jax.errors import UserError
from earl_jax.run import checkpointing, metrics
from earl_jax.run.workdir_lock import LOCK, WorkdirError, WorkdirLock

# The longest file or folder name (bytes) of the file systems a run writes to (ext4, xfs, tmpfs).
_NAME_MAX = 255


class ResumeError(UserError):
  """`--resume` without a checkpoint, or with another config's."""


@runtime_checkable
class RunConfig(Protocol):
  """What the run directory reads of a job's config (`ExperimentConfig`, `SFTConfig`)."""

  checkpoint_every: int  # 0: the run keeps no checkpoints
  keep_checkpoints: int

  def to_json(self) -> dict: ...

  def fingerprint(self) -> str:
    """Identifies what the run computes (a checkpoint without its config is checked by it)."""

  def resume_diff(self, saved: dict) -> list[str]:
    """The fields of a checkpoint's config (`to_json`) whose change refuses a resume."""


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  """What `--resume` continues from, chosen before anything compiles.

  Attributes:
    steps: the checkpoint steps to try, newest first (the newest whose metadata reads, and the
      older ones should its arrays not restore).
    meta: the newest readable checkpoint's metadata (what the job saved with it, e.g. the
      profile the RL job's decisions were taken on).
  """

  steps: tuple[int, ...]
  meta: dict


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored checkpoint, as the trainer continues from it.

  Attributes:
    step: its step.
    state: the train state, on the layout the job's `abstract_state(meta)` described.
    meta: its metadata (what the job saved with it: `RunDir.save`'s `meta`).
    rows: metrics.jsonl's records up to the step (what a run that died logged later is dropped).
  """

  step: int
  state: Any
  meta: dict
  rows: list[dict]


class RunDir:
  """One run's folder: its checks, checkpoints and metadata (see the module docstring)."""

  def __init__(
    self,
    workdir: str,
    config: RunConfig,
    checkpointer: checkpointing.Checkpointer | None,
    *,
    log: Callable[[str], None],
    lock: 'WorkdirLock | None' = None,
  ):
    """Use `RunDir.open`, which checks the folder first (and takes `lock`: None on the processes
    other than 0)."""
    self.workdir = workdir
    self.config = config
    self._checkpointer = checkpointer
    self.log = log
    self._lock = lock

  @property
  def checkpointer(self) -> checkpointing.Checkpointer | None:
    """The run's checkpoints (None: it keeps none). A fresh run opens them at their first use,
    its first save, so that a run refused before then leaves no checkpoints/ folder behind."""
    if self._checkpointer is None and self.config.checkpoint_every:
      self._checkpointer = checkpointing.Checkpointer(
        os.path.join(self.workdir, 'checkpoints'), max_to_keep=self.config.keep_checkpoints
      )
    return self._checkpointer

  @classmethod
  def open(
    cls,
    workdir: str,
    config: RunConfig,
    *,
    resume: bool,
    log: Callable[[str], None],
    set_aside_used: bool = False,
  ) -> tuple['RunDir', ResumePoint | None]:
    """Checks that `workdir` can be written and holds no other run (or, with `resume`, a
    checkpoint of this config) and takes its lock (process 0), before anything else is written;
    returns the run directory (`close` it) and, with `resume`, the point it continues from.

    With `set_aside_used` (`--move_aside`), a workdir that holds a run is first renamed to
    `<workdir>.<UTC time>` (`move_aside`), after every other check of the run has passed.

    Raises:
      WorkdirError: not writable, locked by a live run (or another host's), or a run is there
        (without `resume` or `set_aside_used`).
      ResumeError: `resume` without a readable checkpoint of this config.
    """
    check_writable(workdir)

    def warn(line: str) -> None:  # a lock taken over: in the run's log and on the terminal
      logging.warning('%s', line)
      log(line)

    if set_aside_used and not resume:
      aside = move_aside(workdir, log=warn)
      if aside is not None:
        warn(f'moved the run in {workdir} to {aside}')
    lock = _on_process_0(workdir, lambda: WorkdirLock.acquire(workdir, log=warn))
    try:
      run_dir = cls(workdir, config, _open_checkpoints(workdir, config, resume), log=log, lock=lock)
      return run_dir, run_dir._resume_point() if resume else None
    except BaseException:
      if lock is not None:  # a refused run leaves the workdir as it found it
        lock.release()
      raise

  def _resume_point(self) -> ResumePoint:
    """The newest checkpoint whose metadata reads, checked against this config."""
    ckpt = self.checkpointer
    assert ckpt is not None  # opened with resume
    ckpt_dir = ckpt.directory
    if ckpt.latest_step() is None:
      raise ResumeError(
        f'--resume: no checkpoint in {ckpt_dir}: expected a run to continue; start without '
        '--resume (or point --workdir at the run to continue).'
      )
    steps = sorted(ckpt.all_steps(), reverse=True)
    step, meta = next(ckpt.readable_metas(steps, on_skip=self._skip_checkpoint), (None, None))
    if meta is None:
      raise ResumeError(
        f'--resume: no readable checkpoint in {ckpt_dir} (steps {steps}): expected one that '
        'restores; start without --resume in a new --workdir.'
      )
    differ = self._config_changes(meta)
    if differ:
      raise ResumeError(
        f'--resume: the checkpoint in {self.workdir} (step {meta.get("step")}) was made by '
        f'another config ({"; ".join(differ)}): expected the values it was made with (only '
        'fields that change the computation refuse), or a new --workdir.'
      )
    return ResumePoint(steps=tuple(s for s in steps if s <= step), meta=meta)

  def _config_changes(self, meta: dict) -> list[str]:
    """What refuses a resume from the checkpoint of `meta`: the fields of its config that change
    the computation and differ from this one's (the config's `resume_diff`), or, for a
    checkpoint without its config, a differing fingerprint."""
    if isinstance(meta.get('config'), dict):
      return self.config.resume_diff(meta['config'])
    fingerprint = self.config.fingerprint()
    if meta.get('fingerprint') == fingerprint:
      return []
    return [f'fingerprint {meta.get("fingerprint")} -> {fingerprint}']

  def _skip_checkpoint(self, step: int, reason: str) -> None:
    line = f'checkpoint step {step} in {self.workdir} is unreadable ({reason}): skipped'
    logging.warning('%s', line)
    self.log(line)

  def restore(self, point: ResumePoint, abstract_state: Callable[[dict], Any]) -> Restored:
    """Restores the newest checkpoint of `point` that reads and verifies (older ones if it
    does not), onto the layout `abstract_state(its metadata)` describes; later steps that did
    not restore are kept aside (so that this run can save those steps again)."""
    ckpt = self.checkpointer
    assert ckpt is not None  # opened with resume
    step, state, meta = ckpt.restore_newest_readable(
      abstract_state,
      on_skip=self._skip_checkpoint,
      steps=list(point.steps),
    )
    newer = [s for s in ckpt.all_steps() if s > step]
    if newer:  # kept aside, so that this run can save those steps again
      ckpt.set_aside(newer, suffix='unreadable')
      logging.warning('resuming from step %d, the newest readable checkpoint', step)
    step = int(meta['step'])
    # The metrics history stays on disk: the rows up to the checkpoint are kept, and what a run
    # that died logged after it is dropped (the writer rewrites the file once it is open); what
    # is unreadable or missing is said in one line.
    rows, note = metrics.resume_history(os.path.join(self.workdir, 'metrics.jsonl'), step)
    if note is not None:
      logging.warning('%s', note)
      self.log(note)
    restored = Restored(step=step, state=state, meta=meta, rows=rows)
    self.log(f'resumed from step {step} ({ckpt.directory})')
    return restored

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Saves the train state at `step`, with the step, the config and its fingerprint, and the
    job's `meta` (what its resume needs: a JSON object) in the metadata (asynchronously; `wait`
    before exiting). Nothing when the run keeps no checkpoints."""
    if self.checkpointer is None:
      return
    base = {'step': step, 'fingerprint': self.config.fingerprint(), 'config': self.config.to_json()}
    self.checkpointer.save(step, state, {**base, **meta})

  def write_config(self) -> None:
    """Writes the config to config.json (process 0), as the run starts: whole or not at all
    (a temporary file renamed over it)."""
    if jax.process_index() == 0:
      path = os.path.join(self.workdir, 'config.json')
      with open(path + '.tmp', 'w') as f:
        json.dump(self.config.to_json(), f, indent=2)
      os.replace(path + '.tmp', path)

  def wait(self) -> None:
    """Waits for the checkpoint being written (StorageError if it failed)."""
    if self._checkpointer is not None:
      self._checkpointer.wait()

  def check(self) -> None:
    """Raises StorageError at once when the checkpoint being written has failed."""
    if self._checkpointer is not None:
      self._checkpointer.check()

  def close(self) -> None:
    """Ends the run's hold on the workdir, however the run ends: waits for the checkpoint being
    written, then `release`s, even when the wait raises (which it re-raises)."""
    try:
      self.wait()
    finally:
      self.release()

  @contextlib.contextmanager
  def released_on_error(self) -> Iterator[None]:
    """`release`s the workdir when what runs inside raises (a run that fails while being built),
    and re-raises."""
    try:
      yield
    except BaseException:
      self.release()
      raise

  def release(self) -> None:
    """Removes the workdir's lock now, without waiting for a save under way (a run stopped at
    once), and the workdir if this run made it and left it empty. Calling it again (or `close`)
    does nothing more; should neither be called, an atexit hook does it."""
    if self._lock is not None:
      self._lock.release()


def _open_checkpoints(
  workdir: str, config: RunConfig, resume: bool
) -> checkpointing.Checkpointer | None:
  """The checkpoints a resume continues (None for a fresh run: opened at its first save, so that
  a run refused before then leaves no checkpoints/ folder behind)."""
  if not resume:
    used = [n for n in ('metrics.jsonl', 'checkpoints') if _nonempty(workdir, n)]
    if used:
      raise WorkdirError(
        f'--workdir {workdir} holds a run ({" and ".join(used)}): expected an unused '
        'folder; pass --resume to continue it, --move_aside to keep it aside and start '
        'afresh, or another --workdir.'
      )
    return None
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(ckpt_dir):
    raise ResumeError(
      f'--resume: no checkpoint in {os.path.abspath(ckpt_dir)}: expected a run to continue; '
      'start without --resume (or point --workdir at the run to continue).'
    )
  return checkpointing.Checkpointer(ckpt_dir, max_to_keep=config.keep_checkpoints)


def check_writable(workdir: str) -> None:
  """Raises WorkdirError unless this process can create files in `workdir` (made if missing)."""
  if not workdir.strip():
    raise WorkdirError('--workdir is empty: expected a folder.')
  for name in pathlib.PurePath(os.path.abspath(workdir)).parts:
    if len(os.fsencode(name)) > _NAME_MAX:
      raise WorkdirError(
        f'--workdir {workdir}: the name {name!r} is {len(os.fsencode(name))} bytes: expected at '
        f'most {_NAME_MAX} (the file system limit of one name).'
      )
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise WorkdirError(f'--workdir {workdir}: {existing} is a file: expected a folder.')
  try:
    probe_write(existing)
  except OSError as e:
    raise WorkdirError(
      f'--workdir {workdir} is not writable ({e.strerror} in {existing}): expected a folder '
      'this process can write.'
    ) from None


def probe_write(folder: str) -> None:
  """Creates and removes a file in `folder`: OSError (its `strerror` says why) unless this
  process can write there."""
  fd, probe = tempfile.mkstemp(dir=folder, prefix='.earl_write_check_')
  os.close(fd)
  os.remove(probe)


def _nonempty(workdir: str, name: str) -> bool:
  path = os.path.join(workdir, name)
  if os.path.isdir(path):
    return bool(os.listdir(path))
  return os.path.isfile(path) and os.path.getsize(path) > 0


def move_aside(workdir: str, *, log: Callable[[str], None] | None = None) -> str | None:
  """Renames a used `workdir` to `<workdir>.<UTC time>` (process 0; the others wait); returns
  the new name on process 0 when something was moved, else None. It holds the workdir's lock
  while it renames, so it refuses a live run's workdir (and one that cannot be written) and
  renames nothing then; a lock whose owner is gone is taken over, with a line to `log` (default:
  absl's warning)."""
  log = log or (lambda line: logging.warning('%s', line))

  def move() -> str | None:
    check_writable(workdir)
    if not (os.path.isdir(workdir) and os.listdir(workdir)):
      return None
    lock = WorkdirLock.acquire(workdir, log=log)
    if os.listdir(workdir) == [LOCK]:  # held only a lock left by a run that is gone
      lock.release()
      return None
    aside = f'{workdir.rstrip(os.sep)}.{time.strftime("%Y%m%d-%H%M%S", time.gmtime())}'
    try:
      os.rename(workdir, aside)
    except OSError as e:
      raise WorkdirError(
        f'--move_aside: cannot rename {workdir} to {aside} ({e.strerror}): expected a folder '
        'this process can rename to an unused name.'
      ) from None
    finally:
      lock.release()  # the lock if the rename failed (else it moved with the folder)
    os.remove(os.path.join(aside, LOCK))
    return aside

  return _on_process_0(workdir, move)


def _on_process_0(workdir: str, fn: Callable[[], Any]) -> Any:
  """`fn()` on process 0 (None on the others, which wait for it); what it raises there stops
  every process (the others with a WorkdirError that points at process 0's)."""
  error, out = None, None
  if jax.process_index() == 0:
    try:
      out = fn()
    except Exception as e:  # raised below, once the others know
      error = e
  if jax.process_count() > 1:
    failed = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if failed and error is None:
      raise WorkdirError(
        f'--workdir {workdir}: process 0 refused it (its error says why): expected a workdir '
        'that process 0 can take.'
      )
  if error is not None:
    raise error
  return out
