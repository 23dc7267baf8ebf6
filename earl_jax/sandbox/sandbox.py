"""Runs untrusted Python programs against tests, safely and fast, from a JAX process.

A `Sandbox` starts one launcher process (`_launcher.py`, run as a fresh `python -I -S`; the JAX
process only ever fork+execs it through `subprocess.Popen`, without `preexec_fn`). Where the
machine allows it (root, or CAP_SYS_ADMIN, and util-linux `unshare`), the launcher runs in new PID,
network, mount and IPC namespaces: no network, a read-only view of the file system with a private
tmpfs per worker, and every process it starts dies with it. It forks a pool of workers, and each
worker forks one fresh process per program, in a new session, with rlimits (CPU, address space,
file size, open files, processes), an unprivileged uid of its own (when root) and no_new_privs.
Wall-clock deadlines per test and per program are enforced by killing the whole process tree and
reaping it. Output is capped (head and tail kept).

Verdicts cannot be forged: the program reports each test call's return value, encoded with its
type, over a pipe; this process decodes plain values only (`values.py`) and compares them with
expected values that never leave it. Both sides take the frames, their kinds and the runner's exit
codes from one definition, `_wire.py`. A failure of the sandbox's own machinery raises
SandboxError; it is never a reward.
"""

import collections.abc
import contextlib
import dataclasses
import itertools
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import logging

from earl_jax.sandbox import _wire, values

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_launcher.py')
NAMESPACE_FLAGS = ('--pid', '--fork', '--kill-child', '--mount-proc', '--net', '--mount', '--ipc')
STATUSES = ('pass', 'fail', 'timeout', 'memory', 'crash', 'error')
_ISOLATIONS = ('auto', 'namespaces', 'limits')
_LAUNCHER_ENV = {'PATH': '/usr/local/bin:/usr/bin:/bin', 'LANG': 'C.UTF-8', 'HOME': '/'}
_FEEDBACK_CHARS = 400
_GOT_CHARS = 200


class SandboxError(RuntimeError):
  """The sandbox itself failed (a launcher or channel broke): never a verdict about a program."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
  """Limits of every sandboxed program, and the pool.

  Attributes:
    workers: programs run at once; 0 = the CPUs this process may use.
    test_timeout_s: wall-clock seconds for one test call.
    program_timeout_s: wall-clock seconds for a whole program (loading it and every test), and
      the default of `run_command`.
    cpu_s: CPU seconds of a program (RLIMIT_CPU).
    memory_mib: address space of each of a program's processes (RLIMIT_AS); the resident memory
      of all of them together is kept under twice this (summed every 0.1 s).
    file_mib: largest file a program may write (RLIMIT_FSIZE).
    open_files: open file descriptors (RLIMIT_NOFILE).
    max_processes: processes and threads of a program (RLIMIT_NPROC; effective because each
      worker's programs run under a uid of their own, which needs root).
    output_bytes: stdout and stderr kept per program (merged; the head and the tail).
    isolation: 'auto' (namespaces where they work, else limits only), 'namespaces' (refuse to run
      without them) or 'limits'.
    result_bytes: largest encoded return value accepted for one test.
    disk_mib: size of each worker's private tmpfs (namespaces only).
    start_timeout_s: seconds the launcher may take to start.
  """

  workers: int = 0
  test_timeout_s: float = 2.0
  program_timeout_s: float = 10.0
  cpu_s: int = 10
  memory_mib: int = 1024
  file_mib: int = 16
  open_files: int = 64
  max_processes: int = 16
  output_bytes: int = 8192
  isolation: str = 'auto'
  result_bytes: int = 1 << 20
  disk_mib: int = 64
  start_timeout_s: float = 30.0

  def __post_init__(self):
    def positive(name, minimum=1):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f'SandboxConfig.{name}={value!r}: expected a number')
      if not math.isfinite(value) or value < minimum:
        raise ValueError(f'SandboxConfig.{name}={value!r}: expected a finite number >= {minimum}')

    if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
      raise ValueError(f'SandboxConfig.workers={self.workers!r}: expected an int >= 0 (0 = CPUs)')
    for name in ('test_timeout_s', 'program_timeout_s', 'start_timeout_s'):
      positive(name, minimum=0.001)
    for name in ('cpu_s', 'memory_mib', 'file_mib', 'disk_mib'):
      positive(name)
    positive('open_files', minimum=8)
    positive('max_processes')
    positive('output_bytes', minimum=2)
    positive('result_bytes', minimum=64)
    for name in ('cpu_s', 'memory_mib', 'file_mib', 'open_files', 'max_processes', 'disk_mib'):
      if not isinstance(getattr(self, name), int):
        raise ValueError(f'SandboxConfig.{name}={getattr(self, name)!r}: expected an int')
    if self.isolation not in _ISOLATIONS:
      raise ValueError(f'SandboxConfig.isolation={self.isolation!r}: expected one of {_ISOLATIONS}')


@dataclasses.dataclass(frozen=True)
class TestCase:
  """One test: `call` runs in the program, the parent checks its return value.

  Attributes:
    call: a Python expression evaluated in the program's module namespace, e.g. 'add(1, 2)'.
    expected: the plain value `call` must return (compared with `==`, as `assert ... ==` does);
      it never leaves the trusted parent. With `predicate`, a description of what is expected.
    rel_tol: with `abs_tol`, compare floats (also inside lists, tuples, dicts) with math.isclose.
    abs_tol: see rel_tol.
    predicate: if set, replaces the comparison: called in the parent with the decoded return
      value (a plain value), True when the test passes.
  """

  __test__ = False  # not a pytest class

  call: str
  expected: Any
  rel_tol: float = 0.0
  abs_tol: float = 0.0
  predicate: Callable[[Any], bool] | None = None

  def __post_init__(self):
    if not isinstance(self.call, str) or not self.call.strip():
      raise ValueError(f'TestCase.call={self.call!r}: expected a Python expression')


def _frozen_files(files: Mapping[str, str]) -> Mapping[str, str]:
  if not isinstance(files, collections.abc.Mapping):
    raise ValueError(f'Program.files: expected a mapping of relative paths to text, got {files!r}')
  for path, content in files.items():
    parts = path.split('/') if isinstance(path, str) else []
    if not parts or path.startswith('/') or any(p in ('', '.', '..') for p in parts):
      raise ValueError(f'Program.files: {path!r} is not a plain relative path (a/b.py)')
    if not isinstance(content, str):
      raise ValueError(f'Program.files[{path!r}]: expected text, got {type(content).__name__}')
  for path in files:
    parts = path.split('/')
    for end in range(1, len(parts)):
      if '/'.join(parts[:end]) in files:
        raise ValueError(f'Program.files: {"/".join(parts[:end])!r} is a file and a directory')
  return types.MappingProxyType(dict(files))


@dataclasses.dataclass(frozen=True)
class Program:
  """A candidate program: `source` runs as module `main` in a fresh directory holding `files`."""

  source: str
  files: Mapping[str, str] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

  def __post_init__(self):
    if not isinstance(self.source, str):
      raise ValueError(f'Program.source: expected text, got {type(self.source).__name__}')
    object.__setattr__(self, 'files', _frozen_files(self.files))


@dataclasses.dataclass(frozen=True)
class TestResult:
  """One test's outcome: `got` is the repr of the return value (truncated), `error` why it failed."""

  __test__ = False

  ok: bool
  got: str
  error: str | None
  status: str = 'pass'


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A program's outcome over its tests.

  Attributes:
    status: 'pass' only if every test passed; else the kind of the first failure: 'fail' (a
      wrong or non-plain value), 'error' (an exception, or a broken result protocol), 'timeout'
      (wall-clock or CPU limit), 'memory', 'crash' (a signal, or an exit before all answers).
    passed: tests passed.
    total: tests run.
    seconds: wall-clock time of the program.
    feedback: the first failing test: the call, what was expected and what came back (or the
      error's last line), truncated; '' on a pass.
    results: one per test, in order.
    output: the program's stdout and stderr (merged, capped: head and tail).
  """

  status: str
  passed: int
  total: int
  seconds: float
  feedback: str
  results: tuple[TestResult, ...]
  output: str = ''

  @property
  def reward(self) -> float:
    """The fraction of tests passed (0.0 without tests)."""
    return self.passed / self.total if self.total else 0.0


@dataclasses.dataclass(frozen=True)
class CommandResult:
  """A command's outcome: exit code (negative: the signal that killed it; None: timed out)."""

  exit_code: int | None
  output: str
  timed_out: bool
  seconds: float


def shorten(text: str, limit: int) -> str:
  """`text` cut to about `limit` characters, keeping its head and tail."""
  if len(text) <= limit:
    return text
  half = max((limit - 5) // 2, 1)
  return f'{text[:half]} ... {text[-half:]}'


def _safe_repr(value: Any) -> str:
  try:
    return shorten(repr(value), _GOT_CHARS)
  except (ValueError, RecursionError):  # an int too long for str(), say
    return f'<{type(value).__name__} too large to show>'


def probe_namespaces() -> tuple[bool, str]:
  """Whether `unshare` can make the sandbox's namespaces here; the reason when it cannot."""
  unshare = shutil.which('unshare', path=_LAUNCHER_ENV['PATH'] + ':' + os.environ.get('PATH', ''))
  if unshare is None:
    return False, 'no unshare binary (util-linux) on PATH'
  try:
    done = subprocess.run(
      [unshare, *NAMESPACE_FLAGS, '--', 'true'],
      stdin=subprocess.DEVNULL,
      capture_output=True,
      timeout=20,
      env=_LAUNCHER_ENV,
      check=False,
    )
  except (OSError, subprocess.TimeoutExpired) as e:
    return False, f'unshare failed: {e}'
  if done.returncode != 0:
    lines = done.stderr.decode(errors='replace').strip().splitlines()
    return False, lines[-1] if lines else f'unshare exited with code {done.returncode}'
  return True, ''


class _Pending:
  def __init__(self):
    self.event = threading.Event()
    self.reply: dict | None = None


def _stop_process(process: subprocess.Popen) -> None:
  if process.poll() is None:
    with contextlib.suppress(OSError):
      process.stdin.close()
    try:
      process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


class Sandbox:
  """A launcher and its pool of workers; `check`/`check_many`/`run_command` are thread-safe.

  Attributes:
    config: the limits.
    workers: the pool's size.
    isolation: 'namespaces' or 'limits-only'.
    isolation_reason: why not namespaces ('' when namespaces).
    program_uids: the uid each worker's programs run under (empty when not root).
    programs_run: the programs `check_many` (and `check`) has been given to judge.
  """

  def __init__(self, config: SandboxConfig = SandboxConfig()):
    if not isinstance(config, SandboxConfig):
      raise ValueError(f'Sandbox(config={config!r}): expected a SandboxConfig')
    self.config = config
    self.workers = config.workers or len(os.sched_getaffinity(0))
    self._lock = threading.Lock()
    self._pending: dict[int, _Pending] = {}
    self._ids = itertools.count()
    self.programs_run = 0
    self._broken: str | None = None
    self._closed = False
    self._stderr_tail = collections.deque(maxlen=40)
    self._process: subprocess.Popen | None = None
    self.isolation, self.isolation_reason = self._start()
    self._reader = threading.Thread(target=self._read_replies, name='sandbox-reader', daemon=True)
    self._reader.start()
    self._finalizer = weakref.finalize(self, _stop_process, self._process)
    why = f' ({self.isolation_reason})' if self.isolation_reason else ''
    logging.info('sandbox: isolation=%s%s, %d workers', self.isolation, why, self.workers)

  # Start-up.

  def _start(self) -> tuple[str, str]:
    wanted = self.config.isolation
    if wanted == 'limits':
      reason = 'isolation=limits was asked for'
    else:
      available, reason = probe_namespaces()
      if available:
        try:
          self._launch(namespaces=True)
          return 'namespaces', ''
        except SandboxError as e:
          reason = f'namespaces failed: {e}'
      if wanted == 'namespaces':
        raise SandboxError(f'isolation=namespaces was asked for, but {reason}')
    self._launch(namespaces=False)
    if self._interpreter_hidden_by:
      reason += (
        f'; {self._interpreter_hidden_by} hides the interpreter from the programs uid: they can'
        ' import only the modules the launcher preloaded, and run_command cannot start python'
      )
    if os.geteuid() != 0:
      reason += '; not root: programs run as this user, without RLIMIT_NPROC'
    return 'limits-only', reason

  def _launch(self, *, namespaces: bool) -> None:
    config = self.config
    launcher_config = {
      'workers': self.workers,
      'namespaces': namespaces,
      'uid_base': 1_000_000 + secrets.randbelow(1_000_000) * 1024 if os.geteuid() == 0 else None,
      'cpu_s': config.cpu_s,
      'memory_mib': config.memory_mib,
      'file_mib': config.file_mib,
      'open_files': config.open_files,
      'max_processes': config.max_processes,
      'output_bytes': config.output_bytes,
      'result_bytes': config.result_bytes,
      'disk_mib': config.disk_mib,
    }
    argv = [sys.executable, '-I', '-S', _LAUNCHER, json.dumps(launcher_config)]
    if namespaces:
      unshare = shutil.which('unshare', path=_LAUNCHER_ENV['PATH'])
      argv = [unshare or 'unshare', *NAMESPACE_FLAGS, '--', *argv]
    try:
      process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_LAUNCHER_ENV,
        cwd='/',
        close_fds=True,
        start_new_session=True,
      )
    except OSError as e:
      raise SandboxError(f'could not start the sandbox launcher: {e}') from e
    self._stderr_tail.clear()
    threading.Thread(
      target=self._drain_stderr, args=(process.stderr,), name='sandbox-stderr', daemon=True
    ).start()
    try:
      ready = self._read_first_frame(process)
    except SandboxError:
      _stop_process(process)
      raise
    if ready.get('op') != 'ready':
      _stop_process(process)
      raise SandboxError(f'the sandbox launcher did not start: {ready.get("message", ready)}')
    self._process = process
    self.program_uids = tuple(uid for uid in ready['uids'] if uid is not None)
    self._private_base = ready.get('base')
    self._interpreter_hidden_by = ready.get('interpreter_hidden_by')

  def _drain_stderr(self, stream) -> None:
    for line in iter(stream.readline, b''):
      self._stderr_tail.append(line.decode(errors='replace').rstrip())

  def _stderr(self) -> str:
    lines = list(self._stderr_tail)
    return ('; stderr: ' + ' | '.join(lines[-5:])) if lines else ''

  def _read_first_frame(self, process: subprocess.Popen) -> dict:
    deadline = time.monotonic() + self.config.start_timeout_s
    fd = process.stdout.fileno()
    data = bytearray()
    while True:
      frames = _wire.take_frames(data)
      if frames:
        return frames[0]
      left = deadline - time.monotonic()
      if left <= 0:
        raise SandboxError(
          f'the sandbox launcher did not start within {self.config.start_timeout_s} s'
          + self._stderr()
        )
      if select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
          time.sleep(0.05)  # let the stderr thread catch the reason
          code = process.poll()
          raise SandboxError(f'the sandbox launcher exited (code {code})' + self._stderr())
        data += chunk

  # The channel.

  def _read_replies(self) -> None:
    stream = self._process.stdout
    try:
      while True:
        header = stream.read(_wire.FRAME_HEADER.size)
        if len(header) < _wire.FRAME_HEADER.size:
          break
        (size,) = _wire.FRAME_HEADER.unpack(header)
        frame = _wire.decode_frame(stream.read(size))
        if frame.get('op') == 'fatal':
          self._fail(f'the sandbox launcher failed: {frame.get("message")}')
          return
        with self._lock:
          pending = self._pending.pop(frame['id'], None)
        if pending is not None:
          pending.reply = frame
          pending.event.set()
    except (OSError, ValueError, KeyError) as e:
      self._fail(f'the channel from the sandbox launcher broke: {e!r}')
      return
    time.sleep(0.05)
    code = self._process.poll()
    self._fail(f'the sandbox launcher exited (code {code})' + self._stderr())

  def _fail(self, reason: str) -> None:
    with self._lock:
      if self._broken is None:
        self._broken = 'the sandbox was closed' if self._closed else reason
      pending, self._pending = self._pending, {}
    for p in pending.values():
      p.event.set()

  def _submit(self, jobs: list[dict]) -> list[_Pending]:
    limit = self.config.disk_mib << 20
    for job in jobs:
      size = len(job.get('source', '')) + sum(len(c) for c in job['files'].values())
      if size > limit // 2:
        raise ValueError(f'a program of {size} characters: at most half of disk_mib fits')
    pendings = []
    with self._lock:
      if self._broken is not None:
        raise SandboxError(self._broken)
      data = bytearray()
      for job in jobs:
        job['id'] = next(self._ids)
        pending = _Pending()
        self._pending[job['id']] = pending
        pendings.append(pending)
        data += _wire.encode_frame(job)
      try:
        self._process.stdin.write(data)
        self._process.stdin.flush()
      except (OSError, ValueError) as e:
        raise SandboxError(f'the channel to the sandbox launcher broke: {e!r}') from e
    return pendings

  def _wait(self, pendings: list[_Pending], per_job_s: float) -> list[dict]:
    rounds = math.ceil(len(pendings) / self.workers)
    deadline = time.monotonic() + rounds * (per_job_s + 10.0) + 30.0
    replies = []
    for pending in pendings:
      if not pending.event.wait(max(0.0, deadline - time.monotonic())):
        raise SandboxError(f'no answer from the sandbox within {rounds * (per_job_s + 10) + 30} s')
      if pending.reply is None:
        raise SandboxError(self._broken or 'the sandbox stopped')
      if 'infra_error' in pending.reply:
        raise SandboxError(pending.reply['infra_error'])
      replies.append(pending.reply)
    return replies

  # The API.

  def check(self, program: Program, tests: Sequence[TestCase]) -> Verdict:
    """Runs `program` and its tests; see `check_many`."""
    return self.check_many([(program, tests)])[0]

  def check_many(self, jobs: Sequence[tuple[Program, Sequence[TestCase]]]) -> list[Verdict]:
    """Runs every (program, tests) job on the pool at once; verdicts in input order."""
    jobs = list(jobs)
    for program, tests in jobs:
      if not isinstance(program, Program):
        raise ValueError(f'Sandbox.check: expected a Program, got {type(program).__name__}')
      if not all(isinstance(t, TestCase) for t in tests):
        raise ValueError('Sandbox.check: expected a sequence of TestCase')
    if not jobs:
      return []
    with self._lock:
      self.programs_run += len(jobs)
    requests = [
      {
        'op': 'check',
        'source': program.source,
        'files': dict(program.files),
        'calls': [t.call for t in tests],
        'test_timeout_s': self.config.test_timeout_s,
        'program_timeout_s': self.config.program_timeout_s,
      }
      for program, tests in jobs
    ]
    replies = self._wait(self._submit(requests), self.config.program_timeout_s)
    return [self._verdict(reply, list(tests)) for reply, (_, tests) in zip(replies, jobs)]

  def run_command(
    self, files: Mapping[str, str], argv: Sequence[str], timeout_s: float | None = None
  ) -> CommandResult:
    """Runs `argv` in a fresh sandbox directory holding `files` (`python`: the sandbox's own
    isolated interpreter, `python -I -S -B`); output is stdout and stderr merged, capped."""
    files = _frozen_files(files)
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
      raise ValueError(f'Sandbox.run_command: argv={argv!r}: expected a non-empty list of str')
    timeout = self.config.program_timeout_s if timeout_s is None else timeout_s
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
      raise ValueError(f'Sandbox.run_command: timeout_s={timeout_s!r}: expected seconds > 0')
    request = {'op': 'command', 'files': dict(files), 'argv': list(argv), 'timeout_s': timeout}
    (reply,) = self._wait(self._submit([request]), timeout)
    if 'worker_died' in reply:
      message = f'the sandbox worker running the command died ({reply["worker_died"]})'
      return CommandResult(exit_code=None, output=message, timed_out=False, seconds=0.0)
    exit_code = reply['exit_code']
    if reply['signal'] is not None:
      exit_code = -reply['signal']
    if reply['timed_out']:
      exit_code = None
    return CommandResult(
      exit_code=exit_code,
      output=reply['output'],
      timed_out=reply['timed_out'],
      seconds=reply['seconds'],
    )

  def close(self) -> None:
    """Stops the launcher, its workers and every program (idempotent)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    if self._process is not None:
      _stop_process(self._process)
      self._reader.join(timeout=5)
    self._fail('the sandbox was closed')
    if self._private_base and os.path.isdir(self._private_base):
      shutil.rmtree(self._private_base, ignore_errors=True)

  def __enter__(self) -> 'Sandbox':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # Verdicts.

  def _why_stopped(self, reply: dict) -> tuple[str, str]:
    """The status and message of the tests a program did not answer."""
    end = reply['end']
    if end == 'timeout':
      index = reply['timed_out_index']
      if index < 0:
        return 'timeout', f'timed out loading the module (over {self.config.program_timeout_s} s)'
      limit = min(self.config.test_timeout_s, self.config.program_timeout_s)
      return (
        'timeout',
        f'timed out (a test may take {limit} s, the program {self.config.program_timeout_s} s)',
      )
    if end == 'protocol':
      return 'error', f'the program broke the result protocol: {reply["detail"]}'
    if end == 'closed':
      return 'crash', reply['detail']
    if end == 'memory':
      return 'memory', f'out of memory: {reply["detail"]}'
    code, sig, cpu_s = reply['exit_code'], reply['signal'], reply['cpu_s']
    if code == _wire.EXIT_MEMORY:
      return 'memory', 'MemoryError: out of memory'
    if sig == signal.SIGXCPU or (
      sig == signal.SIGKILL and cpu_s is not None and cpu_s >= self.config.cpu_s
    ):
      return 'timeout', f'exceeded the CPU time limit ({self.config.cpu_s} s)'
    if sig is not None:
      try:
        name = signal.Signals(sig).name
      except ValueError:
        name = f'signal {sig}'
      if sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS) and (
        'MemoryError' in reply['output'] or 'Cannot allocate memory' in reply['output']
      ):
        return 'memory', f'killed by {name} out of memory'
      return 'crash', f'killed by {name}'
    detail = f' ({reply["detail"]})' if reply.get('detail') else ''
    return 'crash', f'exited with code {code} before answering{detail}'

  def _verdict(self, reply: dict, tests: list[TestCase]) -> Verdict:
    if 'worker_died' in reply:
      message = f'the sandbox worker running it died ({reply["worker_died"]})'
      results = tuple(TestResult(False, '', message, 'crash') for _ in tests)
      return Verdict(
        status='crash',
        passed=0,
        total=len(tests),
        seconds=0.0,
        feedback=message,
        results=results,
      )
    if not reply.get('clean', True):
      logging.warning('sandbox: a program left processes that could not be killed')
    answered = {index: (kind, payload) for index, kind, payload in reply['results']}
    load = reply['load']
    load_failure = None
    if load is None:
      load_failure = self._why_stopped(reply)
    elif not load['ok']:
      name, line = _exception_fields(load['error'])
      status = 'memory' if name == 'MemoryError' else 'error'
      load_failure = (
        status,
        f'{name}: {line} (loading the module)' if line else f'{name} (loading the module)',
      )
    stopped = None
    results = []
    for index, test in enumerate(tests):
      if load_failure is not None:
        results.append(TestResult(False, '', load_failure[1], load_failure[0]))
      elif index in answered:
        results.append(_judge(test, *answered[index]))
      else:
        stopped = stopped or self._why_stopped(reply)
        results.append(TestResult(False, '', stopped[1], stopped[0]))
    passed = sum(r.ok for r in results)
    failing = next(((test, result) for test, result in zip(tests, results) if not result.ok), None)
    if failing is not None:
      status = failing[1].status
      feedback = _feedback(*failing)
    elif load_failure is not None:  # no tests, and the module did not load
      status, feedback = load_failure[0], load_failure[1]
    else:
      status, feedback = 'pass', ''
    return Verdict(
      status=status,
      passed=passed,
      total=len(tests),
      seconds=reply['seconds'],
      feedback=shorten(feedback, _FEEDBACK_CHARS),
      results=tuple(results),
      output=reply['output'],
    )


def _exception_fields(payload: str) -> tuple[str, str]:
  try:
    fields = json.loads(payload)
  except ValueError:
    fields = None
  if isinstance(fields, list) and len(fields) == 2 and all(isinstance(f, str) for f in fields):
    return shorten(fields[0], 100), shorten(fields[1], 300)
  return 'MalformedResult', 'the program reported an exception in a form that is not ours'


def _judge(test: TestCase, kind: int, payload: str) -> TestResult:
  if kind == _wire.KIND_EXCEPTION:
    name, line = _exception_fields(payload)
    error = f'{name}: {line}' if line else name
    return TestResult(False, '', error, 'memory' if name == 'MemoryError' else 'error')
  if kind == _wire.KIND_UNSUPPORTED:
    fields = _list_or_empty(payload)
    got = f'<object of type {shorten(fields[0], 100) if fields else "unknown"}>'
    return TestResult(False, got, f'returned {got}: not a plain value', 'fail')
  try:
    got = values.decode_value(payload)
  except values.MalformedValueError as e:
    return TestResult(False, '', f'the program reported a malformed value ({e})', 'error')
  try:
    if test.predicate is not None:
      ok = bool(test.predicate(got))
    else:
      ok = values.values_match(got, test.expected, rel_tol=test.rel_tol, abs_tol=test.abs_tol)
  except Exception as e:  # a predicate failing on a wrong value is a failed test
    return TestResult(False, _safe_repr(got), f'{type(e).__name__}: {e}', 'fail')
  return TestResult(ok, _safe_repr(got), None if ok else 'wrong value', 'pass' if ok else 'fail')


def _list_or_empty(payload: str) -> list:
  try:
    fields = json.loads(payload)
  except ValueError:
    return []
  return [f for f in fields if isinstance(f, str)] if isinstance(fields, list) else []


def _feedback(test: TestCase, result: TestResult) -> str:
  if result.status == 'fail' and result.got:
    if test.predicate is not None:
      return f'{test.call}: got {result.got}, which does not satisfy {test.expected}'
    return f'{test.call}: expected {_safe_repr(test.expected)}, got {result.got}'
  return f'{test.call}: {result.error}'
