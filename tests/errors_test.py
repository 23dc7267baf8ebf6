import errno

from earl_jax import errors


def test_the_errno_of_a_storage_failure_is_found_through_causes_and_quoted_messages():
  wrapped = RuntimeError('the save failed')
  wrapped.__cause__ = OSError(errno.EROFS, 'Read-only file system')
  assert errors.os_errno(wrapped) == errno.EROFS
  # TensorStore (under Orbax) only quotes it.
  quoted = ValueError("RESOURCE_EXHAUSTED: Failed to write 72422 bytes [os_error_code='28']")
  assert errors.os_errno(quoted) == errno.ENOSPC
  assert errors.os_errno(ValueError('shapes do not match')) is None
  assert errors.os_errno(OSError(errno.ENOENT, 'No such file or directory')) is None


def test_a_storage_error_is_one_line_naming_the_path_and_the_os_error():
  e = errors.storage_error(
    OSError(errno.ENOSPC, 'No space left on device: 2044 KiB needed, 276 KiB free'),
    'checkpoint step 2',
    '/runs/a/checkpoints',
    'the checkpoints already complete are kept (newest: step 1)',
  )
  assert isinstance(e, errors.StorageError) and isinstance(e, errors.UserError)
  assert str(e).startswith(
    'checkpoint step 2 could not be written to /runs/a/checkpoints: No space left on device: '
    '2044 KiB needed, 276 KiB free (ENOSPC); the checkpoints already complete are kept (newest: '
    'step 1): expected'
  )
  assert '\n' not in str(e)
  assert errors.storage_error(ValueError('a bug'), 'x', '/p', 'k') is None
