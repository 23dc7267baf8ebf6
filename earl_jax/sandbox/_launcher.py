"""The sandbox's launcher, its workers and the program runner: stdlib only, never imported by JAX.

`earl_jax.sandbox.Sandbox` starts this file as a fresh process, `python -I -S _launcher.py CONFIG`
(under `unshare --pid --fork --kill-child --mount-proc --net --mount --ipc` where the machine allows
it), so nothing here was ever forked from a JAX process. Three kinds of process run this code:

- The launcher (one): sets up the mount namespace (everything read-only, a private tmpfs per worker
  under /tmp), imports the modules programs commonly use, forks one worker per slot, and routes
  jobs from the trusted parent (framed JSON on its stdin) to idle workers and results back (on its
  stdout). A worker that dies is replaced and its job answered as a crash. Stdin at EOF: kill all.
- A worker (one per slot; single-threaded, never runs untrusted code): for each job makes a fresh
  private directory, forks the program, supervises it (wall-clock deadlines per test and per
  program, capped output), then kills and reaps everything the program started and deletes the
  directory.
- The program (one per job, forked from its worker): a new session, rlimits, an unprivileged uid
  (when root) with no_new_privs, a fixed environment; then it runs the candidate's source as module
  `main` and answers the test calls one at a time over a pipe (fd 3), each return value encoded
  with its type (plain types only). It never sees the expected values: the trusted parent compares.

The program may write anything to its result pipe; the worker accepts only well-formed frames for
the call it asked for, and the parent decodes only plain values.
"""

# Some of these imports are unused here: they are preloaded so that every forked program gets
# them for free (a fresh `import typing` alone costs milliseconds).
import bisect  # noqa: F401
import collections
import contextlib
import copy  # noqa: F401
import ctypes
import errno
import functools  # noqa: F401
import gc
import hashlib  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import random  # noqa: F401
import re
import resource
import select
import shutil
import signal
import string  # noqa: F401
import struct
import sys
import tempfile
import time
import types
import typing  # noqa: F401

# Child -> worker result frames: payload length, test index (-1: the module load), kind.
RESULT_HEADER = struct.Struct('>IiB')
KIND_LOADED = 0  # payload: empty
KIND_LOAD_ERROR = 1  # payload: JSON [exception type name, last line of the message]
KIND_VALUE = 2  # payload: the return value, encoded (see `encode_value`)
KIND_EXCEPTION = 3  # payload: JSON [exception type name, last line of the message]
KIND_UNSUPPORTED = 4  # payload: JSON [type name]: the return value is not a plain value
KIND_SETUP = 5  # index -2, payload empty: limits and uid are in place; untrusted code starts next
_KINDS = (KIND_LOADED, KIND_LOAD_ERROR, KIND_VALUE, KIND_EXCEPTION, KIND_UNSUPPORTED, KIND_SETUP)
EXIT_MEMORY = 86  # the program's runner exits with this code when it cannot even report MemoryError

# Parent <-> launcher <-> worker frames: 4-byte big-endian length, then UTF-8 JSON.
_FRAME_HEADER = struct.Struct('>I')
_MAX_JOB_BYTES = 1 << 30

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_MOVE = 32, 1024, 2048, 4096, 8192
_MS_REC, _MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_MOUNT_FLAGS = {
  'nosuid': _MS_NOSUID,
  'nodev': _MS_NODEV,
  'noexec': _MS_NOEXEC,
  'noatime': _MS_NOATIME,
  'nodiratime': _MS_NODIRATIME,
  'relatime': _MS_RELATIME,
  'strictatime': _MS_STRICTATIME,
}
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 36, 38

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


def _prctl(option, value):
  if _LIBC.prctl(option, value, 0, 0, 0) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f'prctl({option}): {os.strerror(err)}')


def _mount(source, target, fstype, flags, data=None):
  def enc(s):
    return None if s is None else s.encode()

  if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f'mount {target}: {os.strerror(err)}')


# ---------------------------------------------------------------------------------------------
# Framing.


def write_frame(fd, obj):
  data = json.dumps(obj, separators=(',', ':')).encode()
  _write_all(fd, _FRAME_HEADER.pack(len(data)) + data)


def _write_all(fd, data):
  view = memoryview(data)
  while view:
    n = os.write(fd, view)
    view = view[n:]


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
  header = _read_exact(fd, _FRAME_HEADER.size)
  if header is None:
    return None
  (size,) = _FRAME_HEADER.unpack(header)
  if size > _MAX_JOB_BYTES:
    raise ValueError(f'frame of {size} bytes')
  data = _read_exact(fd, size)
  if data is None:
    return None
  return json.loads(data)


class _FrameReader:
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
    frames = []
    if chunk:
      self.buffer += chunk
    while len(self.buffer) >= _FRAME_HEADER.size:
      (size,) = _FRAME_HEADER.unpack_from(self.buffer)
      if len(self.buffer) < _FRAME_HEADER.size + size:
        break
      frames.append(json.loads(bytes(self.buffer[_FRAME_HEADER.size : _FRAME_HEADER.size + size])))
      del self.buffer[: _FRAME_HEADER.size + size]
    return frames, not chunk


# ---------------------------------------------------------------------------------------------
# The program (runs untrusted code; everything below `_program_main` is inside the sandbox).


class _UnsupportedError(Exception):
  pass


def encode_value(value, depth=0):
  """A plain value as JSON-able tagged lists; anything else (a user class, a subclass) refused."""
  if depth > 100:
    raise _UnsupportedError('nesting deeper than 100')
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
  raise _UnsupportedError(f'{kind.__module__}.{kind.__qualname__}')


def _last_line(error):
  try:
    text = str(error)
  except BaseException:
    text = '<unprintable>'
  lines = [line for line in text.strip().splitlines() if line.strip()]
  name = type(error).__name__
  return [name, (lines[-1] if lines else '')[:1000]]


def _report(index, kind, payload=b''):
  _write_all(3, RESULT_HEADER.pack(len(payload), index, kind) + payload)


def _flush_output():
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(BaseException):
      stream.flush()


def _program_main(job, workdir, uid, limits, env):
  """The forked program: drop privileges, then load the source and answer calls. Never returns."""
  try:
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
      signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(workdir)
    for name, value in limits:
      resource.setrlimit(name, (value, value if name != resource.RLIMIT_CPU else value + 1))
    if uid is not None:
      os.setgroups([])
      os.setgid(uid)
      os.setuid(uid)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ['main.py']
    sys.dont_write_bytecode = True
    # Only after this frame does anything untrusted run: a program that dies before it is our
    # failure (the parent raises SandboxError), one that dies after it is the program's.
    _report(-2, KIND_SETUP)
  except BaseException:
    os._exit(1)
  if job['op'] == 'command':
    argv = list(job['argv'])
    if argv[0] == 'python':
      argv = [sys.executable, '-I', '-S', '-B', *argv[1:]]
    try:
      for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)  # Python ignores these; a fresh program should not
      os.close(3)
      os.execvpe(argv[0], argv, env)
    except OSError as e:
      os.write(2, f'cannot run {argv[0]!r}: {e.strerror}\n'.encode())
    os._exit(127)
  try:
    _run_program(job['source'], job['calls'], workdir)
  except MemoryError:
    os._exit(EXIT_MEMORY)
  except BaseException:
    pass
  os._exit(0)


def _run_program(source, calls, workdir):
  sys.path.insert(0, workdir)
  module = types.ModuleType('main')
  module.__file__ = os.path.join(workdir, 'main.py')
  sys.modules['main'] = module
  try:
    exec(compile(source, module.__file__, 'exec'), module.__dict__)
  except BaseException as e:  # SystemExit and KeyboardInterrupt included: a load that did not end
    _flush_output()
    _report(-1, KIND_LOAD_ERROR, json.dumps(_last_line(e)).encode())
    return
  _flush_output()
  _report(-1, KIND_LOADED)
  for index, call in enumerate(calls):
    try:
      value = eval(compile(call, '<test>', 'eval'), module.__dict__)
    except BaseException as e:
      _flush_output()
      _report(index, KIND_EXCEPTION, json.dumps(_last_line(e)).encode())
      continue
    try:
      payload = json.dumps(encode_value(value), separators=(',', ':')).encode()
      kind = KIND_VALUE
    except _UnsupportedError as e:
      payload, kind = json.dumps([str(e)]).encode(), KIND_UNSUPPORTED
    except RecursionError:
      payload, kind = json.dumps(['nesting too deep to encode']).encode(), KIND_UNSUPPORTED
    _flush_output()
    _report(index, kind, payload)


# ---------------------------------------------------------------------------------------------
# The worker (trusted; supervises one program at a time).


class _CappedOutput:
  """Keeps the first and the last `cap // 2` bytes of a stream and counts the rest."""

  def __init__(self, cap):
    self.half = max(cap // 2, 1)
    self.head = bytearray()
    self.tail = bytearray()
    self.total = 0

  def add(self, chunk):
    self.total += len(chunk)
    room = self.half - len(self.head)
    if room > 0:
      self.head += chunk[:room]
      chunk = chunk[room:]
    if chunk:
      self.tail += chunk
      if len(self.tail) > 2 * self.half:
        del self.tail[: len(self.tail) - self.half]

  def text(self):
    tail = bytes(self.tail[-self.half :])
    omitted = self.total - len(self.head) - len(tail)
    middle = f'\n... [{omitted} bytes omitted] ...\n'.encode() if omitted > 0 else b''
    return (bytes(self.head) + middle + tail).decode('utf-8', errors='replace')


def _children(pid):
  try:
    with open(f'/proc/{pid}/task/{pid}/children') as f:
      return [int(p) for p in f.read().split()]
  except OSError:
    return []


_PAGE = os.sysconf('SC_PAGE_SIZE')
MEMORY_SAMPLE_S = 0.1  # how often the resident memory of a running program's processes is summed


def _tree_rss(root):
  """Resident bytes of every process below `root` (a worker: its program's processes, and the
  orphans reparented to it). Pages shared after a fork count once per process."""
  total, stack, seen = 0, _children(root), set()
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


def _kill_uid(uid):
  """SIGKILLs every process of `uid` (atomically for the kernel, so a fork bomb cannot outrun it)."""
  pid = os.fork()
  if pid == 0:
    try:
      os.setgroups([])
      os.setgid(uid)
      os.setuid(uid)
      os.kill(-1, signal.SIGKILL)  # as `uid`: reaches only `uid`'s processes (not this one)
    except BaseException:
      pass
    os._exit(0)
  os.waitpid(pid, 0)


def _reap_all():
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return


def _kill_leftovers(uid):
  """Kills and reaps every descendant of this process (a subreaper: orphans come back to it)."""
  me = os.getpid()
  for _ in range(1000):
    leftover = _children(me)
    if uid is not None and leftover:
      _kill_uid(uid)
    if not leftover:
      _reap_all()
      return True
    for pid in leftover:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for pid in leftover:
      with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
  return False


class _Worker:
  def __init__(self, slot, uid, base_dir, config):
    self.slot = slot
    self.uid = uid
    self.base_dir = base_dir
    self.config = config
    self.sequence = 0
    limits = [
      (resource.RLIMIT_CPU, int(config['cpu_s'])),
      (resource.RLIMIT_AS, int(config['memory_mib']) << 20),
      (resource.RLIMIT_FSIZE, int(config['file_mib']) << 20),
      (resource.RLIMIT_NOFILE, int(config['open_files'])),
      (resource.RLIMIT_CORE, 0),
    ]
    if uid is not None:  # counted per real uid: only meaningful for a uid of our own
      limits.append((resource.RLIMIT_NPROC, int(config['max_processes'])))
    self.limits = limits

  def _env(self, workdir):
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

  def _make_dir(self, files):
    self.sequence += 1
    workdir = os.path.join(self.base_dir, f'{os.getpid()}-{self.sequence}')
    os.mkdir(workdir, 0o700)
    for relative, content in files.items():
      path = os.path.join(workdir, relative)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, 'w', encoding='utf-8', errors='surrogatepass') as f:
        f.write(content)
    if self.uid is not None:
      for root, dirs, names in os.walk(workdir):
        for name in [*dirs, *names]:
          os.chown(os.path.join(root, name), self.uid, self.uid, follow_symlinks=False)
      os.chown(workdir, self.uid, self.uid)
    return workdir

  def run(self, job):
    started = time.monotonic()
    files = dict(job.get('files', {}))
    if job['op'] == 'check':
      files['main.py'] = job['source']
    try:
      workdir = self._make_dir(files)
    except OSError as e:
      return {'infra_error': f'worker {self.slot} could not make the program directory: {e}'}
    try:
      return self._supervise(job, workdir, started)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)

  def _supervise(self, job, workdir, started):
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    try:
      pid = os.fork()
    except OSError as e:
      for fd in (out_r, out_w, res_r, res_w):
        os.close(fd)
      return {'infra_error': f'worker {self.slot} could not fork a program: {e}'}
    if pid == 0:
      try:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        os.dup2(res_w, 3)
        os.closerange(4, 1 << 16)
      except BaseException:
        os._exit(1)
      _program_main(job, workdir, self.uid, self.limits, self._env(workdir))
      os._exit(1)
    os.close(out_w)
    os.close(res_w)
    try:
      pidfd = os.pidfd_open(pid)
    except OSError:
      pidfd = None
    try:
      if job['op'] == 'command':
        problem = self._await_setup(res_r)
        if problem is None:
          reply = self._watch_command(job, pid, pidfd, out_r, started)
      else:
        problem, reply = self._watch_program(job, pid, pidfd, out_r, res_r, started)
      if problem is not None:
        self._finish(pid, None)
        return {'infra_error': f'worker {self.slot}: the program could not be set up ({problem})'}
    finally:
      for fd in (out_r, res_r, pidfd):
        if fd is not None:
          os.close(fd)
    reply['id'] = job['id']
    return reply

  def _await_setup(self, res_r):
    """Waits for the program's setup frame (nothing untrusted has run before it); None if it came."""
    want = RESULT_HEADER.pack(0, -2, KIND_SETUP)
    got = b''
    deadline = time.monotonic() + 10.0
    while len(got) < len(want):
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([res_r], [], [], left)[0]:
        return 'no answer within 10 s'
      chunk = os.read(res_r, len(want) - len(got))
      if not chunk:
        return 'it exited before its limits were in place'
      got += chunk
    return None if got == want else 'a wrong setup frame'

  def _finish(self, pid, status):
    """Kills the program's tree (whatever it did) and reaps it; returns (status, rusage)."""
    # Before the leader is reaped, so that its pgid cannot have been reused.
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(pid, signal.SIGKILL)
    rusage = None
    if status is None:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
      _, status, rusage = os.wait4(pid, 0)
    clean = _kill_leftovers(self.uid)
    return status, rusage, clean

  def _status_fields(self, status, rusage, killed):
    fields = {'killed_by_us': killed, 'signal': None, 'exit_code': None, 'cpu_s': None}
    if rusage is not None:
      fields['cpu_s'] = rusage.ru_utime + rusage.ru_stime
    if status is not None:
      if os.WIFSIGNALED(status):
        fields['signal'] = os.WTERMSIG(status)
      elif os.WIFEXITED(status):
        fields['exit_code'] = os.WEXITSTATUS(status)
    return fields

  def _watch_command(self, job, pid, pidfd, out_r, started):
    """Reads a command's output until it exits (and 0.5 s more for what it left running), its
    deadline passes or its processes hold too much memory."""
    output = _CappedOutput(int(self.config['output_bytes']))
    deadline = started + float(job['timeout_s'])
    poller = select.poll()
    poller.register(out_r, select.POLLIN)
    if pidfd is not None:
      poller.register(pidfd, select.POLLIN)
    status = rusage = None
    out_open = True
    timed_out = over_memory = False
    tree_limit = 2 * (int(self.config['memory_mib']) << 20)
    next_sample = started + MEMORY_SAMPLE_S
    while True:
      if status is None:
        done, status_now, usage = os.wait4(pid, os.WNOHANG)
        if done:
          status, rusage = status_now, usage
          deadline = min(deadline, time.monotonic() + 0.5)  # what it left behind gets 0.5 s
      if status is not None and not out_open:
        break
      now = time.monotonic()
      if now >= deadline:
        timed_out = status is None
        break
      if now >= next_sample:
        next_sample = now + MEMORY_SAMPLE_S
        if _tree_rss(os.getpid()) > tree_limit:
          over_memory = True
          output.add(
            f'\n[sandbox: killed: its processes held over {tree_limit >> 20} MiB]\n'.encode()
          )
          break
      events = poller.poll(
        max(0.0, min(deadline - now, 0.05 if status is not None else MEMORY_SAMPLE_S)) * 1000
      )
      for fd, _ in events:
        if fd == out_r and out_open:
          chunk = os.read(out_r, 1 << 16)
          if chunk:
            output.add(chunk)
          else:
            out_open = False
            poller.unregister(out_r)
        elif fd == pidfd:
          poller.unregister(pidfd)
      if status is not None and not events:
        break  # exited; a leftover holds the output open: stop reading
    seconds = time.monotonic() - started
    status, rusage2, clean = self._finish(pid, status)
    fields = self._status_fields(status, rusage or rusage2, timed_out or over_memory)
    return {
      'op': 'command',
      'output': output.text(),
      'timed_out': timed_out,
      'seconds': seconds,
      'clean': clean,
      **fields,
    }

  def _watch_program(self, job, pid, pidfd, out_r, res_r, started):
    """Reads the program's frames: setup, load, then one per call (it runs them back to back;
    each call's deadline runs from the arrival of the previous frame). Returns (problem, reply):
    a problem (not None) when the program never reached its setup frame. One loop on purpose:
    the deadlines, the memory samples and the frame parser share its state."""
    output = _CappedOutput(int(self.config['output_bytes']))
    cap = int(self.config['result_bytes'])
    calls = job['calls']
    program_deadline = started + float(job['program_timeout_s'])
    test_timeout = float(job['test_timeout_s'])
    poller = select.poll()
    poller.register(out_r, select.POLLIN)
    poller.register(res_r, select.POLLIN)
    if pidfd is not None:
      poller.register(pidfd, select.POLLIN)
    buffer = bytearray()
    load = None  # {'ok': bool, 'error': [type, line] | None}
    results = []  # [index, kind, payload text]
    expecting = -2  # the index of the frame we wait for (-2: setup, -1: the load)
    test_started = None
    end = None  # why the program stopped: done, timeout, exited, protocol, closed, memory
    detail = ''
    status = None
    tree_limit = 2 * (int(self.config['memory_mib']) << 20)  # RLIMIT_AS binds one process only
    next_sample = started + MEMORY_SAMPLE_S
    while end is None:
      now = time.monotonic()
      deadline = program_deadline
      if expecting >= 0:
        deadline = min(deadline, test_started + test_timeout)
      if now >= deadline:
        end = 'timeout'
        break
      if now >= next_sample:
        next_sample = now + MEMORY_SAMPLE_S
        if _tree_rss(os.getpid()) > tree_limit:
          end, detail = 'memory', f'its processes together held over {tree_limit >> 20} MiB'
          break
      events = poller.poll(max(0.0, min(deadline, next_sample) - now) * 1000)
      exited = leader_exited = False
      for fd, _ in events:
        if fd == out_r:
          chunk = os.read(out_r, 1 << 16)
          if chunk:
            output.add(chunk)
          else:
            poller.unregister(out_r)
        elif fd == pidfd:
          exited = leader_exited = True
        elif fd == res_r:
          chunk = os.read(res_r, 1 << 16)
          if chunk:
            buffer += chunk
          else:
            exited = True
      if exited:  # nothing more will come: take what is still in the pipe
        try:
          os.set_blocking(res_r, False)
          while chunk := os.read(res_r, 1 << 16):
            buffer += chunk
        except OSError:
          pass
      # Parse every complete frame; answer each with the next call.
      while end is None and len(buffer) >= RESULT_HEADER.size:
        size, index, kind = RESULT_HEADER.unpack_from(buffer)
        if kind not in _KINDS or index != expecting:
          end, detail = 'protocol', f'a malformed result frame (index {index}, kind {kind})'
          break
        if size > cap:
          end, detail = 'protocol', f'a result of {size} bytes (at most {cap} are accepted)'
          break
        if len(buffer) < RESULT_HEADER.size + size:
          break
        payload = bytes(buffer[RESULT_HEADER.size : RESULT_HEADER.size + size])
        del buffer[: RESULT_HEADER.size + size]
        try:
          text = payload.decode('utf-8')
        except UnicodeDecodeError:
          end, detail = 'protocol', 'a result that is not UTF-8'
          break
        if expecting == -2:
          if kind != KIND_SETUP or size:
            end, detail = 'protocol', 'no setup frame'
            break
        elif expecting == -1:
          if kind == KIND_LOADED:
            load = {'ok': True, 'error': None}
          elif kind == KIND_LOAD_ERROR:
            load = {'ok': False, 'error': text}
            end = 'done'
            break
          else:
            end, detail = 'protocol', f'result kind {kind} before the module loaded'
            break
        elif kind in (KIND_VALUE, KIND_EXCEPTION, KIND_UNSUPPORTED):
          results.append([index, kind, text])
        else:
          end, detail = 'protocol', f'result kind {kind} for a test'
          break
        expecting += 1
        if expecting >= len(calls):
          end = 'done'
          break
        test_started = time.monotonic()
      if end is None and exited:
        end = 'exited'
        if buffer:
          detail = 'a truncated result frame'
        if not leader_exited and pidfd is not None and not select.select([pidfd], [], [], 0.2)[0]:
          end, detail = 'closed', 'it closed its result channel'
    seconds = time.monotonic() - started
    if expecting == -2:
      return f'{end} before the setup frame {detail}'.strip(), None
    timed_out_index = expecting if end == 'timeout' else None
    status, rusage, clean = self._finish(pid, status)
    # Drain the output the program left in the pipe (bounded: the pipe holds at most 64 KiB).
    try:
      os.set_blocking(out_r, False)
      while chunk := os.read(out_r, 1 << 16):
        output.add(chunk)
    except (BlockingIOError, OSError):
      pass
    fields = self._status_fields(status, rusage, end in ('timeout', 'protocol', 'closed', 'memory'))
    return None, {
      'op': 'check',
      'load': load,
      'results': results,
      'end': end,
      'detail': detail,
      'timed_out_index': timed_out_index,
      'output': output.text(),
      'seconds': seconds,
      'clean': clean,
      **fields,
    }


def _worker_main(slot, uid, base_dir, config, job_r, result_w, replacement):
  _prctl(_PR_SET_CHILD_SUBREAPER, 1)
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  os.makedirs(base_dir, mode=0o711, exist_ok=True)
  if uid is not None and replacement:
    _kill_uid(uid)  # what the worker killed before us in this slot left running
  for name in os.listdir(base_dir):  # and the directory of the program it was running
    shutil.rmtree(os.path.join(base_dir, name), ignore_errors=True)
  worker = _Worker(slot, uid, base_dir, config)
  while True:
    job = read_frame(job_r)
    if job is None:
      break
    reply = worker.run(job)
    reply.setdefault('id', job['id'])
    write_frame(result_w, reply)
    del job, reply
  _kill_leftovers(uid)
  os._exit(0)


# ---------------------------------------------------------------------------------------------
# The launcher.


_HIDDEN = ('/run', '/var/tmp', '/dev/shm')


def _blocked_ancestor(path):
  """The first directory above `path` that other users cannot enter (None if there is none)."""
  parts = path.strip('/').split('/')
  for i in range(1, len(parts)):
    ancestor = '/' + '/'.join(parts[:i])
    if not os.stat(ancestor).st_mode & 0o001:
      return ancestor
  return None


def _expose(paths):
  """Makes each of `paths` reachable by any uid: a tmpfs covers its first ancestor that others
  cannot enter (hiding the rest of it, e.g. /root), and the path is bound back in below it."""
  by_ancestor = {}
  for path in paths:
    ancestor = _blocked_ancestor(path)
    if ancestor is not None:
      by_ancestor.setdefault(ancestor, []).append(path)
  count = 0
  for ancestor, targets in by_ancestor.items():
    staged = []
    for target in targets:
      stage = f'/tmp/.stage{count}'
      count += 1
      os.mkdir(stage, 0o700)
      _mount(target, stage, None, _MS_BIND | _MS_REC)
      staged.append((stage, target))
    _mount('tmpfs', ancestor, 'tmpfs', _MS_NOSUID | _MS_NODEV, 'mode=0755,size=1m')
    for stage, target in staged:
      os.makedirs(target, 0o755, exist_ok=True)
      _mount(stage, target, None, _MS_MOVE)
      os.rmdir(stage)


def _venv_root():
  """The virtualenv the interpreter was started from (under -S, sys.prefix does not say), or
  the directory of the executable: programs and commands run `sys.executable` by that path."""
  bin_dir = os.path.realpath(os.path.dirname(os.path.abspath(sys.executable)))
  root = os.path.dirname(bin_dir)
  return root if os.path.isfile(os.path.join(root, 'pyvenv.cfg')) else bin_dir


def _mount_namespace(workers, disk_mib):
  """Everything read-only; /tmp, /run, /var/tmp and /dev/shm empty; the interpreter reachable;
  a private tmpfs per worker under /tmp. Returns the per-worker directories."""
  _mount(None, '/', None, _MS_REC | _MS_PRIVATE)
  prefixes = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, _venv_root())})
  # The host's other scratch places and its daemons' sockets are covered too.
  covered = ['/tmp', *(d for d in _HIDDEN if os.path.isdir(d) and not os.path.islink(d))]
  # An interpreter inside a covered directory (a virtualenv under /tmp) is held by a file
  # descriptor while the tmpfs goes on, then bound back in at its own path.
  held = {
    path: os.open(path, os.O_PATH | os.O_DIRECTORY)
    for path in prefixes
    if any(path.startswith(directory + '/') for directory in covered)
  }
  _mount('tmpfs', '/tmp', 'tmpfs', _MS_NOSUID | _MS_NODEV, 'mode=0755,size=1m')
  for shared in covered[1:]:
    _mount('tmpfs', shared, 'tmpfs', _MS_NOSUID | _MS_NODEV, 'mode=0755,size=64k')
  for path, fd in held.items():
    os.makedirs(path, 0o755, exist_ok=True)
    _mount(f'/proc/self/fd/{fd}', path, None, _MS_BIND | _MS_REC)
    os.close(fd)
  _expose(prefixes)
  with open('/proc/self/mountinfo') as f:
    lines = f.read().splitlines()
  for line in lines:
    fields = line.split()
    target = re.sub(r'\\([0-7]{3})', lambda m: chr(int(m.group(1), 8)), fields[4])
    if target in ('/proc', '/tmp') or target.startswith('/proc/'):
      continue
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
    for option in fields[5].split(','):
      flags |= _MOUNT_FLAGS.get(option, 0)
    try:
      _mount(None, target, None, flags)
    except OSError as e:
      if e.errno not in (errno.ENOENT, errno.EACCES) or target == '/':
        raise
  dirs = []
  for slot in range(workers):
    path = f'/tmp/w{slot}'
    os.mkdir(path, 0o711)
    _mount('tmpfs', path, 'tmpfs', _MS_NOSUID | _MS_NODEV, f'mode=0711,size={disk_mib}m')
    dirs.append(path)
  return dirs


class _Launcher:
  def __init__(self, config, channel_in, channel_out):
    self.config = config
    self.channel_in = channel_in
    self.channel_out = channel_out
    self.workers = int(config['workers'])
    self.uids = [None] * self.workers
    if config['uid_base'] is not None and os.geteuid() == 0:
      self.uids = [int(config['uid_base']) + slot for slot in range(self.workers)]
    self.base_dirs = []
    self.private_base = None
    self.slots = {}  # slot -> dict(pid, job_w, reader, job, jobs_done)
    self.queue = collections.deque()
    self.failed_starts = 0

  def setup(self):
    if self.config['namespaces']:
      self.base_dirs = _mount_namespace(self.workers, int(self.config['disk_mib']))
    else:
      self.private_base = tempfile.mkdtemp(prefix='earl-sandbox-')
      os.chmod(self.private_base, 0o711)
      self.base_dirs = [os.path.join(self.private_base, f'w{s}') for s in range(self.workers)]
    for slot in range(self.workers):
      self._start_worker(slot)

  def _start_worker(self, slot, replacement=False):
    job_r, job_w = os.pipe()
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:
      try:
        os.close(job_w)
        os.close(result_r)
        keep = {job_r, result_w}
        for fd in [self.channel_in, self.channel_out]:
          os.close(fd)
        for other in self.slots.values():
          for fd in (other['job_w'], other['reader'].fd, other['pidfd']):
            if fd not in keep:
              os.close(fd)
        _worker_main(
          slot, self.uids[slot], self.base_dirs[slot], self.config, job_r, result_w, replacement
        )
      except BaseException as e:
        os.write(2, f'sandbox worker {slot}: {e!r}\n'.encode())
      os._exit(1)
    os.close(job_r)
    os.close(result_w)
    os.set_blocking(result_r, False)
    self.slots[slot] = {
      'pid': pid,
      'pidfd': os.pidfd_open(pid),
      'job_w': job_w,
      'reader': _FrameReader(result_r),
      'job': None,
      'jobs_done': 0,
    }

  def _worker_died(self, slot):
    worker = self.slots.pop(slot)
    with contextlib.suppress(ProcessLookupError):
      os.kill(worker['pid'], signal.SIGKILL)
    _, status = os.waitpid(worker['pid'], 0)
    frames, eof = [], False
    while not eof:  # a result it wrote before dying still counts
      more, eof = worker['reader'].read()
      frames += more
      eof = eof or not more
    for frame in frames:
      write_frame(self.channel_out, frame)
      worker['job'] = None
      worker['jobs_done'] += 1
    for fd in (worker['job_w'], worker['reader'].fd, worker['pidfd']):
      os.close(fd)
    how = (
      f'killed by signal {os.WTERMSIG(status)}'
      if os.WIFSIGNALED(status)
      else f'exited with code {os.WEXITSTATUS(status)}'
    )
    if worker['job'] is not None:
      write_frame(self.channel_out, {'id': worker['job']['id'], 'worker_died': how})
    if worker['jobs_done'] == 0 and worker['job'] is None:
      self.failed_starts += 1
      if self.failed_starts >= 3:
        raise RuntimeError(f'sandbox worker {slot} keeps dying at start ({how})')
    else:
      self.failed_starts = 0
    self._kill_orphans()
    self._start_worker(slot, replacement=True)

  def _kill_orphans(self):
    """Orphans of a dead worker reparent to us (PID 1 or a subreaper): kill and reap them."""
    workers = {w['pid'] for w in self.slots.values()}
    for pid in _children(os.getpid()):
      if pid not in workers:
        try:
          os.kill(pid, signal.SIGKILL)
          os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
          pass

  def _dispatch(self):
    for _slot, worker in self.slots.items():
      if not self.queue:
        return
      if worker['job'] is None:
        job = self.queue.popleft()
        worker['job'] = job
        # If it died, its pidfd reports it and the job is answered as a crash.
        with contextlib.suppress(OSError):
          write_frame(worker['job_w'], job)

  def loop(self):
    reader = _FrameReader(self.channel_in)
    os.set_blocking(self.channel_in, False)
    while True:
      poller = select.poll()
      poller.register(self.channel_in, select.POLLIN)
      by_fd = {}
      for slot, worker in self.slots.items():
        poller.register(worker['reader'].fd, select.POLLIN)
        poller.register(worker['pidfd'], select.POLLIN)
        by_fd[worker['reader'].fd] = (slot, 'result')
        by_fd[worker['pidfd']] = (slot, 'exit')
      events = poller.poll(1000)
      if not events:
        _reap_all_but(self.slots)
        continue
      dead = set()
      for fd, _ in events:
        if fd == self.channel_in:
          frames, eof = reader.read()
          self.queue.extend(frames)
          if eof:
            return
          continue
        slot, what = by_fd[fd]
        if what == 'exit':
          dead.add(slot)
          continue
        frames, eof = self.slots[slot]['reader'].read()
        for frame in frames:
          write_frame(self.channel_out, frame)
          self.slots[slot]['job'] = None
          self.slots[slot]['jobs_done'] += 1
        if eof:
          dead.add(slot)
      for slot in dead:
        self._worker_died(slot)
      self._dispatch()

  def shutdown(self):
    for worker in self.slots.values():
      os.close(worker['job_w'])  # the worker kills its program's leftovers and exits
    deadline = time.monotonic() + 2.0
    for worker in self.slots.values():
      while time.monotonic() < deadline:
        done, _ = os.waitpid(worker['pid'], os.WNOHANG)
        if done:
          break
        time.sleep(0.01)
      else:
        with contextlib.suppress(ProcessLookupError):
          os.kill(worker['pid'], signal.SIGKILL)
    for uid in self.uids:
      if uid is not None:
        _kill_uid(uid)
    _kill_leftovers(None)
    if self.private_base is not None:
      shutil.rmtree(self.private_base, ignore_errors=True)


def _reap_all_but(slots):
  workers = {w['pid'] for w in slots.values()}
  for pid in _children(os.getpid()):
    if pid not in workers:
      with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def main():
  config = json.loads(sys.argv[1])
  # The channel to the parent moves off fds 0/1, so nothing can write into it by accident.
  channel_in, channel_out = os.dup(0), os.dup(1)
  null = os.open(os.devnull, os.O_RDWR)
  os.dup2(null, 0)
  os.dup2(2, 1)
  os.close(null)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle
  _prctl(_PR_SET_CHILD_SUBREAPER, 1)
  launcher = _Launcher(config, channel_in, channel_out)
  try:
    launcher.setup()
  except Exception as e:
    write_frame(channel_out, {'op': 'fatal', 'message': f'{type(e).__name__}: {e}'})
    launcher.shutdown()
    return 1
  gc.collect()
  gc.freeze()  # forked programs then share these pages instead of copying them on first touch
  hidden = None
  if not config['namespaces'] and launcher.uids[0] is not None:
    hidden = _blocked_ancestor(os.path.realpath(sys.base_prefix))
  write_frame(
    channel_out,
    {
      'op': 'ready',
      'uids': launcher.uids,
      'base': launcher.private_base,
      'pid': os.getpid(),
      'interpreter_hidden_by': hidden,
    },
  )
  try:
    launcher.loop()
  except Exception as e:
    with contextlib.suppress(OSError):
      write_frame(channel_out, {'op': 'fatal', 'message': f'{type(e).__name__}: {e}'})
    launcher.shutdown()
    return 1
  launcher.shutdown()
  return 0


if __name__ == '__main__':
  sys.exit(main())
