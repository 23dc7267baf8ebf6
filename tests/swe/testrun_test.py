"""A project's tests in the sandbox: every test's outcome read back, and bugs judged by them."""

import sys

import pytest

from earl_jax.sandbox import Sandbox, SandboxConfig
from earl_jax.swe import mutations, testrun

FILES = {
  'calc.py': (
    'def add(a, b):\n    return a + b\n\n\n'
    'def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    return min(x, hi)\n\n\n'
    'def unused(x):\n    return x * 2\n'
  ),
  'tests/test_calc.py': (
    'from calc import add, clamp\n\n\n'
    'def test_add():\n    assert add(2, 3) == 5\n\n\n'
    'def test_clamp_low():\n    assert clamp(-1, 0, 9) == 0\n\n\n'
    'def test_clamp_high():\n    assert clamp(12, 0, 9) == 9\n'
  ),
}
IDS = ('tests/test_calc.py::test_add', 'tests/test_calc.py::test_clamp_high',
       'tests/test_calc.py::test_clamp_low')  # fmt: skip


@pytest.fixture(scope='module')
def box():
  config = SandboxConfig(
    workers=1, program_timeout_s=60, cpu_s=60, open_files=256, max_processes=32
  )
  with Sandbox(config) as sandbox:
    yield sandbox


def _run(box, files):
  # This interpreter has pytest (the project's own virtualenv).
  return testrun.run_tests(box, files, python=sys.executable, paths=('tests',), timeout_s=60)


def _bug(kind: str, line: int) -> dict:
  source = FILES['calc.py']
  (site,) = [s for s in mutations.sites(source) if s.kind == kind and s.line == line]
  return {**FILES, 'calc.py': mutations.apply(source, site)}


def test_outcomes_and_judgements(box):
  baseline = _run(box, FILES)
  assert baseline.outcomes == dict.fromkeys(IDS, 'passed') and baseline.exit_code == 0
  # x < lo flipped to x >= lo: both clamp cases return lo and fail; add still passes.
  flipped = _run(box, _bug('flip_comparison', 6))
  assert flipped.outcomes == {IDS[0]: 'passed', IDS[1]: 'failed', IDS[2]: 'failed'}
  judgement = testrun.judge(baseline.outcomes, flipped.outcomes)
  assert judgement == testrun.Judgement(fail_to_pass=IDS[1:], pass_to_pass=IDS[:1])
  # A bug in a function no test calls changes nothing: not kept.
  untested = _run(box, _bug('off_by_one', 12))
  assert (
    untested.outcomes == baseline.outcomes
    and testrun.judge(baseline.outcomes, untested.outcomes) is None
  )


def test_judge_rules_and_a_broken_run(box):
  base = {'a': 'passed', 'b': 'passed', 'c': 'failed'}
  assert testrun.judge(base, {'a': 'failed', 'b': 'passed', 'c': 'failed'}).fail_to_pass == ('a',)
  assert testrun.judge(base, {'a': 'failed', 'c': 'failed'}) is None  # b vanished
  assert testrun.judge(base, {'a': 'failed', 'b': 'passed', 'c': 'passed'}) is None  # c entangled
  assert testrun.judge(base, base) is None
  with pytest.raises(testrun.TestRunError, match='reported no outcomes'):
    testrun.run_tests(box, FILES, python='/nonexistent/python', paths=('tests',), timeout_s=30)


def test_messages_lines_run_and_a_src_layout(box):
  files = {
    'src/calc.py': FILES['calc.py'],
    'tests/test_calc.py': FILES['tests/test_calc.py'].replace('== 5', '== 6'),
  }
  run = testrun.run_tests(
    box, files, python=sys.executable, paths=('tests',), pythonpath='src', cover=True
  )
  assert run.outcomes[IDS[0]] == 'failed' and run.outcomes[IDS[1]] == 'passed'
  assert run.messages == {IDS[0]: 'assert 5 == 6\n +  where 5 = add(2, 3)'}
  # add's and clamp's bodies ran; unused's (line 12) did not.
  assert {2, 6, 7, 8} <= run.covered['src/calc.py'] and 12 not in run.covered['src/calc.py']
  unfound = testrun.run_tests(box, files, python=sys.executable, paths=('tests',))
  assert unfound.outcomes == {} and unfound.exit_code == 2  # without src: a collection error


def test_a_thread_a_test_leaves_running_does_not_hold_the_run(box):
  files = {
    **FILES,
    'tests/test_thread.py': (
      'import threading, time\n\n\n'
      'def test_leaves_a_thread():\n'
      '    threading.Thread(target=time.sleep, args=(600,)).start()\n'
    ),
  }
  run = testrun.run_tests(box, files, python=sys.executable, paths=('tests',), timeout_s=30)
  assert run.outcomes['tests/test_thread.py::test_leaves_a_thread'] == 'passed'
  assert run.seconds < 10


def test_runs_hash_alike_so_messages_repeat(box):
  files = {
    'tests/test_sets.py': (
      'import os\n\n\n'
      'def test_seed():\n    assert os.environ["PYTHONHASHSEED"] == "0"\n\n\n'
      'def test_set():\n    assert {"alpha", "beta", "gamma", "delta", "epsilon"} == set()\n\n\n'
      'def test_none_and_draws():\n    import random\n'
      '    assert ({(None, 1), (None, 2), (3, None)}, random.random()) == ()\n'
    ),
  }
  runs = [testrun.run_tests(box, files, python=sys.executable, paths=('tests',)) for _ in range(3)]
  assert all(r.outcomes['tests/test_sets.py::test_seed'] == 'passed' for r in runs)
  for test in ('test_set', 'test_none_and_draws'):
    messages = {r.messages[f'tests/test_sets.py::{test}'] for r in runs}
    assert len(messages) == 1, messages  # sets (of None too) and draws, the same in every run
