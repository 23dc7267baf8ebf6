"""Errors a user can fix: bad flags, configs, checkpoints, model directories, meshes.

Entry points (`earl_jax.runtime.run`) end the program on a `UserError` with one line,
`error: <message>`, and exit code 2, the `absl.app.UsageError` convention, instead of a traceback;
`--debug` shows the traceback. Every other exception is an internal error and keeps its traceback.
Each `UserError` subclasses `ValueError`, so code that catches `ValueError` keeps working.
"""

import errno
import os
import re


class UserError(ValueError):
  """An input the user can fix; its message names the bad value and what was expected."""


class ConfigError(UserError):
  """A config field, or a combination of fields, that cannot run."""


class StorageError(UserError):
  """A file the run could not write: the disk is full, read-only, or not this process's."""


# Where a storage failure's errno shows: an OSError in the exception's chain, or TensorStore's
# message (Orbax writes arrays through it, which reports "[os_error_code='28']").
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


def os_errno(error: BaseException) -> int | None:
  """The errno of the storage failure behind `error` (through its causes and contexts, and
  the messages of libraries that only quote it), or None when it is none of those."""
  seen: set[int] = set()
  e: BaseException | None = error
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
      return e.errno
    match = _OS_ERROR_CODE.search(str(e))
    if match and int(match.group(1)) in _STORAGE_ERRNOS:
      return int(match.group(1))
    for code in _STORAGE_ERRNOS:
      if os.strerror(code) in str(e):
        return code
    e = e.__cause__ or e.__context__
  return None


def storage_error(error: BaseException, what: str, path: str, kept: str) -> StorageError | None:
  """A one-line StorageError for `error` when a storage failure is behind it, else None.

  Args:
    error: what the write raised.
    what: what was being written ('checkpoint step 4').
    path: where.
    kept: what is safe ('the checkpoints already complete are kept').
  """
  code = os_errno(error)
  if code is None:
    return None
  detail = error.strerror if isinstance(error, OSError) and error.strerror else os.strerror(code)
  return StorageError(
    f'{what} could not be written to {path}: {detail} ({errno.errorcode[code]}); '
    f'{kept}: expected a folder with free space that this process can write (free space or '
    'fix the folder, then --resume).'
  )
