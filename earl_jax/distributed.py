"""Multi-process JAX: initialisation from the environment, and a local launcher.

On a cluster each host runs the same program and JAX's own multi-controller runtime
(`jax.distributed`) connects them. On one machine, `launch_local` starts N processes over
loopback, each with its own fake CPU devices and gloo collectives, so that multi-host code paths
(non-addressable shards, cross-process collectives, `process_allgather`) run for real here.

  # in an entry point, before any other JAX call:
  distributed.initialize_from_env()
  # from a shell: N local workers of one experiment
  python -m earl_jax.launch --num_processes=8 --devices_per_process=1 -- \
      python experiments/dispatch_latency.py --out=/tmp/d.json

The agreement helpers at the end (`process_min`, `process_max`, `broadcast_json`, `gather_rows`) make small host
values identical on every process (a budget, a measured profile, per-episode statistics), so that
every process of one program takes the same decisions; they never carry a batch.
"""

import collections
import contextlib
import dataclasses
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

ENV_COORDINATOR = 'EARL_COORDINATOR'
ENV_NUM_PROCESSES = 'EARL_NUM_PROCESSES'
ENV_PROCESS_ID = 'EARL_PROCESS_ID'
ENV_LOCAL_DEVICES = 'EARL_LOCAL_DEVICES'


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
  coordinator: str
  num_processes: int
  process_id: int
  local_devices: int | None


def process_env() -> ProcessEnv | None:
  """The launcher's settings for this process, or None outside a launched group."""
  if ENV_COORDINATOR not in os.environ:
    return None
  local = os.environ.get(ENV_LOCAL_DEVICES)
  return ProcessEnv(
    coordinator=os.environ[ENV_COORDINATOR],
    num_processes=int(os.environ[ENV_NUM_PROCESSES]),
    process_id=int(os.environ[ENV_PROCESS_ID]),
    local_devices=int(local) if local else None,
  )


def initialize(
  coordinator: str,
  num_processes: int,
  process_id: int,
  *,
  local_cpu_devices: int | None = None,
  initialization_timeout: int = 120,
) -> None:
  """Joins a multi-process JAX group. Call once, first thing, in an entry point.

  On CPU this selects gloo collectives (XLA:CPU's cross-process implementation) and sets the
  number of local fake devices; on GPU and TPU those settings are ignored by JAX.
  """
  import jax

  if local_cpu_devices is not None:
    jax.config.update('jax_num_cpu_devices', local_cpu_devices)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=initialization_timeout,
  )


def initialize_from_env() -> ProcessEnv | None:
  """Initializes from the launcher's environment variables; a no-op when there are none."""
  env = process_env()
  if env is not None and env.num_processes > 1:
    initialize(
      env.coordinator, env.num_processes, env.process_id, local_cpu_devices=env.local_devices
    )
  return env


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class ProcessResult:
  process_id: int
  returncode: int
  stdout: str
  stderr: str


class LaunchError(RuntimeError):
  """A launched group that failed, timed out, was stopped by a signal, or could not start.

  Attributes:
    exit_code: what a command-line launcher exits with: 2 for a user error (bad arguments, or
      a user error every failing process reported in one `error: ...` line), 128 + N after
      signal N was forwarded to the processes, 1 otherwise.
  """

  def __init__(self, message: str, *, exit_code: int = 1):
    super().__init__(message)
    self.exit_code = exit_code


# Seconds the other processes get to exit after SIGTERM, once one process died or the timeout
# struck, before they are killed.
STOP_GRACE_S = 3.0
# Seconds the processes get to stop after a forwarded SIGTERM / SIGINT (to save a checkpoint),
# before they are killed; a second signal kills them at once.
SIGNAL_GRACE_S = 120.0
# Lines of a process's stderr kept for a failure message (and of its stdout, for the result).
_KEPT_LINES = 10_000
_TAIL_LINES = 25
_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# A process that exits with 128 + one of these stopped on request, not in failure.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def launch_local(
  argv: Sequence[str],
  *,
  num_processes: int,
  devices_per_process: int,
  env: Mapping[str, str] | None = None,
  timeout: float | None = 600.0,
  stream_process: int | None = None,
  forward_signals: bool = False,
) -> list[ProcessResult]:
  """Runs `argv` as `num_processes` local JAX processes joined over loopback, and owns them.

  Each child sees EARL_COORDINATOR / EARL_NUM_PROCESSES / EARL_PROCESS_ID / EARL_LOCAL_DEVICES,
  plus XLA_FLAGS forcing `devices_per_process` CPU devices. Entry points call
  `initialize_from_env()`. Every child runs in its own process group, unbuffered, its output
  read as it comes. As soon as one child fails (or the timeout strikes), the others get SIGTERM,
  then SIGKILL (with their process groups) `STOP_GRACE_S` later: a group never outlives a
  member that died, waiting on collectives that cannot complete.

  Args:
    argv: the command each process runs.
    num_processes: N.
    devices_per_process: fake CPU devices in each process.
    env: extra environment variables for every child.
    timeout: seconds before all children are stopped (None: no limit).
    stream_process: if set, that child's stdout goes straight to this terminal and its stderr
      is copied to ours line by line (and kept for a failure message).
    forward_signals: while waiting, SIGTERM, SIGINT and SIGHUP to this process are passed on
      to every child (once; `SIGNAL_GRACE_S` later, or at a second signal, they are killed).
      Only from the main thread (`python -m earl_jax.launch` sets it).

  Returns:
    One result per process, in process order, when every child exits with 0.

  Raises:
    LaunchError: a child failed (naming the first to fail, how, and the tail of its stderr; a
      user error that the failing children reported as `error: ...` is given once, with
      `exit_code` 2), the timeout struck, a forwarded signal stopped the children
      (`exit_code` 128 + signal), or the command could not start (`exit_code` 2).
  """
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError(
      f'launch_local needs num_processes >= 1 and devices_per_process >= 1, got '
      f'{num_processes} and {devices_per_process}.'
    )
  if timeout is not None and not timeout > 0:
    raise ValueError(f'launch_local needs a timeout > 0 seconds (or None), got {timeout}.')
  group = _Group(argv, num_processes, stream_process)
  coordinator = f'127.0.0.1:{free_port()}'
  with _forwarding(group, forward_signals):
    try:
      for process_id in range(num_processes):
        group.start(_child_env(env, coordinator, num_processes, process_id, devices_per_process))
      outcome = group.wait(timeout)
    except OSError as e:  # from Popen: the command cannot run
      outcome = LaunchError(
        f'cannot start {argv[0]!r}: {e.strerror or e}: expected a program on PATH', exit_code=2
      )
    finally:
      group.stop(grace=STOP_GRACE_S)  # nothing left running, whatever happened
  results = group.results()
  if outcome is not None:
    raise outcome
  return results


def xla_flags_without_device_count(flags: str) -> list[str]:
  """The flags of an XLA_FLAGS value, less a fake CPU device count: for a process that sets its
  own and keeps the caller's other compiler settings."""
  return [f for f in flags.split() if 'host_platform_device_count' not in f]


def _child_env(
  extra: Mapping[str, str] | None,
  coordinator: str,
  num_processes: int,
  process_id: int,
  devices_per_process: int,
) -> dict[str, str]:
  """A child's environment: ours, `extra`, its fake CPU devices and the launcher's variables."""
  child_env = dict(os.environ)
  child_env.update(extra or {})
  flags = xla_flags_without_device_count(child_env.get('XLA_FLAGS', ''))
  flags.append(f'--xla_force_host_platform_device_count={devices_per_process}')
  child_env['XLA_FLAGS'] = ' '.join(flags)
  child_env.setdefault('JAX_PLATFORMS', 'cpu')
  # A child's output reaches the pipe as it is written, so a killed child's last lines are kept.
  child_env.setdefault('PYTHONUNBUFFERED', '1')
  child_env[ENV_COORDINATOR] = coordinator
  child_env[ENV_NUM_PROCESSES] = str(num_processes)
  child_env[ENV_PROCESS_ID] = str(process_id)
  child_env[ENV_LOCAL_DEVICES] = str(devices_per_process)
  return child_env


class _Reader:
  """Reads one child pipe to its end on a thread, keeping the last lines (and copying each line
  to `echo`, if given, as it comes)."""

  def __init__(self, stream, echo=None):
    self.lines: collections.deque[str] = collections.deque(maxlen=_KEPT_LINES)
    self.echoed_errors: set[str] = set()  # `error: ...` lines already shown through `echo`
    self._thread = threading.Thread(target=self._read, args=(stream, echo), daemon=True)
    self._thread.start()

  def _read(self, stream, echo) -> None:
    for line in iter(stream.readline, ''):
      self.lines.append(line)
      if echo is not None:
        echo.write(line)
        echo.flush()
        if line.startswith('error: '):
          self.echoed_errors.add(line.strip())
    stream.close()

  def text(self, timeout: float = 2.0) -> str:
    """Everything kept; waits up to `timeout` for the end of the pipe (a grandchild may hold
    it open)."""
    self._thread.join(timeout)
    return ''.join(list(self.lines))


class _Group:
  """The children of one launch, in process order (see `launch_local`)."""

  def __init__(self, argv: Sequence[str], num_processes: int, stream_process: int | None):
    self.argv = list(argv)
    self.num_processes = num_processes
    self.stream_process = stream_process
    self.procs: list[subprocess.Popen] = []
    self.out: list[_Reader | None] = []
    self.err: list[_Reader] = []
    self.stopped: set[int] = set()  # signalled by the launcher before they exited
    self.signals: list[int] = []  # received while forwarding

  def start(self, env: Mapping[str, str]) -> None:
    streamed = self.stream_process == len(self.procs)
    proc = subprocess.Popen(
      self.argv,
      env=dict(env),
      stdout=None if streamed else subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      errors='replace',
      process_group=0,  # terminal signals reach the launcher alone, which passes them on once
    )
    self.procs.append(proc)
    self.out.append(None if streamed else _Reader(proc.stdout))
    self.err.append(_Reader(proc.stderr, echo=sys.stderr if streamed else None))

  def wait(self, timeout: float | None) -> LaunchError | None:
    """Waits until every child exited with 0 (None), one failed, the timeout struck or a
    forwarded signal stopped them (the error to raise)."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    forwarded, signalled, kill_at = None, True, math.inf
    while True:
      codes = [p.poll() for p in self.procs]
      if self.signals and forwarded is None:
        forwarded = self.signals[0]
        self._signal_all(forwarded)
        kill_at = time.monotonic() + SIGNAL_GRACE_S
      if forwarded is None and (stop := _stop_on_request(codes)) is not None:
        # A process stopped at a step boundary on a signal of its own (a scheduler's SIGTERM to
        # one host): the others stop at the same step, having agreed on it. They are waited for.
        forwarded, signalled = stop, False
        kill_at = time.monotonic() + SIGNAL_GRACE_S
      if forwarded is not None and (len(self.signals) > 1 or time.monotonic() > kill_at):
        self._kill_all()
      if forwarded is not None and all(c is not None for c in codes):
        return self._signalled(forwarded, codes, passed_on=signalled)
      if forwarded is None:
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
          return self._failure(failed[0])
        if all(c == 0 for c in codes):
          return None
        if time.monotonic() > deadline:
          return self._timed_out(timeout)
      time.sleep(0.05)

  def _signal_all(self, signum: int) -> None:
    for i, proc in enumerate(self.procs):
      if proc.poll() is None:
        self.stopped.add(i)
        with contextlib.suppress(ProcessLookupError):
          os.kill(proc.pid, signum)

  def _kill_all(self) -> None:
    for i, proc in enumerate(self.procs):
      if proc.poll() is None:
        self.stopped.add(i)
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its group: its own children too

  def stop(self, *, grace: float) -> None:
    """SIGTERM to every child still running, SIGKILL to every group `grace` seconds later."""
    self._signal_all(signal.SIGTERM)
    end = time.monotonic() + grace
    while any(p.poll() is None for p in self.procs) and time.monotonic() < end:
      time.sleep(0.05)
    self._kill_all()
    for proc in self.procs:
      proc.wait()

  def results(self) -> list[ProcessResult]:
    return [
      ProcessResult(i, p.returncode, out.text() if out else '', err.text())
      for i, (p, out, err) in enumerate(zip(self.procs, self.out, self.err))
    ]

  def _failure(self, first: int) -> LaunchError:
    """The error for child `first` having failed (the others are being stopped)."""
    self.stop(grace=STOP_GRACE_S)
    results = self.results()
    code = results[first].returncode
    errors = _user_errors(results[first].stderr)
    if code == 2 and errors:
      # A user error, which every process reports alike: given once, with the code it came with.
      shown = set().union(*(r.echoed_errors for r in self.err))
      lines = []
      for r in results:
        if r.returncode == 2:
          lines += [e for e in _user_errors(r.stderr) if e not in shown and e not in lines]
      return LaunchError('\n'.join(lines), exit_code=2)
    others = [
      r.process_id
      for r in results
      if r.process_id != first and r.returncode != 0 and r.process_id not in self.stopped
    ]
    stopped = sorted(self.stopped - {first})
    lines = [
      f'process {first} of {self.num_processes} (pid {self.procs[first].pid}) failed '
      f'({_how(code)})'
      + (f'; processes {others} also failed' if others else '')
      + (f'; stopped processes {stopped}' if stopped else '')
      + f': {" ".join(self.argv)}'
    ]
    for r in [results[first], *(results[i] for i in others)][:4]:
      lines.append(_tail(r))
    return LaunchError('\n'.join(lines))

  def _timed_out(self, timeout: float | None) -> LaunchError:
    self.stop(grace=STOP_GRACE_S)
    results = self.results()
    lines = [
      f'{self.num_processes} of {self.num_processes} processes failed (timed out after '
      f'{timeout} s; every process was stopped): {" ".join(self.argv)}'
    ]
    lines += [_tail(r) for r in results[:4]]
    return LaunchError('\n'.join(lines))

  def _signalled(self, signum: int, codes: Sequence[int | None], *, passed_on: bool) -> LaunchError:
    name = signal.Signals(signum).name
    how = ', '.join(f'{i}: {_how(c)}' for i, c in enumerate(codes))
    origin = 'passed on to' if passed_on else 'received by one of'
    return LaunchError(
      f'{name}: {origin} the {self.num_processes} processes, which stopped ({how})',
      exit_code=128 + signum,
    )


def _stop_on_request(codes: Sequence[int | None]) -> int | None:
  """The signal a process that exited with 128 + SIGTERM or SIGINT stopped on (the trainer's
  exit after a stop at a step boundary, `earl_jax.run.preemption`), or None."""
  for code in codes:
    if code is not None and code - 128 in _STOP_SIGNALS:
      return code - 128
  return None


def _how(returncode: int | None) -> str:
  if returncode is not None and returncode < 0:
    return f'killed by {signal.Signals(-returncode).name}'
  return f'exit code {returncode}'


def _user_errors(stderr: str) -> list[str]:
  """The `error: ...` lines of a process that exited with a user error (runtime.run)."""
  return [line.strip() for line in stderr.splitlines() if line.startswith('error: ')]


def _tail(result: ProcessResult) -> str:
  lines = result.stderr.strip().splitlines()[-_TAIL_LINES:]
  body = '\n'.join(lines) if lines else '(empty)'
  return f'--- process {result.process_id} ({_how(result.returncode)}) stderr tail:\n{body}'


@contextlib.contextmanager
def _forwarding(group: _Group, enabled: bool):
  """While inside, SIGTERM / SIGINT / SIGHUP are recorded for `group.wait` to pass on."""
  if not enabled:
    yield
    return
  previous = {
    s: signal.signal(s, lambda signum, frame: group.signals.append(signum))
    for s in _FORWARDED_SIGNALS
  }
  try:
    yield
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


# ------------------------------------------------------------------------------------------------
# Agreement between the processes of one program (multi-controller): small host values only.
# Every function is a collective: every process calls it at the same point, with its own value.


def process_min(value: int | None) -> int | None:
  """The smallest of every process's `value` (None where every process has None)."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return value
  mine = np.array([-1 if value is None else int(value)], np.int64)
  values = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
  known = values[values >= 0]
  return int(known.min()) if known.size else None


def process_max(values: Sequence[int]) -> list[int]:
  """The elementwise largest of every process's int `values` (each process passes as many)."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return [int(v) for v in values]
  mine = np.asarray(list(values), np.int64)
  return np.asarray(multihost_utils.process_allgather(mine)).max(axis=0).astype(int).tolist()


def broadcast_json(obj: Any) -> Any:
  """Process 0's JSON-able `obj`, on every process (the others pass anything, e.g. None)."""
  import json

  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return obj
  data = json.dumps(obj).encode() if jax.process_index() == 0 else b''
  size = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))[0])
  buf = np.zeros(size, np.uint8)
  if jax.process_index() == 0:
    buf[:] = np.frombuffer(data, np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return json.loads(out.tobytes().decode())


def gather_rows(values: Any, held: Any) -> Any:
  """Per-row host values of every process, merged: row i from the first process that holds it.

  Args:
    values: [B, ...] numpy array; rows this process does not hold may contain anything.
    held: bool [B], the rows this process holds.

  Returns:
    [B, ...]: every row, as the (first) process that holds it has it.

  Raises:
    ValueError: some row is held by no process.
  """
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  values, held = np.asarray(values), np.asarray(held, bool)
  if jax.process_count() == 1:
    if not held.all():
      raise ValueError(f'gather_rows: rows {np.flatnonzero(~held)[:8].tolist()} are held nowhere.')
    return values
  all_values = np.asarray(multihost_utils.process_allgather(values))  # [P, B, ...]
  all_held = np.asarray(multihost_utils.process_allgather(held))  # [P, B]
  if not all_held.any(axis=0).all():
    missing = np.flatnonzero(~all_held.any(axis=0))[:8].tolist()
    raise ValueError(f'gather_rows: rows {missing} are held by no process.')
  first = np.argmax(all_held, axis=0)  # [B]
  return all_values[first, np.arange(values.shape[0])]


def allgather_bytes(data: bytes) -> list[bytes]:
  """Every process's `data`, in process order (each process passes its own, any length)."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  if jax.process_count() == 1:
    return [data]
  size = np.array([len(data)], np.int64)
  sizes = np.asarray(multihost_utils.process_allgather(size)).reshape(-1)
  buf = np.zeros(max(int(sizes.max()), 1), np.uint8)
  buf[: len(data)] = np.frombuffer(data, np.uint8)
  every = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
  return [every[p, : int(n)].tobytes() for p, n in enumerate(sizes)]


def row_holders(held: Any) -> Any:
  """bool [P, B]: which processes hold each row of a batch (`held`: bool [B], this process's)."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  held = np.asarray(held, bool)
  if jax.process_count() == 1:
    return held[None]
  return np.asarray(multihost_utils.process_allgather(held)).reshape(-1, held.shape[0])
