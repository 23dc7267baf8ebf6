"""A project's tests run in the sandbox, each test's outcome read back, and a bug kept or not by
what it changes (SWE-bench's FAIL_TO_PASS and PASS_TO_PASS).

The project's files go into the sandbox's fresh directory; pytest runs there with an
interpreter that has it (a per-project virtualenv outside /tmp: the sandbox empties /tmp), from
a small runner (`RUNNER`) that records every test's outcome with a pytest plugin and prints
them last, as one JSON line after a marker, so that the sandbox's capped output (head and tail)
keeps them.

  run = testrun.run_tests(box, files, python='.earl_cache/swe/venvs/toolz/bin/python',
                          paths=('toolz/tests',))
  run.outcomes               # {'toolz/tests/test_x.py::test_y': 'passed', ...}
  testrun.judge(baseline.outcomes, run.outcomes)   # Judgement(fail_to_pass, pass_to_pass) or None
"""

import dataclasses
import json
from collections.abc import Mapping, Sequence

from earl_jax.sandbox import Sandbox

MARKER = '@@earl-test-outcomes@@'
RUNNER_FILE = '_earl_run_tests.py'
# Runs pytest on argv[1:] and prints, last, {test id: outcome} (the call phase's outcome, or the
# setup's when it did not pass: an error) and the exception line of each that did not pass. With
# '--earl-cover' first, it also records the lines run in the files under its directory (a
# settrace tracer: slower, for a baseline run only). It runs with PYTHONHASHSEED=0, without
# address randomization and with `random` seeded, so that a test's outcome and output are the same
# on every run unless it reads the clock or the OS's randomness.
RUNNER = """import json, os, sys, threading

if os.environ.get('PYTHONHASHSEED') != '0':  # the same hashes, addresses and draws every run
  import ctypes

  ctypes.CDLL(None).personality(0x0040000)  # ADDR_NO_RANDOMIZE: hash(None) is its address
  os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, 'PYTHONHASHSEED': '0'})

import random

import pytest

random.seed(0)  # tests that draw from `random` draw alike, in the same order, every run

outcomes, messages, lines = {}, {}, {}
root = os.getcwd() + os.sep


class Record:
  def pytest_runtest_logreport(self, report):
    if report.when == 'call' or (report.when == 'setup' and not report.passed):
      outcome = report.outcome if report.when == 'call' else 'error'
      if report.when == 'setup' and report.skipped:
        outcome = 'skipped'
      outcomes[report.nodeid] = outcome
      crash = getattr(report.longrepr, 'reprcrash', None)
      if outcome in ('failed', 'error') and crash is not None:
        messages[report.nodeid] = str(crash.message)[:2000]


def local(frame, event, arg):
  if event == 'line':
    lines[frame.f_code.co_filename].add(frame.f_lineno)
  return local


def tracer(frame, event, arg):
  name = frame.f_code.co_filename
  if not name.startswith(root):
    return None
  lines.setdefault(name, set()).add(frame.f_lineno)
  return local


argv = sys.argv[1:]
cover = argv[:1] == ['--earl-cover']
if cover:
  argv = argv[1:]
  threading.settrace(tracer)
  sys.settrace(tracer)
code = pytest.main(['-q', '-p', 'no:cacheprovider', '--no-header', '-o', 'addopts=', *argv],
                   plugins=[Record()])
sys.settrace(None)
report = {'outcomes': outcomes, 'messages': messages}
if cover:
  report['covered'] = {os.path.relpath(f, root): sorted(v) for f, v in lines.items()}
print()
print(MARKER + json.dumps(report, sort_keys=True), flush=True)
os._exit(int(code))  # not sys.exit: a thread or child a test left running would hold it open
""".replace('MARKER + ', f'{MARKER!r} + ')


class TestRunError(RuntimeError):
  """The tests could not be run, or their outcomes not read (not a failing test: a broken run)."""

  __test__ = False


@dataclasses.dataclass(frozen=True)
class TestRun:
  """One run of a project's tests: each test's outcome ('passed', 'failed', 'error',
  'skipped'), pytest's exit code, and its seconds."""

  __test__ = False

  outcomes: dict[str, str]
  exit_code: int | None
  seconds: float
  messages: dict[str, str] = dataclasses.field(default_factory=dict)  # test id -> its exception
  covered: dict[str, frozenset[int]] | None = None  # file -> lines run (`cover=True` only)

  @property
  def passed(self) -> set[str]:
    return {t for t, o in self.outcomes.items() if o == 'passed'}


def run_tests(
  box: Sandbox,
  files: Mapping[str, str],
  *,
  python: str,
  paths: Sequence[str],
  pythonpath: str = '',
  cover: bool = False,
  timeout_s: float = 300.0,
) -> TestRun:
  """Runs pytest on `paths` (files, directories or test ids) over `files` in the sandbox with
  the interpreter `python`; `pythonpath` (e.g. 'src') is put first on the import path. The
  project's own `addopts` are dropped (they name plugins such as pytest-cov). With `cover`, the
  run also records which lines of which files ran (`TestRun.covered`), several times slower.

  Raises:
    TestRunError: the run timed out, or printed no outcomes (pytest missing, a crash).
  """
  extra = (['--earl-cover'] if cover else []) + (
    ['-o', f'pythonpath={pythonpath}'] if pythonpath else []
  )
  result = box.run_command(
    {**files, RUNNER_FILE: RUNNER}, [python, RUNNER_FILE, *extra, *paths], timeout_s=timeout_s
  )
  if result.timed_out:
    raise TestRunError(f'the tests of {list(paths)} ran past {timeout_s:.0f} s')
  line = next((x for x in reversed(result.output.splitlines()) if x.startswith(MARKER)), None)
  if line is None:
    raise TestRunError(
      f'the tests of {list(paths)} reported no outcomes (exit code {result.exit_code}): '
      f'{result.output[-300:]!r}'
    )
  report = json.loads(line[len(MARKER) :])
  covered = report.get('covered')
  if covered is not None:
    covered = {name: frozenset(lines) for name, lines in covered.items()}
  return TestRun(report['outcomes'], result.exit_code, result.seconds, report['messages'], covered)


@dataclasses.dataclass(frozen=True)
class Judgement:
  """What a bug does to the tests that passed without it: those that fail with it
  (FAIL_TO_PASS once it is fixed) and those that still pass (PASS_TO_PASS)."""

  fail_to_pass: tuple[str, ...]
  pass_to_pass: tuple[str, ...]


def judge(baseline: Mapping[str, str], buggy: Mapping[str, str]) -> Judgement | None:
  """The bug's judgement, or None when it is not kept: no test that passed at baseline fails
  with it, or one disappears (a broken import hides tests), or a test that did not pass at
  baseline now does (the bug is entangled with a flaky or broken test)."""
  passed = {t for t, o in baseline.items() if o == 'passed'}
  if not passed or not passed <= set(buggy):
    return None
  if any(buggy.get(t) == 'passed' for t in baseline if t not in passed):
    return None
  broken = tuple(sorted(t for t in passed if buggy[t] != 'passed'))
  if not broken:
    return None
  return Judgement(broken, tuple(sorted(passed - set(broken))))
