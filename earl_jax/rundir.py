"""The run directory: who may write it, which checkpoint a resume continues, and what it keeps.

A workdir holds one run: `metrics.jsonl`, `tb/`, `checkpoints/<step>/` (the train state and its
metadata: the config's fingerprint, the selector's state, the statistics the next decisions read
and the profile they were taken on), `config.json`, `summary.json` and plots. `RunDir.open`
checks all of it before anything compiles, and says what a resume will continue from; nothing
here compiles or touches a device except the checkpoint restore.

  run_dir, resume_point = RunDir.open('runs/default', config, resume=True, log=print)
  resume_point.profile                                   # the checkpoint's profile (or None)
  restored = run_dir.restore(resume_point, abstract_state_for)
  restored.step, restored.state, restored.rows          # rows: metrics.jsonl up to the step
  run_dir.save(step, state, selector_state=..., train_config=..., prev_stats=..., profile=...)
  run_dir.close()                                        # waits for the save, frees the workdir

One run per workdir: `RunDir.open` takes `<workdir>/.lock` (process 0 of a run; its host, PID
and start time) before anything is written, and `close` removes it (an atexit hook does, should
the run end otherwise). A lock whose owner lives refuses the run; one whose owner is gone (same
host, no such process) is taken over, with a line in the log; another host's is refused with how
to remove it, since this host cannot tell whether that process lives.
"""

import atexit
import contextlib
import dataclasses
import json
import os
import pathlib
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from earl_jax import checkpointing, metrics
from earl_jax.config import ParallelConfig
from earl_jax.errors import UserError
from earl_jax.experiment import ExperimentConfig, config_diff
from earl_jax.selector.profile import Profile

# The longest file or folder name (bytes) of the file systems a run writes to (ext4, xfs, tmpfs).
_NAME_MAX = 255
# The workdir's lock: JSON {host, pid, started (UTC, for people), time (epoch seconds)}.
LOCK = '.lock'
# A lock file that does not parse is one being written (for microseconds) or one whose writer
# died before it wrote (or found the disk full): taken over once it is this old.
_UNREADABLE_LOCK_S = 10.0


class ResumeError(UserError):
  """`--resume` without a checkpoint, or with another config's."""


class WorkdirError(UserError):
  """A workdir that cannot be written, or that holds another run."""


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  """What `--resume` continues from, chosen before anything compiles.

  Attributes:
    steps: the checkpoint steps to try, newest first (the newest whose metadata reads, and the
      older ones should its arrays not restore).
    profile: the profile the checkpoint's decisions were taken on (None: none was kept).
  """

  steps: tuple[int, ...]
  profile: Profile | None


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored checkpoint, as the trainer continues from it.

  Attributes:
    step: its step.
    state: the train state, on `train_config`'s layout.
    train_config: the train layout it was saved from.
    selector_state: `Selector.state_dict()` at the step.
    prev_stats: the statistics the next rollout decision reads (`StepStats` fields), or None.
    rows: metrics.jsonl's records up to the step (what a run that died logged later is dropped).
  """

  step: int
  state: Any
  train_config: ParallelConfig
  selector_state: dict
  prev_stats: dict | None
  rows: list[dict]


class RunDir:
  """One run's folder: its checks, checkpoints and metadata (see the module docstring)."""

  def __init__(
    self,
    workdir: str,
    config: ExperimentConfig,
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
    cls, workdir: str, config: ExperimentConfig, *, resume: bool, log: Callable[[str], None]
  ) -> tuple['RunDir', ResumePoint | None]:
    """Checks that `workdir` can be written and holds no other run (or, with `resume`, a
    checkpoint of this config) and takes its lock (process 0), before anything else is written;
    returns the run directory (`close` it) and, with `resume`, the point it continues from.

    Raises:
      WorkdirError: not writable, locked by a live run (or another host's), or a run is there
        (without `resume`).
      ResumeError: `resume` without a readable checkpoint of this config.
    """
    check_writable(workdir)

    def warn(line: str) -> None:  # a lock taken over: in the run's log and on the terminal
      logging.warning('%s', line)
      log(line)

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
    profile = Profile.from_json(meta['profile']) if meta.get('profile') else None
    return ResumePoint(steps=tuple(s for s in steps if s <= step), profile=profile)

  def _config_changes(self, meta: dict) -> list[str]:
    """What refuses a resume from the checkpoint of `meta`: the fields of its config that change
    the computation and differ from this one's (`experiment.config_diff`), or, for a checkpoint
    without its config, a differing fingerprint."""
    if isinstance(meta.get('config'), dict):
      defaults = ExperimentConfig().to_json()  # for fields added since the checkpoint
      return config_diff(meta['config'], self.config.to_json(), defaults=defaults)
    fingerprint = self.config.fingerprint()
    if meta.get('fingerprint') == fingerprint:
      return []
    return [f'fingerprint {meta.get("fingerprint")} -> {fingerprint}']

  def _skip_checkpoint(self, step: int, reason: str) -> None:
    line = f'checkpoint step {step} in {self.workdir} is unreadable ({reason}): skipped'
    logging.warning('%s', line)
    self.log(line)

  def restore(
    self, point: ResumePoint, abstract_state: Callable[[ParallelConfig], Any]
  ) -> Restored:
    """Restores the newest checkpoint of `point` that reads and verifies (older ones if it
    does not), onto the layout `abstract_state(train layout)` describes; later steps that did
    not restore are kept aside (so that this run can save those steps again)."""
    ckpt = self.checkpointer
    assert ckpt is not None  # opened with resume
    step, state, meta = ckpt.restore_newest_readable(
      lambda meta: abstract_state(ParallelConfig.parse(meta['train_config'])),
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
    restored = Restored(
      step=step,
      state=state,
      train_config=ParallelConfig.parse(meta['train_config']),
      selector_state=meta['selector'],
      prev_stats=meta['prev_stats'],
      rows=rows,
    )
    self.log(f'resumed from step {step} ({ckpt.directory})')
    return restored

  def save(
    self,
    step: int,
    state: Any,
    *,
    selector_state: dict,
    train_config: ParallelConfig,
    prev_stats: dict | None,
    profile: dict | None,
  ) -> None:
    """Saves the train state at `step` with what a resume needs to decide as this run would
    (asynchronously; `wait` before exiting). Nothing when the run keeps no checkpoints."""
    if self.checkpointer is None:
      return
    meta = {
      'step': step,
      'fingerprint': self.config.fingerprint(),
      'config': self.config.to_json(),
      'selector': selector_state,
      'train_config': train_config.name,
      'prev_stats': prev_stats,
      'profile': profile,
    }
    self.checkpointer.save(step, state, meta)

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
  workdir: str, config: ExperimentConfig, resume: bool
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
    fd, probe = tempfile.mkstemp(dir=existing, prefix='.earl_write_check_')
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise WorkdirError(
      f'--workdir {workdir} is not writable ({e.strerror} in {existing}): expected a folder '
      'this process can write.'
    ) from None


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


@dataclasses.dataclass(frozen=True)
class WorkdirLock:
  """A workdir's lock, held by this process (`acquire`, then `release`).

  Attributes:
    path: `<workdir>/.lock`.
    text: what this process wrote there (a lock that reads otherwise is someone else's).
    created: the folders `acquire` made for it, outermost first (removed again by `release`
      where the run left them empty).
  """

  path: str
  text: str
  created: tuple[str, ...] = ()

  @classmethod
  def acquire(cls, workdir: str, *, log: Callable[[str], None]) -> 'WorkdirLock':
    """Creates `<workdir>/.lock` (O_CREAT | O_EXCL: of two runs one wins), making the workdir if
    missing. A lock there already refuses unless its owner is gone (`_clear_stale`).

    Raises:
      WorkdirError: a live run, or another host's, holds the workdir; or the lock cannot be
        written.
    """
    created = _makedirs(workdir)
    path = os.path.join(workdir, LOCK)
    now = time.time()
    started = time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))
    text = json.dumps(
      {'host': socket.gethostname(), 'pid': os.getpid(), 'started': started, 'time': now}
    )
    try:
      for _ in range(3):  # a stale lock cleared, then raced for
        try:
          fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
          _clear_stale(workdir, path, log)
          continue
        lock = cls(path=path, text=text, created=created)
        lock._write(fd, workdir)
        atexit.register(lock.release)
        return lock
      raise WorkdirError(
        f'--workdir {workdir}: other runs keep taking its lock {path}: expected one run per '
        'workdir; pass another --workdir.'
      )
    except BaseException:
      _remove_empty(created)
      raise

  def _write(self, fd: int, workdir: str) -> None:
    try:
      with os.fdopen(fd, 'w') as f:
        f.write(self.text)
    except OSError as e:
      os.remove(self.path)
      raise WorkdirError(
        f'--workdir {workdir}: cannot write its lock {self.path} ({e.strerror}): expected a '
        'folder this process can write.'
      ) from None

  def release(self) -> None:
    """Removes the lock if it is still this process's, then the folders `acquire` made that
    the run left empty. Never raises; calling it again does nothing more."""
    atexit.unregister(self.release)
    try:
      with open(self.path) as f:
        mine = f.read() == self.text
      if mine:
        os.remove(self.path)
    except OSError:
      pass  # gone already, or the workdir was moved
    _remove_empty(self.created)


def _makedirs(workdir: str) -> tuple[str, ...]:
  """Makes `workdir` and its missing parents; returns those it made, outermost first."""
  missing, path = [], os.path.abspath(workdir)
  while not os.path.exists(path):
    missing.append(path)
    path = os.path.dirname(path)
  os.makedirs(workdir, exist_ok=True)
  return tuple(reversed(missing))


def _remove_empty(folders: tuple[str, ...]) -> None:
  for folder in reversed(folders):
    try:
      os.rmdir(folder)
    except OSError:  # not empty (the run wrote there), or gone
      return


def _clear_stale(workdir: str, path: str, log: Callable[[str], None]) -> None:
  """Removes the lock at `path` if its owner is gone (logged in one line) or is this process (a
  second `RunDir.open` of it); else raises WorkdirError naming the owner."""
  owner, age = _read_lock(workdir, path)
  if age is None:
    return  # released meanwhile
  if owner is None:
    if age < _UNREADABLE_LOCK_S:
      raise WorkdirError(
        f'--workdir {workdir}: another run is taking its lock {path} right now: expected one '
        'run per workdir; pass another --workdir.'
      )
    gone = f'an unreadable lock {age:.0f} s old'
  else:
    gone = _gone(workdir, path, owner)
  if gone:
    log(f'--workdir {workdir}: took over the lock of a run that is gone ({gone}).')
  with contextlib.suppress(FileNotFoundError):
    os.remove(path)


def _read_lock(workdir: str, path: str) -> tuple[dict | None, float | None]:
  """The lock's owner (None: it does not parse) and age in seconds (None: there is no lock)."""
  try:
    age = time.time() - os.path.getmtime(path)
    with open(path, 'rb') as f:
      data = f.read()
  except FileNotFoundError:
    return None, None
  except OSError as e:
    raise WorkdirError(
      f'--workdir {workdir}: cannot read its lock {path} ({e.strerror}): expected a folder '
      'this process can read and write.'
    ) from None
  try:
    owner = json.loads(data.decode('utf-8'))
  except ValueError:
    return None, age
  ok = isinstance(owner, dict) and isinstance(owner.get('pid'), int) and owner['pid'] > 0
  return (owner if ok else None), age


def _gone(workdir: str, path: str, owner: dict) -> str:
  """Why the lock's owner is gone ('' for this process's own lock); raises WorkdirError while
  it lives, or when it is another host's."""
  pid, host = owner['pid'], owner.get('host')
  who = f'host {host}, pid {pid}, started {owner.get("started")}'
  if host != socket.gethostname():
    raise WorkdirError(
      f'--workdir {workdir} is locked by a run on another host ({who}), which this host cannot '
      f'check: expected one run per workdir; if that run is over, delete {path} and run again.'
    )
  if pid == os.getpid():
    return ''
  if not _alive(pid):
    return f'{who}: no such process'
  # The owner started before it wrote the lock; a process started later reuses a dead one's pid.
  since, locked = _process_start(pid), owner.get('time')
  if since is not None and isinstance(locked, (int, float)) and since > locked + 2:
    return f'{who}: pid {pid} is now a process started later'
  raise WorkdirError(
    f'--workdir {workdir} is in use by a live run ({who}): expected one run per workdir; wait '
    'for it to end, stop it, or pass another --workdir.'
  )


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  except (OverflowError, OSError):
    return False
  return True


def _process_start(pid: int) -> float | None:
  """When process `pid` started (epoch seconds, to about a second), where /proc tells."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])  # field 22, starttime
    with open('/proc/stat') as f:
      boot = next(int(line.split()[1]) for line in f if line.startswith('btime '))
    return boot + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError, StopIteration):
    return None
