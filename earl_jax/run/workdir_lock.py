"""One run per workdir: `<workdir>/.lock`, holding its owner's host, PID and start time.

`WorkdirLock.acquire` creates it atomically (O_CREAT | O_EXCL) before a run writes anything, and
`release` removes it (an atexit hook does, should the run end otherwise). A lock whose owner
lives refuses the run in one line; one whose owner is gone (same host, no such process, or a PID
reused by a later process) is taken over, with a line in the log; another host's is refused with
how to remove it, since this host cannot tell whether that process lives.

  lock = WorkdirLock.acquire('runs/default', log=print)   # WorkdirError while another run lives
  lock.release()
"""

import atexit
import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable

from earl_jax.errors import UserError

# The workdir's lock: JSON {host, pid, started (UTC, for people), time (epoch seconds)}.
LOCK = '.lock'
# A lock file that does not parse is one being written (for microseconds) or one whose writer
# died before it wrote (or found the disk full): taken over once it is this old.
_UNREADABLE_LOCK_S = 10.0


class WorkdirError(UserError):
  """A workdir that cannot be written, or that holds another run."""


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
