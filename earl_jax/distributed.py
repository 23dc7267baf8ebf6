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

import dataclasses
import os
import socket
import subprocess
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
  pass


def launch_local(
  argv: Sequence[str],
  *,
  num_processes: int,
  devices_per_process: int,
  env: Mapping[str, str] | None = None,
  timeout: float | None = 600.0,
  stream_process: int | None = None,
) -> list[ProcessResult]:
  """Runs `argv` as `num_processes` local JAX processes joined over loopback.

  Each child sees EARL_COORDINATOR / EARL_NUM_PROCESSES / EARL_PROCESS_ID / EARL_LOCAL_DEVICES,
  plus XLA_FLAGS forcing `devices_per_process` CPU devices. Entry points call
  `initialize_from_env()`.

  Args:
    argv: the command each process runs.
    num_processes: N.
    devices_per_process: fake CPU devices in each process.
    env: extra environment variables for every child.
    timeout: seconds before all children are killed.
    stream_process: if set, that child's stdout and stderr go straight to this terminal.

  Returns:
    One result per process, in process order. Raises LaunchError if any child fails or times
    out, with the tail of every failing child's stderr.
  """
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError(
      f'launch_local needs num_processes >= 1 and devices_per_process >= 1, got '
      f'{num_processes} and {devices_per_process}.'
    )
  coordinator = f'127.0.0.1:{free_port()}'
  procs = []
  for pid in range(num_processes):
    child_env = dict(os.environ)
    child_env.update(env or {})
    flags = [
      f for f in child_env.get('XLA_FLAGS', '').split() if 'host_platform_device_count' not in f
    ]
    flags.append(f'--xla_force_host_platform_device_count={devices_per_process}')
    child_env['XLA_FLAGS'] = ' '.join(flags)
    child_env.setdefault('JAX_PLATFORMS', 'cpu')
    child_env[ENV_COORDINATOR] = coordinator
    child_env[ENV_NUM_PROCESSES] = str(num_processes)
    child_env[ENV_PROCESS_ID] = str(pid)
    child_env[ENV_LOCAL_DEVICES] = str(devices_per_process)
    streamed = stream_process == pid
    procs.append(
      subprocess.Popen(
        list(argv),
        env=child_env,
        stdout=None if streamed else subprocess.PIPE,
        stderr=None if streamed else subprocess.PIPE,
        text=True,
      )
    )
  deadline = None if timeout is None else time.monotonic() + timeout
  results: list[ProcessResult | None] = [None] * num_processes
  timed_out = False
  try:
    for pid, p in enumerate(procs):
      remaining = None if deadline is None else max(1.0, deadline - time.monotonic())
      try:
        out, err = p.communicate(timeout=remaining)
      except subprocess.TimeoutExpired:
        timed_out = True
        break
      results[pid] = ProcessResult(pid, p.returncode, out or '', err or '')
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for pid, p in enumerate(procs):
      if results[pid] is None:
        out, err = p.communicate()
        results[pid] = ProcessResult(pid, p.returncode, out or '', err or '')
  done = [r for r in results if r is not None]
  failed = [r for r in done if r.returncode != 0]
  if timed_out or failed:
    lines = [
      f'{len(failed)} of {num_processes} processes failed'
      + (f' (timed out after {timeout} s)' if timed_out else '')
      + f': {" ".join(argv)}'
    ]
    for r in failed[:4]:
      tail = '\n'.join(r.stderr.strip().splitlines()[-25:])
      lines.append(f'--- process {r.process_id} (exit {r.returncode}) stderr tail:\n{tail}')
    raise LaunchError('\n'.join(lines))
  return done


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
