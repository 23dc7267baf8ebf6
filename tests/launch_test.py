"""`python -m earl_jax.launch` owns its workers: signals reach them, a dead one stops the rest,
user errors end in one line with exit code 2.

The workers are a few lines of Python (no JAX), so that every case takes about a second.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from earl_jax import launch
from earl_jax.testing import helpers

# Each worker writes its pid to <dir>/pid.<id>, says it is ready on stderr and waits; a signal
# it receives is written to <dir>/got.<id> before it exits with 128 + the signal. With 'error',
# every worker reports a user error as `runtime.run` does.
WORKER = """
import os, signal, sys, time
mode, folder = sys.argv[1], sys.argv[2]
me = os.environ['EARL_PROCESS_ID']
if mode == 'error':
  print('error: ExperimentConfig.steps must be a positive int, got 0.', file=sys.stderr)
  sys.exit(2)
def stop(signum, frame):
  with open(os.path.join(folder, 'got.' + me), 'w') as f:
    f.write(signal.Signals(signum).name)
  sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print(f'worker {me} ready', file=sys.stderr, flush=True)
with open(os.path.join(folder, 'pid.' + me), 'w') as f:
  f.write(str(os.getpid()))
time.sleep(120)
"""


def _start(tmp_path, mode: str, *, num_processes: int = 2) -> subprocess.Popen:
  script = tmp_path / 'worker.py'
  script.write_text(WORKER)
  env = {**os.environ, 'PYTHONPATH': helpers.ROOT}
  worker = [sys.executable, str(script), mode, str(tmp_path)]
  return subprocess.Popen(
    [sys.executable, '-m', 'earl_jax.launch', '-n', str(num_processes), '-d', '1', '--', *worker],
    cwd=helpers.ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _worker_pids(tmp_path, num_processes: int) -> list[int]:
  """The workers' pids, once every worker is up."""
  paths = [tmp_path / f'pid.{i}' for i in range(num_processes)]
  deadline = time.monotonic() + 60
  while not all(p.exists() and p.read_text() for p in paths):
    assert time.monotonic() < deadline, 'the workers did not start'
    time.sleep(0.05)
  return [int(p.read_text()) for p in paths]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_a_killed_worker_stops_the_launcher_within_seconds_naming_it(tmp_path):
  launcher = _start(tmp_path, 'wait', num_processes=3)
  pids = _worker_pids(tmp_path, 3)
  t0 = time.monotonic()
  os.kill(pids[1], signal.SIGKILL)
  _, err = launcher.communicate(timeout=30)
  took = time.monotonic() - t0
  assert launcher.returncode == 1, err
  assert took < 10, f'the launcher took {took:.1f} s to stop after its worker died'
  # Worker 0's stderr streams to the launcher's, then comes the launcher's verdict.
  first = next(line for line in err.splitlines() if line.startswith('process 1 of 3'))
  assert f'process 1 of 3 (pid {pids[1]}) failed (killed by SIGKILL)' in first, err
  assert 'stopped processes [0, 2]' in first, err
  # The tail of the dead worker's stderr, not an empty one.
  assert 'process 1 (killed by SIGKILL) stderr tail:\nworker 1 ready' in err, err
  # The others were stopped (SIGTERM reached them) and none is left running.
  assert (tmp_path / 'got.0').read_text() == 'SIGTERM'
  assert (tmp_path / 'got.2').read_text() == 'SIGTERM'
  assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_reaches_every_worker(tmp_path, signum):
  launcher = _start(tmp_path, 'wait')
  pids = _worker_pids(tmp_path, 2)
  launcher.send_signal(signum)
  _, err = launcher.communicate(timeout=30)
  name = signal.Signals(signum).name
  assert launcher.returncode == 128 + signum, err
  # Each worker got the signal once, and stopped in its own way.
  for i in range(2):
    assert (tmp_path / f'got.{i}').read_text() == name
  assert f'{name}: passed on to the 2 processes' in err
  assert f'exit code {128 + signum}' in err
  assert not any(_alive(p) for p in pids)


def test_workers_that_stop_on_a_signal_of_their_own_are_not_a_failure(tmp_path):
  """A scheduler signals the workers, not the launcher: they stop on request (128 + SIGTERM, as
  the trainer exits after saving), and the launcher says so with the same exit code."""
  launcher = _start(tmp_path, 'wait')
  pids = _worker_pids(tmp_path, 2)
  os.kill(pids[1], signal.SIGTERM)
  time.sleep(0.5)  # the other one stops a little later (at the same step, in the trainer)
  os.kill(pids[0], signal.SIGTERM)
  _, err = launcher.communicate(timeout=30)
  assert launcher.returncode == 143, err
  assert 'SIGTERM: received by one of the 2 processes, which stopped' in err, err
  assert 'failed' not in err, err


def test_a_user_error_in_the_workers_is_printed_once_with_exit_code_2(tmp_path):
  launcher = _start(tmp_path, 'error', num_processes=3)
  _, err = launcher.communicate(timeout=30)
  assert launcher.returncode == 2, err
  lines = [line for line in err.splitlines() if line.strip()]
  assert lines == ['error: ExperimentConfig.steps must be a positive int, got 0.'], err


@pytest.mark.parametrize(
  'args, fragment',
  [
    (['-n', '0'], '--num_processes/-n=0: expected an int >= 1'),
    (['-d', '0'], '--devices_per_process/-d=0: expected an int >= 1'),
    (['-n', 'two'], "invalid int value: 'two'"),
    (['--timeout=-5'], '--timeout=-5.0: expected seconds > 0'),
    (['--timeout=nan'], '--timeout=nan'),
    (['--', 'no_such_program'], "'no_such_program' is not a program on PATH"),
    (['--', './no/such/file.py'], "'./no/such/file.py' is not an executable file"),
    ([], 'give the command to run after --'),
  ],
)
def test_bad_arguments_end_in_one_line(capsys, args, fragment):
  if args and args[0] != '--' and '--' not in args:
    args = [*args, '--', 'true']
  with pytest.raises(SystemExit) as exit_info:
    launch.main(args)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ') and fragment in lines[0], err


def test_a_program_that_cannot_start_is_a_user_error(tmp_path, capsys):
  program = tmp_path / 'garbage'
  program.write_bytes(b'\x00\x01 not a program')
  os.chmod(program, 0o755)  # on PATH terms it runs; the kernel refuses its format
  assert launch.main(['-n', '2', '--', str(program)]) == 2
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: cannot start '{program}'"), lines
