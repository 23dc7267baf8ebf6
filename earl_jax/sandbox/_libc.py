"""The two system calls the launcher needs that `os` lacks, mount(2) and prctl(2), via ctypes."""

import ctypes
import os

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mount.argtypes = [
  ctypes.c_char_p,
  ctypes.c_char_p,
  ctypes.c_char_p,
  ctypes.c_ulong,
  ctypes.c_char_p,
]
_LIBC.prctl.argtypes = [
  ctypes.c_int,
  ctypes.c_ulong,
  ctypes.c_ulong,
  ctypes.c_ulong,
  ctypes.c_ulong,
]


def prctl(option, value):
  """prctl(option, value); OSError if it fails."""
  if _LIBC.prctl(option, value, 0, 0, 0) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f'prctl({option}): {os.strerror(err)}')


def mount(source, target, fstype, flags, data=None):
  """mount(2) (None for an argument it does not need); OSError if it fails."""

  def enc(s):
    return None if s is None else s.encode()

  if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f'mount {target}: {os.strerror(err)}')
