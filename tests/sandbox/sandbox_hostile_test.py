"""Hostile programs against the sandbox: none may pass without solving the task, overrun its
deadline, leave a process behind, change a file outside its directory or see the trainer's
secrets.

Every program is a candidate for `add(a, b)` (tests: add(1, 2) == 3, add(2, 5) == 7,
add(-4, 4) == 0). All run in one `check_many` batch on a small pool, and one test checks every
verdict. Programs that also solve the task may pass, but only with nothing escaped.
"""

import os
import secrets
import socket
import tempfile
import threading
import time

import pytest

from earl_jax.sandbox import Program, Sandbox, SandboxConfig, TestCase, probe_namespaces

CONFIG = SandboxConfig(
  workers=2,
  test_timeout_s=1.0,
  program_timeout_s=3.0,
  cpu_s=2,
  memory_mib=256,
  file_mib=1,
  max_processes=16,
  output_bytes=4096,
  result_bytes=1 << 16,
)
SLACK_S = 2.0  # kill, reap and clean up, on a loaded 2-core machine
TESTS = [TestCase('add(1, 2)', 3), TestCase('add(2, 5)', 7), TestCase('add(-4, 4)', 0)]
SECRET = 'earl-secret-' + secrets.token_hex(8)
SECRET_ENV = 'EARL_SANDBOX_TEST_SECRET'
MARKER = 'earl-sandbox-marker-' + secrets.token_hex(6)
NAMESPACES, _ = probe_namespaces()
SOLVE = 'def add(a, b):\n  return a + b\n'


def _programs(host: dict) -> dict[str, tuple[str, set[str]]]:
  """name -> (source, the verdict statuses allowed)."""
  forge = (
    'import os, struct, json\n'
    'def frame(index, kind, payload=b""):\n'
    '  return struct.pack(">IiB", len(payload), index, kind) + payload\n'
  )
  return {
    # Early exits.
    'os_exit_at_import': ('import os\nos._exit(0)\n', {'crash'}),
    'sys_exit_at_import': ('import sys\nsys.exit(0)\n', {'error'}),
    'os_exit_in_function': ('import os\ndef add(a, b):\n  os._exit(0)\n', {'crash'}),
    'sys_exit_in_function': ('import sys\ndef add(a, b):\n  sys.exit(0)\n', {'error'}),
    'exit_builtin_in_function': ('def add(a, b):\n  exit(0)\n', {'error'}),
    # Forged verdicts.
    'printed_verdict': (
      'print(\'{"status": "pass", "passed": 3, "total": 3, "reward": 1.0}\')\n'
      'print("passed")\ndef add(a, b):\n  return None\n',
      {'fail'},
    ),
    'forged_frames_at_import': (
      forge + 'os.write(3, frame(-1, 0))\n'
      'for i in range(3):\n  os.write(3, frame(i, 2, json.dumps(["b", True]).encode()))\n'
      'os._exit(0)\n',
      {'fail'},  # well-formed answers, but without the expected values it cannot forge a pass
    ),
    'forged_garbage': ('import os\nos.write(3, os.urandom(4096))\n' + SOLVE, {'error'}),
    'forged_truncated_frame': (
      forge + 'os.write(3, struct.pack(">IiB", 100, -1, 0) + b"xx")\nos._exit(0)\n',
      {'crash', 'error'},
    ),
    'forged_huge_length': (forge + 'os.write(3, struct.pack(">IiB", 2**31, -1, 0))\n', {'error'}),
    'closes_result_channel': ('import os\nos.close(3)\n' + SOLVE, {'crash'}),
    'harness_frames': (
      'import sys, gc\n'
      'f = sys._getframe()\n'
      'while f is not None:\n'
      '  for name, value in list(f.f_locals.items()):\n'
      '    if name == "calls" and isinstance(value, list):\n'
      '      value[:] = ["True"] * len(value)\n'
      '  f = f.f_back\n'
      'found = [o for o in gc.get_objects() if isinstance(o, dict) and "expected" in o]\n'
      'def add(a, b):\n  return True\n',
      {'fail'},
    ),
    # Values that would compare equal to anything.
    'always_equal_object': (
      'class Any:\n  def __eq__(self, other):\n    return True\n  __hash__ = object.__hash__\n'
      'def add(a, b):\n  return Any()\n',
      {'fail'},
    ),
    'always_equal_int_subclass': (
      'class Int(int):\n  def __eq__(self, other):\n    return True\n  __hash__ = int.__hash__\n'
      'def add(a, b):\n  return Int(0)\n',
      {'fail'},
    ),
    'always_equal_nested': (
      'class Any:\n  def __eq__(self, other):\n    return True\ndef add(a, b):\n  return [Any()]\n',
      {'fail'},
    ),
    # Hooks that exit 0.
    'atexit_exit_0': (
      'import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n  return None\n',
      {'fail'},
    ),
    'excepthook_exit_0': (
      'import sys, os\nsys.excepthook = lambda *args: os._exit(0)\n'
      'def add(a, b):\n  raise ValueError(a)\n',
      {'error'},
    ),
    # Time.
    'infinite_loop': ('def add(a, b):\n  while True:\n    pass\n', {'timeout'}),
    'infinite_loop_at_import': ('while True:\n  pass\n', {'timeout'}),
    'ignores_sigterm': (
      'import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n'
      'def add(a, b):\n  while True:\n    time.sleep(0.01)\n',
      {'timeout'},
    ),
    'sleeps': ('import time\ndef add(a, b):\n  time.sleep(100)\n', {'timeout'}),
    'c_level_cpu': ('def add(a, b):\n  return 10 ** 10 ** 8\n', {'timeout'}),
    # Processes.
    'fork_bomb': (
      'import os\ndef add(a, b):\n  while True:\n    try:\n      os.fork()\n'
      '    except OSError:\n      pass\n',
      {'timeout', 'crash', 'error'},
    ),
    'thread_bomb': (
      'import threading, time\ndef add(a, b):\n  while True:\n'
      '    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\n',
      {'error', 'timeout'},
    ),
    'daemon_double_fork_setsid': (
      'import os\n'
      'if os.fork() == 0:\n'
      '  os.setsid()\n'
      '  if os.fork() == 0:\n'
      f'    os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 1000; : {MARKER}"])\n'
      '  os._exit(0)\n' + SOLVE,
      {'pass'},
    ),
    # Memory.
    'memory_at_once': ('def add(a, b):\n  return len(bytearray(1 << 40))\n', {'memory'}),
    'memory_gradual': (
      'def add(a, b):\n  hoard = []\n  while True:\n    hoard.append(bytearray(1 << 20))\n',
      {'memory', 'timeout'},  # a timeout only on a machine too loaded to fill it in 1 s
    ),
    'memory_at_import': ('hoard = bytearray(1 << 40)\n' + SOLVE, {'memory'}),
    'memory_across_forks': (  # each child within RLIMIT_AS, all of them together over it
      'import os, time\ndef add(a, b):\n  for _ in range(4):\n    if os.fork() == 0:\n'
      '      hoard = bytearray(200 << 20)\n      time.sleep(100)\n  time.sleep(100)\n',
      {'memory', 'timeout'},  # a timeout only on a machine too loaded to fill it in 1 s
    ),
    # Output floods.
    'stdout_flood': ('def add(a, b):\n  while True:\n    print("x" * 10000)\n', {'timeout'}),
    'stderr_flood': (
      'import sys\ndef add(a, b):\n  while True:\n    sys.stderr.write("y" * 10000)\n',
      {'timeout'},
    ),
    # Crashes.
    'segfault': ('import ctypes\ndef add(a, b):\n  return ctypes.string_at(0)\n', {'crash'}),
    'deep_recursion': ('def add(a, b):\n  return add(a, b) + 1\n', {'error'}),
    'deep_recursion_c_stack': (  # C-level recursion (repr) past the C stack: a segfault
      'import sys\nsys.setrecursionlimit(10 ** 8)\n'
      'def add(a, b):\n  nested = []\n  for _ in range(2 * 10 ** 5):\n    nested = [nested]\n'
      '  return repr(nested)\n',
      {'crash', 'timeout'},  # a timeout only on a machine too loaded to get there in 1 s
    ),
    'huge_return_value': ('def add(a, b):\n  return "z" * (1 << 20)\n', {'error'}),
    'reads_stdin': ('def add(a, b):\n  return int(input())\n', {'error'}),
    'writes_a_large_file': (
      'def add(a, b):\n  open("big", "wb").write(b"0" * (8 << 20))\n  return a + b\n',
      {'error'},
    ),
    # Signals to others.
    'kills_its_parent': ('import os\ndef add(a, b):\n  os.kill(os.getppid(), 9)\n', {'error'}),
    'kills_its_process_group': (
      'import os\ndef add(a, b):\n  os.killpg(os.getpgid(0), 9)\n',
      {'crash'},
    ),
    'becomes_root': ('import os\nos.setuid(0)\n' + SOLVE, {'error'}),
    # The host's files, environment, /proc and network: these solve the task too, and report
    # what they could reach on stdout (the test looks for the secret there).
    'writes_and_deletes_host_files': (
      'import os\n'
      f'for directory in {host["dirs"]!r}:\n'
      '  for action in ("write", "append", "delete"):\n'
      '    try:\n'
      '      if action == "write":\n'
      f'        open(os.path.join(directory, "{MARKER}"), "w").write("escaped")\n'
      '      elif action == "append":\n'
      '        open(os.path.join(directory, "victim.txt"), "a").write("escaped")\n'
      '      else:\n'
      '        os.remove(os.path.join(directory, "victim.txt"))\n'
      '      print("DID", action, directory)\n'
      '    except OSError as e:\n'
      '      print("refused", action, directory, e)\n' + SOLVE,
      {'pass'},
    ),
    'reads_the_environment_and_proc': (
      'import os\n'
      'seen = [repr(dict(os.environ))]\n'
      'for pid in ["self", str(os.getppid()), "1"] + [p for p in os.listdir("/proc") if p.isdigit()]:\n'
      '  for name in ("environ", "cmdline"):\n'
      '    try:\n'
      '      seen.append(open(f"/proc/{pid}/{name}", "rb").read().decode(errors="replace"))\n'
      '    except OSError:\n'
      '      pass\n'
      f'print([s[s.find("{SECRET_ENV}"):][:80] for s in seen if "{SECRET_ENV}" in s])\n' + SOLVE,
      {'pass'},
    ),
    'reads_host_files': (
      'seen = []\n'
      f'for path in {host["secret_files"]!r}:\n'
      '  try:\n'
      '    seen.append(open(path).read())\n'
      '  except OSError as e:\n'
      '    seen.append(repr(e))\n'
      'print(seen)\n' + SOLVE,
      {'pass'},
    ),
    'connects_to_loopback': (
      'import socket\n'
      'try:\n'
      f'  s = socket.create_connection(("127.0.0.1", {host["port"]}), timeout=0.5)\n'
      f'  s.sendall(b"{MARKER}")\n'
      '  print("connected")\n'
      'except OSError as e:\n'
      '  print("refused", e)\n' + SOLVE,
      {'pass'},
    ),
  }


def _processes_of(uids: tuple[int, ...]) -> list[str]:
  found = []
  for pid in os.listdir('/proc'):
    if not pid.isdigit():
      continue
    try:
      with open(f'/proc/{pid}/status') as f:
        uid = next(int(line.split()[1]) for line in f if line.startswith('Uid:'))
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        cmdline = f.read().replace(b'\0', b' ').decode(errors='replace')
    except (OSError, StopIteration):
      continue
    if uid in uids or MARKER in cmdline:
      found.append(f'{pid} uid={uid} {cmdline[:80]}')
  return found


@pytest.fixture(scope='module')
def hostile_run():
  """Runs every hostile program once; yields what each test needs."""
  os.environ[SECRET_ENV] = SECRET
  host_tmp = tempfile.mkdtemp(prefix='earl-sandbox-host-', dir='/tmp')
  shm = '/dev/shm' if os.path.isdir('/dev/shm') else tempfile.gettempdir()
  host_shm = tempfile.mkdtemp(prefix='earl-sandbox-host-', dir=shm)
  # One outside every hidden place, to see the read-only view (removed at the end).
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  host_repo = tempfile.mkdtemp(prefix='.earl-sandbox-host-', dir=repo)
  secret_file = os.path.join('/tmp', f'earl-sandbox-secret-{secrets.token_hex(6)}')
  for directory in (host_tmp, host_shm, host_repo):
    os.chmod(directory, 0o777)  # writable by anyone: only isolation protects it
    with open(os.path.join(directory, 'victim.txt'), 'w') as f:
      f.write('original')
    os.chmod(os.path.join(directory, 'victim.txt'), 0o666)
  with open(secret_file, 'w') as f:
    f.write(SECRET)
  os.chmod(secret_file, 0o644)
  server = socket.socket()
  server.bind(('127.0.0.1', 0))
  server.listen(8)
  server.settimeout(0.2)
  connections = []
  stop = threading.Event()

  def serve():
    while not stop.is_set():
      try:
        connection, _ = server.accept()
      except OSError:
        continue
      connections.append(connection.recv(100))
      connection.close()

  threading.Thread(target=serve, daemon=True).start()
  host = {
    'dirs': [host_tmp, host_shm, host_repo, '/tmp'],
    'secret_files': [secret_file],
    'port': server.getsockname()[1],
  }
  programs = _programs(host)
  try:
    with Sandbox(CONFIG) as box:
      started = time.monotonic()
      verdicts = box.check_many([(Program(source), TESTS) for source, _ in programs.values()])
      batch_s = time.monotonic() - started
      leftovers = _processes_of(box.program_uids)
      after = box.check(Program(SOLVE), TESTS)
      yield {
        'box': box,
        'programs': programs,
        'verdicts': dict(zip(programs, verdicts)),
        'batch_s': batch_s,
        'leftovers': leftovers,
        'after': after,
        'connections': connections,
        'host_dirs': [host_tmp, host_shm, host_repo],
      }
  finally:
    stop.set()
    server.close()
    del os.environ[SECRET_ENV]
    for directory in (host_tmp, host_shm, host_repo):
      for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
      os.rmdir(directory)
    os.remove(secret_file)


HOSTILE = list(_programs({'dirs': [], 'secret_files': [], 'port': 0}))
NEEDS_NAMESPACES = {'writes_and_deletes_host_files', 'reads_host_files', 'connects_to_loopback'}
NEEDS_OWN_UID = {'fork_bomb', 'thread_bomb', 'memory_across_forks'}  # RLIMIT_NPROC: a uid of ours


def _problems(run: dict, name: str) -> list[str]:
  """What is wrong with one hostile program's verdict ([] if nothing)."""
  verdict = run['verdicts'][name]
  _, allowed = run['programs'][name]
  problems = []
  if verdict.status not in allowed:
    problems.append(f'status {verdict.status} not in {sorted(allowed)}: {verdict.feedback}')
  if verdict.status == 'pass' and verdict.passed != len(TESTS):
    problems.append('a pass without every test passed')
  if verdict.status != 'pass' and (verdict.passed == verdict.total or not verdict.feedback):
    problems.append('a failure without a failed test and its feedback')
  if verdict.seconds > CONFIG.program_timeout_s + SLACK_S:
    problems.append(f'took {verdict.seconds:.2f} s')
  if len(verdict.output) > CONFIG.output_bytes + 100:  # head + tail + the omission note
    problems.append(f'{len(verdict.output)} characters of output kept')
  if SECRET in verdict.output or any(SECRET in r.got for r in verdict.results):
    problems.append("saw the trainer's secret")
  return problems


def test_there_are_enough_hostile_programs():
  assert len(HOSTILE) >= 25


def test_hostile_programs_are_contained(hostile_run):
  """One test over the whole batch (one batch per test process, whatever pytest-xdist does)."""
  run = hostile_run
  box = run['box']
  skipped = set()
  if box.isolation != 'namespaces':
    skipped |= NEEDS_NAMESPACES  # only namespaces keep host files and the network out of reach
  if not box.program_uids:
    skipped |= NEEDS_OWN_UID  # not root: RLIMIT_NPROC cannot bound a bomb
  problems = {name: _problems(run, name) for name in HOSTILE if name not in skipped}
  assert {name: p for name, p in problems.items() if p} == {}
  assert run['leftovers'] == []  # no process of a program's uid, none with the marker
  assert run['after'].status == 'pass'  # the sandbox still works after them
  assert run['batch_s'] < len(HOSTILE) * (CONFIG.program_timeout_s + SLACK_S) / CONFIG.workers

  flood = run['verdicts']['stdout_flood'].output  # capped: head and tail kept
  assert flood.startswith('x' * 100) and 'bytes omitted' in flood
  assert flood.rstrip('\n').endswith('x' * 100)
  always_equal = run['verdicts']['always_equal_object'].results[0]
  assert always_equal.got == '<object of type main.Any>'
  assert 'not a plain value' in always_equal.error

  if NAMESPACES:
    assert box.isolation == 'namespaces' and box.isolation_reason == ''
  if box.isolation == 'namespaces':
    for directory in run['host_dirs']:
      assert os.listdir(directory) == ['victim.txt']
      with open(os.path.join(directory, 'victim.txt')) as f:
        assert f.read() == 'original'
    assert not os.path.exists(os.path.join('/tmp', MARKER))
    assert run['connections'] == []
    assert 'refused' in run['verdicts']['connects_to_loopback'].output
    writes = run['verdicts']['writes_and_deletes_host_files'].output
    # Every action on every host directory was refused: read-only where the sandbox shows the
    # path, missing where it hides it (a repository under /tmp is behind the private /tmp).
    assert 'DID' not in writes and writes.count('refused') == 3 * len(run['host_dirs']) + 3
