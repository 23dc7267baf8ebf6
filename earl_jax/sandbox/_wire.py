"""The sandbox's wire protocol: the one definition the trusted parent and the launcher share.

Two frame formats travel between the sandbox's processes:

- Job frames (parent <-> launcher <-> worker): a 4-byte big-endian length, then UTF-8 JSON.
- Result frames (program -> worker, on the program's fd 3): `RESULT_HEADER` (payload length, test
  index, kind), then the payload. The program sends them in order: the setup frame (index -2),
  the module load (index -1), then one per test call (0, 1, ...).

A test's return value travels encoded with its type (`encode_value`); `values.py` decodes it.
Stdlib only, and it imports nothing of ours: the parent imports it as `earl_jax.sandbox._wire`,
the launcher (a `python -I -S` process) as `_wire`.
"""

import json
import os
import struct

# Parent <-> launcher <-> worker frames: 4-byte big-endian length, then UTF-8 JSON.
FRAME_HEADER = struct.Struct('>I')
MAX_JOB_BYTES = 1 << 30

# Program -> worker result frames: payload length, test index, kind.
RESULT_HEADER = struct.Struct('>IiB')
RESULT_FD = 3  # the program's end of its result pipe
INDEX_SETUP = -2  # the setup frame's index
INDEX_LOAD = -1  # the module load's index
KIND_LOADED = 0  # payload: empty
KIND_LOAD_ERROR = 1  # payload: JSON [exception type name, last line of the message]
KIND_VALUE = 2  # payload: the return value, encoded (see `encode_value`)
KIND_EXCEPTION = 3  # payload: JSON [exception type name, last line of the message]
KIND_UNSUPPORTED = 4  # payload: JSON [type name]: the return value is not a plain value
KIND_SETUP = 5  # index -2, payload empty: limits and uid are in place; untrusted code starts next
KINDS = (KIND_LOADED, KIND_LOAD_ERROR, KIND_VALUE, KIND_EXCEPTION, KIND_UNSUPPORTED, KIND_SETUP)
TEST_KINDS = (KIND_VALUE, KIND_EXCEPTION, KIND_UNSUPPORTED)  # the answers to a test call
EXIT_MEMORY = 86  # the program's runner exits with this code when it cannot even report MemoryError

# ---------------------------------------------------------------------------------------------
# Job frames.


def encode_frame(obj):
  """`obj` as one job frame (length, then compact JSON)."""
  data = json.dumps(obj, separators=(',', ':')).encode()
  return FRAME_HEADER.pack(len(data)) + data


def decode_frame(data):
  """The object a job frame's body holds."""
  return json.loads(data)


def write_all(fd, data):
  """Writes all of `data` to `fd` (blocking)."""
  view = memoryview(data)
  while view:
    n = os.write(fd, view)
    view = view[n:]


def write_frame(fd, obj):
  """Writes `obj` to `fd` as one job frame (blocking)."""
  write_all(fd, encode_frame(obj))


def _read_exact(fd, n):
  chunks, left = [], n
  while left:
    chunk = os.read(fd, min(left, 1 << 20))
    if not chunk:
      return None
    chunks.append(chunk)
    left -= len(chunk)
  return b''.join(chunks)


def read_frame(fd):
  """Reads one frame (blocking); None at EOF."""
  header = _read_exact(fd, FRAME_HEADER.size)
  if header is None:
    return None
  (size,) = FRAME_HEADER.unpack(header)
  if size > MAX_JOB_BYTES:
    raise ValueError(f'frame of {size} bytes')
  data = _read_exact(fd, size)
  if data is None:
    return None
  return decode_frame(data)


def take_frames(buffer):
  """Removes every complete job frame from the front of `buffer` (a bytearray); returns them."""
  frames = []
  while len(buffer) >= FRAME_HEADER.size:
    (size,) = FRAME_HEADER.unpack_from(buffer)
    if len(buffer) < FRAME_HEADER.size + size:
      break
    frames.append(decode_frame(bytes(buffer[FRAME_HEADER.size : FRAME_HEADER.size + size])))
    del buffer[: FRAME_HEADER.size + size]
  return frames


class FrameReader:
  """Non-blocking frame assembly for the launcher's poll loop."""

  def __init__(self, fd):
    self.fd = fd
    self.buffer = bytearray()

  def read(self):
    """Returns (frames, eof)."""
    try:
      chunk = os.read(self.fd, 1 << 20)
    except BlockingIOError:
      return [], False
    if chunk:
      self.buffer += chunk
    return take_frames(self.buffer), not chunk


# ---------------------------------------------------------------------------------------------
# Result frames and their payloads (written inside the program).


def result_frame(index, kind, payload=b''):
  """One result frame: the header, then `payload`."""
  return RESULT_HEADER.pack(len(payload), index, kind) + payload


class UnsupportedError(Exception):
  """A return value that is not a plain value (a user class, a subclass) or nests too deep."""


def encode_value(value, depth=0):
  """A plain value as JSON-able tagged lists; anything else (a user class, a subclass) refused."""
  if depth > 100:
    raise UnsupportedError('nesting deeper than 100')
  kind = type(value)
  if value is None:
    return ['n']
  if kind is bool:
    return ['b', value]
  if kind is int:
    return ['i', hex(value)]
  if kind is float:
    return ['f', value.hex()]
  if kind is complex:
    return ['c', value.real.hex(), value.imag.hex()]
  if kind is str:
    return ['s', value]
  if kind is bytes:
    return ['y', value.hex()]
  tags = {list: 'l', tuple: 't', set: 'S', frozenset: 'Z'}
  if kind in tags:
    return [tags[kind], [encode_value(item, depth + 1) for item in value]]
  if kind is dict:
    return [
      'd',
      [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in value.items()],
    ]
  raise UnsupportedError(f'{kind.__module__}.{kind.__qualname__}')


def exception_payload(error):
  """An exception as its payload: JSON [type name, the last line of its message]."""
  try:
    text = str(error)
  except BaseException:
    text = '<unprintable>'
  lines = [line for line in text.strip().splitlines() if line.strip()]
  name = type(error).__name__
  return json.dumps([name, (lines[-1] if lines else '')[:1000]]).encode()
