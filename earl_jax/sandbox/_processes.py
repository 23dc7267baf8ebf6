"""The process tree below a worker or the launcher: listing it, summing its memory, killing it
and reaping it (both are subreapers: whatever their programs leave running comes back to them)."""

import contextlib
import os
import signal

import _containment

_PAGE = os.sysconf('SC_PAGE_SIZE')


def children(pid):
  """The direct children of `pid` ([] if it is gone)."""
  try:
    with open(f'/proc/{pid}/task/{pid}/children') as f:
      return [int(p) for p in f.read().split()]
  except OSError:
    return []


def tree_rss(root):
  """Resident bytes of every process below `root` (a worker: its program's processes, and the
  orphans reparented to it). Pages shared after a fork count once per process."""
  total, stack, seen = 0, children(root), set()
  while stack:
    pid = stack.pop()
    if pid in seen:
      continue
    seen.add(pid)
    try:
      with open(f'/proc/{pid}/statm') as f:
        total += int(f.read().split()[1]) * _PAGE
      for tid in os.listdir(f'/proc/{pid}/task'):
        with open(f'/proc/{pid}/task/{tid}/children') as f:
          stack.extend(int(p) for p in f.read().split())
    except (OSError, ValueError, IndexError):
      continue
  return total


def kill_uid(uid):
  """SIGKILLs every process of `uid` (atomically for the kernel: a fork bomb cannot outrun it)."""
  pid = os.fork()
  if pid == 0:
    try:
      _containment.become(uid)
      os.kill(-1, signal.SIGKILL)  # as `uid`: reaches only `uid`'s processes (not this one)
    except BaseException:
      pass
    os._exit(0)
  os.waitpid(pid, 0)


def reap_all():
  """Reaps every child that has exited (without waiting for the others)."""
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return


def kill_leftovers(uid):
  """Kills and reaps every descendant of this process (a subreaper: orphans come back to it);
  False if some are still there after 1000 rounds."""
  me = os.getpid()
  for _ in range(1000):
    leftover = children(me)
    if uid is not None and leftover:
      kill_uid(uid)
    if not leftover:
      reap_all()
      return True
    for pid in leftover:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for pid in leftover:
      with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
  return False
