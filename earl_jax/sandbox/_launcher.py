"""The sandbox's launcher: stdlib only, never imported by JAX; its parts live in sibling modules.

`earl_jax.sandbox.Sandbox` starts this file as a fresh process, `python -I -S _launcher.py CONFIG`
(under `unshare --pid --fork --kill-child --mount-proc --net --mount --ipc` where the machine allows
it), so nothing here was ever forked from a JAX process. Three kinds of process run this code:

- The launcher (one): sets up the mount namespace (`_mounts`), imports the modules programs
  commonly use, forks one worker per slot, and routes jobs from the trusted parent (frames on its
  stdin, `_wire`) to idle workers and results back on its stdout (`_pool`). A worker that dies is
  replaced and its job answered as a crash. Stdin at EOF: kill all.
- A worker (one per slot; single-threaded, never runs untrusted code; `_worker`): for each job
  makes a fresh private directory, forks the program, supervises it (`_supervise`: deadlines per
  test and per program, the memory of its processes, capped output), then kills and reaps
  everything the program started (`_processes`) and deletes the directory.
- The program (one per job, forked from its worker; `_program`): confines itself in named steps
  (`_containment`: a new session, rlimits, an unprivileged uid when root, no_new_privs, a fixed
  environment); then it runs the candidate's source as module `main` and answers the test calls
  one at a time over a pipe (fd 3), each return value encoded with its type (plain types only).
  It never sees the expected values: the trusted parent compares.

The program may write anything to its result pipe; the worker accepts only well-formed frames for
the call it asked for, and the parent decodes only plain values.
"""

# Some of these imports are unused here: they are preloaded so that every forked program gets
# them for free (a fresh `import typing` alone costs milliseconds).
import bisect  # noqa: F401
import contextlib
import copy  # noqa: F401
import functools  # noqa: F401
import gc
import hashlib  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import random  # noqa: F401
import signal
import string  # noqa: F401
import sys
import typing  # noqa: F401

# Run as a file under -I, so this directory is not on sys.path: the launcher's modules (which
# import each other by plain name) are imported from it, then dropped from sys.path and
# sys.modules, so that a program's own `_wire.py` (say) is still its own.
_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_MODULES = (
  '_containment',
  '_libc',
  '_mounts',
  '_pool',
  '_processes',
  '_program',
  '_supervise',
  '_wire',
  '_worker',
)
sys.path.insert(0, _HERE)
try:
  import _libc
  import _mounts
  import _pool
  import _wire
finally:
  sys.path.remove(_HERE)
for _name in _OWN_MODULES:
  sys.modules.pop(_name, None)


def _take_channel():
  """Moves the channel to the parent off fds 0/1, so nothing can write into it by accident;
  returns (channel_in, channel_out)."""
  channel_in, channel_out = os.dup(0), os.dup(1)
  null = os.open(os.devnull, os.O_RDWR)
  os.dup2(null, 0)
  os.dup2(2, 1)
  os.close(null)
  return channel_in, channel_out


def _ready_frame(pool, config):
  """The frame that tells the parent the pool is up: the uids, the private base, and what hides
  the interpreter from the programs' uid (limits only)."""
  hidden = None
  if not config['namespaces'] and pool.uids[0] is not None:
    hidden = _mounts.blocked_ancestor(os.path.realpath(sys.base_prefix))
  return {
    'op': 'ready',
    'uids': pool.uids,
    'base': pool.private_base,
    'pid': os.getpid(),
    'interpreter_hidden_by': hidden,
  }


def main():
  config = json.loads(sys.argv[1])
  channel_in, channel_out = _take_channel()
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle
  _libc.prctl(_libc.PR_SET_CHILD_SUBREAPER, 1)
  pool = _pool.WorkerPool(config, channel_in, channel_out)
  try:
    pool.setup()
  except Exception as e:
    _wire.write_frame(channel_out, {'op': 'fatal', 'message': f'{type(e).__name__}: {e}'})
    pool.shutdown()
    return 1
  gc.collect()
  gc.freeze()  # forked programs then share these pages instead of copying them on first touch
  _wire.write_frame(channel_out, _ready_frame(pool, config))
  try:
    pool.loop()
  except Exception as e:
    with contextlib.suppress(OSError):
      _wire.write_frame(channel_out, {'op': 'fatal', 'message': f'{type(e).__name__}: {e}'})
    pool.shutdown()
    return 1
  pool.shutdown()
  return 0


if __name__ == '__main__':
  sys.exit(main())
