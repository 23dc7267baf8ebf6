"""How a program is confined: its limits and environment, and `STEPS`, applied in order.

Made once for the launcher, before any program: the namespaces (PID, network, mount, IPC:
`unshare`, from sandbox.py) and the read-only view of the file system (`_mounts.py`). Then each
program, forked from its worker, applies `STEPS` to itself (`contain`) and reports its setup
frame; no untrusted code runs before that.
"""

import os
import resource
import signal
import sys
import typing

import _libc


class Confinement(typing.NamedTuple):
  """What the steps apply: the program's directory, uid (None: not root), rlimits, environment."""

  workdir: str
  uid: int | None
  limits: list
  env: dict


def rlimits(config, uid):
  """The (resource, value) limits of each program (RLIMIT_NPROC only with a uid of its own)."""
  limits = [
    (resource.RLIMIT_CPU, int(config['cpu_s'])),
    (resource.RLIMIT_AS, int(config['memory_mib']) << 20),
    (resource.RLIMIT_FSIZE, int(config['file_mib']) << 20),
    (resource.RLIMIT_NOFILE, int(config['open_files'])),
    (resource.RLIMIT_CORE, 0),
  ]
  if uid is not None:  # counted per real uid: only meaningful for a uid of our own
    limits.append((resource.RLIMIT_NPROC, int(config['max_processes'])))
  return limits


def environment(workdir):
  """The fixed environment of a program whose directory is `workdir`."""
  return {
    'PATH': '/usr/local/bin:/usr/bin:/bin',
    'HOME': workdir,
    'TMPDIR': workdir,
    'LANG': 'C.UTF-8',
    'LC_ALL': 'C.UTF-8',
    'PYTHONDONTWRITEBYTECODE': '1',
    'PYTHONIOENCODING': 'utf-8',
    'OMP_NUM_THREADS': '1',
    'OPENBLAS_NUM_THREADS': '1',
    'MKL_NUM_THREADS': '1',
  }


def become(uid):
  """Drops to `uid` (its own group, no supplementary groups) for good."""
  os.setgroups([])
  os.setgid(uid)
  os.setuid(uid)


def new_session(confinement):
  """A session and process group of its own: the worker kills the whole group."""
  os.setsid()


def default_signals(confinement):
  """The signals the launcher handles back to their defaults (SIGINT raises KeyboardInterrupt)."""
  for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
    signal.signal(sig, signal.SIG_DFL)
  signal.signal(signal.SIGINT, signal.default_int_handler)


def enter_workdir(confinement):
  """Into the program's fresh private directory."""
  os.chdir(confinement.workdir)


def apply_rlimits(confinement):
  """Every rlimit, soft = hard (the CPU's hard limit a second later, so SIGXCPU comes first)."""
  for name, value in confinement.limits:
    resource.setrlimit(name, (value, value if name != resource.RLIMIT_CPU else value + 1))


def drop_to_uid(confinement):
  """An unprivileged uid of the worker's own (when root)."""
  if confinement.uid is not None:
    become(confinement.uid)


def forbid_new_privileges(confinement):
  """no_new_privs: no setuid binary can give privileges back."""
  _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)


def die_with_worker(confinement):
  """SIGKILL when the worker dies."""
  _libc.prctl(_libc.PR_SET_PDEATHSIG, signal.SIGKILL)


def fixed_environment(confinement):
  """The fixed environment, argv ['main.py'], and no bytecode written."""
  os.environ.clear()
  os.environ.update(confinement.env)
  sys.argv = ['main.py']
  sys.dont_write_bytecode = True


STEPS = (
  new_session,
  default_signals,
  enter_workdir,
  apply_rlimits,
  drop_to_uid,
  forbid_new_privileges,
  die_with_worker,
  fixed_environment,
)


def contain(confinement):
  """Applies every step of `STEPS` to this process, in order."""
  for step in STEPS:
    step(confinement)
