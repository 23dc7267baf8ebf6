"""The sandbox's API: verdicts, values, files, commands, limits-only mode, and its own failures."""

import ast
import json
import logging
import os
import signal
import threading
import time

import pytest

from earl_jax.sandbox import (
  Program,
  Sandbox,
  SandboxConfig,
  SandboxError,
  TestCase,
  probe_namespaces,
)
from earl_jax.sandbox import sandbox as sandbox_module

CONFIG = SandboxConfig(workers=2, test_timeout_s=1.0, program_timeout_s=3.0, cpu_s=2)
ADD = 'def add(a, b):\n  return a + b\n'
ADD_TESTS = [TestCase('add(1, 2)', 3), TestCase('add("a", "b")', 'ab'), TestCase('add(2, 5)', 7)]


@pytest.fixture(scope='module')
def box():
  with Sandbox(CONFIG) as sandbox:
    yield sandbox


def _uid_processes(uids, name: str | None = None) -> list[tuple[int, int]]:
  """(pid, ppid) of every process running as one of `uids` (and named `name`, if given)."""
  found = []
  for pid in os.listdir('/proc'):
    if not pid.isdigit():
      continue
    try:
      with open(f'/proc/{pid}/status') as f:
        fields = dict(line.split(':', 1) for line in f if ':' in line)
    except OSError:
      continue
    if int(fields['Uid'].split()[0]) in uids and name in (None, fields['Name'].strip()):
      found.append((int(pid), int(fields['PPid'])))
  return found


@pytest.mark.parametrize(
  'field, value',
  [
    ('workers', -1),
    ('test_timeout_s', 0.0),
    ('program_timeout_s', float('nan')),
    ('cpu_s', 0),
    ('memory_mib', 0),
    ('open_files', 2),
    ('output_bytes', 1),
    ('isolation', 'docker'),
  ],
)
def test_config_refuses_bad_values_naming_the_field(field, value):
  with pytest.raises(ValueError, match=f'SandboxConfig.{field}=') as error:
    SandboxConfig(**{field: value})
  assert '\n' not in str(error.value)


@pytest.mark.parametrize('path', ['/etc/passwd', '../up.py', 'a//b.py', './x.py', ''])
def test_program_files_must_be_plain_relative_paths(path):
  with pytest.raises(ValueError, match='not a plain relative path'):
    Program('x = 1', files={path: ''})


def test_program_files_cannot_be_a_file_and_a_directory():
  with pytest.raises(ValueError, match="'a' is a file and a directory"):
    Program('x = 1', files={'a': '', 'a/b.py': ''})


def test_a_right_program_passes_and_a_wrong_one_fails_per_test(box):
  verdict = box.check(Program(ADD), ADD_TESTS)
  assert (verdict.status, verdict.passed, verdict.total, verdict.reward) == ('pass', 3, 3, 1.0)
  assert verdict.feedback == ''
  assert [r.got for r in verdict.results] == ['3', "'ab'", '7']

  wrong = box.check(Program('def add(a, b):\n  return a * b if a != 1 else 3\n'), ADD_TESTS)
  assert wrong.status == 'error'  # the first failing test raised (str * str)
  assert [r.status for r in wrong.results] == ['pass', 'error', 'fail']
  assert wrong.passed == 1 and wrong.reward == pytest.approx(1 / 3)
  assert wrong.feedback.startswith('add("a", "b"): TypeError: ')
  assert wrong.results[2].got == '10'


def test_expected_values_never_leave_the_parent(box, monkeypatch):
  sent = []
  submit = Sandbox._submit
  monkeypatch.setattr(
    Sandbox, '_submit', lambda self, jobs: sent.extend(jobs) or submit(self, jobs)
  )
  secret = 'expected-value-' + '7f3a9c'
  verdict = box.check(Program('def f():\n  return 1\n'), [TestCase('f()', secret)])
  assert verdict.status == 'fail'
  (job,) = sent
  assert set(job) == {'op', 'id', 'source', 'files', 'calls', 'test_timeout_s', 'program_timeout_s'}
  assert secret not in repr(job)


def test_feedback_shows_the_call_expected_and_got(box):
  verdict = box.check(Program('def add(a, b):\n  return a - b\n'), ADD_TESTS[:1])
  assert verdict.status == 'fail'
  assert verdict.feedback == 'add(1, 2): expected 3, got -1'


def test_check_many_runs_in_parallel_and_keeps_input_order(box):
  jobs = [
    (
      Program(f'import time\ndef f():\n  time.sleep(0.6)\n  return {i}\n'),
      [TestCase('f()', i if i % 3 else -1)],
    )
    for i in range(4)
  ]
  started = time.monotonic()
  verdicts = box.check_many(jobs)
  elapsed = time.monotonic() - started
  assert [v.status for v in verdicts] == ['fail', 'pass', 'pass', 'fail']
  assert elapsed < 4 * 0.6 - 0.3  # two workers: about 1.2 s


@pytest.mark.parametrize(
  'expression, expected, passes',
  [
    ('None', None, True),
    (
      '(1, [2.5, "s"], {"k": {1, 2}}, frozenset({b"x"}))',
      (1, [2.5, 's'], {'k': {1, 2}}, frozenset({b'x'})),
      True,
    ),
    ('2 ** 200', 2**200, True),
    ('-0.1 + 2j', -0.1 + 2j, True),
    ('float("nan")', float('nan'), False),  # nan != nan, as with ==
    ('True', 1, True),  # Python equality, as `assert candidate(x) == 1` has it
    ('[1, 2]', (1, 2), False),  # types matter where == says so
    ('"\\ud800 é"', '\ud800 é', True),
  ],
)
def test_plain_values_come_back_with_their_type(box, expression, expected, passes):
  verdict = box.check(Program(f'def f():\n  return {expression}\n'), [TestCase('f()', expected)])
  assert (verdict.status == 'pass') is passes, verdict.feedback


def test_tolerances_and_predicates_are_checked_in_the_parent(box):
  program = Program('def f(x):\n  return [x / 3, {"a": x / 7}]\n')
  tests = [
    TestCase('f(1.0)', [0.3333333, {'a': 0.142857}], abs_tol=1e-6),
    TestCase('f(1.0)', [0.3333333, {'a': 0.142857}]),
    TestCase('f(3.0)', 'first is one', predicate=lambda got: got[0] == 1.0),
    TestCase('f(3.0)', 'raises on a wrong shape', predicate=lambda got: got['missing']),
  ]
  verdict = box.check(program, tests)
  assert [r.ok for r in verdict.results] == [True, False, True, False]
  assert verdict.results[3].error.startswith('TypeError')


def test_files_sit_beside_main_and_each_program_gets_a_fresh_directory(box):
  program = Program(
    'import os, helper\ndef f():\n  names = sorted(os.listdir("."))\n'
    '  open("scratch.txt", "w").write("x")\n  return names, helper.VALUE, os.getcwd() == os.environ["HOME"]\n',
    files={'helper.py': 'VALUE = 42\n', 'pkg/data.txt': 'd'},
  )
  first, second = box.check_many(
    [(program, [TestCase('f()', (['helper.py', 'main.py', 'pkg'], 42, True))])] * 2
  )
  assert first.status == second.status == 'pass', (first.feedback, second.feedback)


def test_programs_run_isolated_with_a_fixed_environment(box):
  probe = Program(
    'import os, sys\ndef f():\n'
    '  return sorted(os.environ), sys.flags.isolated, os.getuid(), os.getsid(0) == os.getpid()\n'
  )
  verdict = box.check(probe, [TestCase('f()', None)])
  names, isolated, uid, own_session = ast.literal_eval(verdict.results[0].got)
  assert set(names) == {
    'HOME',
    'LANG',
    'LC_ALL',
    'MKL_NUM_THREADS',
    'OMP_NUM_THREADS',
    'OPENBLAS_NUM_THREADS',
    'PATH',
    'PYTHONDONTWRITEBYTECODE',
    'PYTHONIOENCODING',
    'TMPDIR',
  }
  assert isolated == 1 and own_session
  if os.geteuid() == 0:
    assert uid in box.program_uids and uid != 0


def test_run_command_runs_unittest_with_capped_output(box):
  files = {
    'calc.py': 'def double(x):\n  return 2 * x\n',
    'test_calc.py': 'import unittest, calc\nclass T(unittest.TestCase):\n'
    '  def test_double(self):\n    self.assertEqual(calc.double(2), 4)\n',
  }
  result = box.run_command(files, ['python', '-m', 'unittest', '-q'])
  assert (result.exit_code, result.timed_out) == (0, False), result.output
  assert 'Ran 1 test' in result.output

  broken = box.run_command(
    {**files, 'calc.py': 'def double(x):\n  return x\n'}, ['python', '-m', 'unittest', '-q']
  )
  assert broken.exit_code == 1 and 'FAILED (failures=1)' in broken.output

  flood = box.run_command({'f.py': 'print("x" * 10 ** 6)\n'}, ['python', 'f.py'])
  assert flood.exit_code == 0 and 'bytes omitted' in flood.output
  assert len(flood.output) <= CONFIG.output_bytes + 100

  slow = box.run_command({'s.py': 'while True: pass\n'}, ['python', 's.py'], timeout_s=0.5)
  assert (slow.exit_code, slow.timed_out) == (None, True)
  assert slow.seconds < 0.5 + 1.0


def test_run_command_bounds_the_memory_of_all_its_processes():
  hog = (
    'import os, time\nfor _ in range(6):\n  if os.fork() == 0:\n'
    '    hoard = bytearray(100 << 20)\n    time.sleep(100)\ntime.sleep(100)\n'
  )
  small = Sandbox(SandboxConfig(workers=1, memory_mib=128))
  with small:
    result = small.run_command({'hog.py': hog}, ['python', 'hog.py'], timeout_s=5)
  assert (result.exit_code, result.timed_out) == (-signal.SIGKILL, False)
  assert 'held over 256 MiB' in result.output and result.seconds < 3


def test_a_worker_killed_mid_run_is_replaced_and_its_program_is_a_crash():
  with Sandbox(SandboxConfig(workers=1, test_timeout_s=20.0, program_timeout_s=20.0)) as box:
    if not box.program_uids:
      pytest.skip('not root: programs share our uid, so the worker cannot be told apart')
    results = []
    sleeper = Program(
      'import ctypes, time\ndef f():\n'
      '  ctypes.CDLL(None).prctl(15, b"earl-sleeper", 0, 0, 0)\n'  # PR_SET_NAME
      '  time.sleep(30)\n'
    )
    thread = threading.Thread(
      target=lambda: results.append(box.check(sleeper, [TestCase('f()', 1)]))
    )
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
      if running := _uid_processes(box.program_uids, name='earl-sleeper'):
        break
      time.sleep(0.02)
    assert running, 'the program never started'
    _, worker = running[0]
    os.kill(worker, signal.SIGKILL)
    thread.join(timeout=10)
    (verdict,) = results
    assert verdict.status == 'crash'
    assert 'worker' in verdict.feedback and 'died' in verdict.feedback
    assert verdict.results[0].status == 'crash'
    assert box.check(Program(ADD), ADD_TESTS).status == 'pass'  # a new worker took its place
    assert _uid_processes(box.program_uids) == []


def test_a_dead_launcher_raises_sandbox_error_never_a_verdict():
  box = Sandbox(SandboxConfig(workers=1, test_timeout_s=20.0, program_timeout_s=20.0))
  try:
    errors = []

    def check():
      try:
        box.check(Program('import time\ndef f():\n  time.sleep(30)\n'), [TestCase('f()', 1)])
      except SandboxError as e:
        errors.append(e)

    thread = threading.Thread(target=check)
    thread.start()
    time.sleep(0.3)
    box._process.kill()
    thread.join(timeout=10)
    assert len(errors) == 1 and 'launcher' in str(errors[0])
    with pytest.raises(SandboxError):
      box.check(Program(ADD), ADD_TESTS)
  finally:
    box.close()


def test_a_launcher_that_cannot_start_raises_sandbox_error(monkeypatch):
  monkeypatch.setattr(sandbox_module, '_LAUNCHER', '/nonexistent/_launcher.py')
  with pytest.raises(SandboxError, match='launcher'):
    Sandbox(SandboxConfig(workers=1, isolation='limits', start_timeout_s=10.0))


def test_a_closed_sandbox_refuses_work():
  box = Sandbox(SandboxConfig(workers=1))
  box.close()
  box.close()
  with pytest.raises(SandboxError, match='closed'):
    box.check(Program(ADD), ADD_TESTS)


def test_limits_only_mode_still_bounds_programs():
  with Sandbox(
    SandboxConfig(workers=1, test_timeout_s=0.5, program_timeout_s=2.0, isolation='limits')
  ) as box:
    assert box.isolation == 'limits-only' and 'limits' in box.isolation_reason
    loop, add = box.check_many(
      [
        (Program('def add(a, b):\n  while True:\n    pass\n'), ADD_TESTS[:1]),
        (Program(ADD), ADD_TESTS[:1]),
      ]
    )
    assert (loop.status, add.status) == ('timeout', 'pass')
    assert loop.seconds < 0.5 + 1.0
    if box.program_uids:
      assert _uid_processes(box.program_uids) == []


def test_isolation_is_found_once_and_logged_in_one_line(caplog):
  available, reason = probe_namespaces()
  with caplog.at_level(logging.INFO), Sandbox(SandboxConfig(workers=1)) as box:
    pass
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('sandbox: ')]
  assert len(lines) == 1 and '\n' not in lines[0]
  if available:
    assert box.isolation == 'namespaces'
    assert lines[0].startswith('sandbox: isolation=namespaces')
  else:
    assert box.isolation == 'limits-only'
    assert lines[0].startswith(f'sandbox: isolation=limits-only ({reason}')


def test_an_interpreter_under_tmp_stays_reachable(tmp_path):
  """A virtualenv under /tmp (a CI checkout there): the sandbox covers /tmp with its own tmpfs,
  yet the programs and commands it runs by that interpreter's path still start."""
  import subprocess
  import sys
  import sysconfig

  venv = tmp_path / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  script = (
    'import json, sys\n'
    f'sys.path[:0] = [{repo!r}, {sysconfig.get_paths()["purelib"]!r}]\n'  # earl_jax, absl
    'from earl_jax.sandbox import Program, Sandbox, SandboxConfig, TestCase\n'
    'with Sandbox(SandboxConfig(workers=1)) as box:\n'
    '  verdict = box.check(Program("def f():\\n  return 7\\n"), [TestCase("f()", 7)])\n'
    '  command = box.run_command({}, ["python", "-c", "print(6 * 7)"])\n'
    '  print(json.dumps([box.isolation, verdict.status, command.exit_code, command.output]))\n'
  )
  run = subprocess.run(
    [str(venv / 'bin' / 'python'), '-c', script], capture_output=True, text=True, timeout=120
  )
  assert run.returncode == 0, run.stderr[-2000:]
  isolation, status, exit_code, output = json.loads(run.stdout.splitlines()[-1])
  assert (status, exit_code, output.strip()) == ('pass', 0, '42'), (isolation, output)
