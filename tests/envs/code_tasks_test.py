"""The generated 'functions' tasks: sizes, splits by seed, tests, and references that pass."""

import re

import pytest

from earl_jax.envs import code_env, code_tasks
from earl_jax.sandbox import Program
from earl_jax.testing.typecheck import unchecked


def test_the_family_has_every_template_and_parameter_once():
  tasks = code_tasks.all_function_tasks()
  assert len(tasks) == sum(len(t.params) for t in code_tasks.TEMPLATES) == 638
  assert len({t.task_id for t in tasks}) == len(tasks)
  assert {t.task_id.split('/')[1] for t in tasks} == {t.name for t in code_tasks.TEMPLATES}


def test_tasks_are_short_and_their_tests_distinct():
  for task in code_tasks.all_function_tasks():
    assert len(task.prompt) + len(task.reference) <= 170, task.task_id
    assert task.prompt.startswith('def f(') and task.reference.startswith('    return ')
    assert len(task.public_tests) == code_tasks.NUM_PUBLIC_TESTS
    assert len(task.hidden_tests) == code_tasks.NUM_HIDDEN_TESTS
    calls = [t.call for t in (*task.public_tests, *task.hidden_tests)]
    assert len(set(calls)) == len(calls), task.task_id
    for test in task.public_tests:  # shown in the prompt, hidden ones are not
      assert f'{test.call} == {test.expected!r}' in task.prompt
    for test in task.hidden_tests:
      assert f'    {test.call} == ' not in task.prompt
    compile(task.prompt, task.task_id, 'exec')  # the prompt alone is valid Python


def test_prompts_spell_with_the_code_tokenizer_alphabet():
  for task in code_tasks.all_function_tasks():
    assert code_env.printable(task.prompt + task.reference) == task.prompt + task.reference


@pytest.mark.parametrize('seed', [0, 1, 7])
@pytest.mark.parametrize('fraction,size', [(0.2, 128), (0.4, 256)])  # ceil(fraction * 638)
def test_splits_are_disjoint_cover_the_family_and_are_deterministic(seed, fraction, size):
  train = code_tasks.function_tasks('train', seed, fraction)
  heldout = code_tasks.function_tasks('heldout', seed, fraction)
  train_ids = {t.task_id for t in train}
  heldout_ids = {t.task_id for t in heldout}
  assert not train_ids & heldout_ids
  assert len(train_ids | heldout_ids) == 638
  assert len(heldout) == size
  again = code_tasks.function_tasks('heldout', seed, fraction)
  assert [t.task_id for t in again] == [t.task_id for t in heldout]
  assert again == heldout  # the same tests too


def test_a_larger_fraction_holds_out_a_superset():
  """The code presets rely on it: the warm start's train tasks (0.7) are among RL's (0.4)."""
  rl = {t.task_id for t in code_tasks.function_tasks('heldout', 0, 0.4)}
  warm = {t.task_id for t in code_tasks.function_tasks('heldout', 0, 0.7)}
  assert rl < warm


def test_another_split_seed_holds_out_other_tasks():
  first = {t.task_id for t in code_tasks.function_tasks('heldout', 0, 0.2)}
  second = {t.task_id for t in code_tasks.function_tasks('heldout', 1, 0.2)}
  assert first != second


def test_expected_values_follow_the_reference_body():
  """The trusted implementation of each template agrees with the reference source."""
  for task in code_tasks.all_function_tasks():
    namespace: dict = {}
    exec(task.prompt + task.reference, namespace)
    for test in (*task.public_tests, *task.hidden_tests):
      assert eval(test.call, namespace) == test.expected, (task.task_id, test)


def test_bad_split_arguments_are_refused():
  with unchecked(), pytest.raises(ValueError, match=re.escape("Unknown split 'test'")):
    code_tasks.function_tasks('test', 0, 0.2)
  with pytest.raises(ValueError, match='heldout_fraction must be in'):
    code_tasks.function_tasks('train', 0, 1.0)


def test_references_pass_their_hidden_tests_in_the_sandbox(sandbox):
  tasks = code_tasks.all_function_tasks()[::5]  # a sample over every template
  verdicts = sandbox.check_many(
    [(Program(source=t.prompt + t.reference), list(t.hidden_tests)) for t in tasks]
  )
  assert [v.status for v in verdicts] == ['pass'] * len(tasks)
  wrong = sandbox.check_many(
    [(Program(source=t.prompt + '    return None\n'), list(t.hidden_tests)) for t in tasks]
  )
  assert all(v.status != 'pass' and v.passed == 0 for v in wrong)
