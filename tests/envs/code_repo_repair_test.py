"""Repository repair with scripted policies: the right patch passes; doing nothing, or deleting or
editing the tests, does not."""

import numpy as np
import pytest

from earl_jax.envs import base, code_env, registry, repo_repair


def _env(sandbox, tasks=None, **config) -> repo_repair.RepoRepairEnv:
  config = base.CodeEnvConfig(task='repo_repair', **config)
  return repo_repair.RepoRepairEnv(config, tasks=tasks, sandbox=sandbox)


def _patch(task: repo_repair.RepoTask) -> str:
  return task.reference_commands()[2]


def test_generated_repositories_are_deterministic_and_buggy():
  for index in range(0, 1000, 50):
    task = repo_repair.make_repo_task(index)
    assert task == repo_repair.make_repo_task.__wrapped__(index)
    assert set(task.files) == {'nums.py', 'words.py', 'test_repo.py'}
    buggy = task.files[task.bug_file].split('\n')[task.bug_line - 1]
    assert buggy.startswith('    return ') and buggy != task.fixed_line
    assert len(task.hidden_tests) == 12
    for test in task.hidden_tests:  # hidden inputs are not the visible tests' inputs
      assert f'assert {test.call} ==' not in task.files['test_repo.py']


def test_splits_are_disjoint_and_deterministic():
  train = repo_repair.repo_task_indices('train', 0, 0.2)
  heldout = repo_repair.repo_task_indices('heldout', 0, 0.2)
  assert len(heldout) == 200 and len(train) == 800 and not set(train) & set(heldout)
  assert repo_repair.repo_task_indices('heldout', 0, 0.2) == heldout
  assert repo_repair.repo_task_indices('heldout', 1, 0.2) != heldout


def test_the_right_patch_passes_and_doing_nothing_fails(counting_sandbox):
  env = _env(counting_sandbox, max_turns=4)
  obs = env.reset(4, seed=0)
  assert obs[0] == repo_repair.INTRO and env.max_turns == 4 and env.num_actions is None
  tasks = env.episode_tasks
  ran = env.step(['run', 'run', f'view {tasks[2].bug_file}', 'submit'])
  assert counting_sandbox.batches == [3]  # two test runs and a submission: one batch
  assert 'FAIL test_' in ran.observations[0] and ran.observations[0].endswith('exit code 1\n')
  assert f'{tasks[2].bug_line}|' in ran.observations[2]
  assert ran.dones.tolist() == [False, False, False, True]
  assert ran.rewards[3] == 0.0 and ran.infos[3]['outcome'] == 'loss'  # doing nothing fails
  patched = env.step([_patch(tasks[0]), 'submit', _patch(tasks[2]), 'submit'])
  assert patched.observations[0].startswith(f'{tasks[0].bug_file}: replaced lines')
  assert patched.dones.tolist() == [False, True, False, True]
  assert patched.infos[1]['outcome'] == 'loss'
  assert env.files[0] == tasks[0].fixed_files()
  rerun = env.step(['run', '', 'submit', ''])
  assert rerun.observations[0] == 'all tests passed\nexit code 0\n'
  assert rerun.rewards[2] == 1.0 and rerun.infos[2]['outcome'] == 'win'
  assert rerun.infos[2]['passed'] == rerun.infos[2]['total'] == 12
  done = env.step(['submit', '', '', ''])
  assert done.rewards[0] == 1.0 and done.dones.all()


def test_deleting_or_editing_the_tests_does_not_pass(sandbox):
  task = repo_repair.make_repo_task(3)
  count = task.files['test_repo.py'].count('\n')
  env = _env(sandbox, tasks=[task], max_turns=3)
  env.reset(3, seed=0)
  delete = f'replace test_repo.py 1 {count}\n'
  neuter = f'replace test_repo.py 1 {count}\nprint("all tests passed")\n'
  result = env.step([delete, neuter, 'run'])
  assert result.observations[1].startswith('test_repo.py: replaced lines')
  assert 'FAIL test_' in result.observations[2]
  result = env.step(['run', 'run', 'run'])
  assert result.observations[1] == 'all tests passed\nexit code 0\n'  # the visible tests lie
  assert 'FAIL' not in result.observations[0]
  result = env.step(['submit', 'submit', 'submit'])
  assert result.dones.all()
  assert result.rewards.tolist() == [0.0] * 3
  assert [info['outcome'] for info in result.infos] == ['loss'] * 3
  assert all(info['passed'] < info['total'] == 12 for info in result.infos)


def test_the_last_turn_submits_and_bad_commands(sandbox):
  task = repo_repair.make_repo_task(5)
  env = _env(sandbox, tasks=[task], max_turns=2, invalid_reward=-1.0)
  env.reset(5, seed=0)
  result = env.step(
    ['view nope.py', 'replace nums.py 50 60\nx', 'hello', 'view nums.py 2', 'run x']
  )
  assert result.observations[0].startswith("error: no file 'nope.py'")
  assert result.observations[1].startswith('error: lines 50-60 cannot be replaced')
  assert result.dones.tolist() == [False, False, True, True, True]
  assert result.rewards.tolist() == [0.0, 0.0, -1.0, -1.0, -1.0]
  assert result.infos[2]['outcome'] == 'invalid'
  last = env.step([_patch(task), 'view nums.py', '', '', ''])  # the last turn submits
  assert last.dones.all() and last.rewards[:2].tolist() == [1.0, 0.0]
  assert last.infos[0]['outcome'] == 'win' and last.infos[1]['outcome'] == 'loss'


def test_the_reference_commands_win_and_fraction_rewards_count_hidden_tests(sandbox):
  tasks = [repo_repair.make_repo_task(k) for k in (10, 11)]
  env = _env(sandbox, tasks=tasks, max_turns=4, reward='fraction')
  env.reset(4, seed=0)
  ids = [t.task_id for t in env.episode_tasks]
  by_id = {t.task_id: t for t in tasks}
  scripts = [by_id[i].reference_commands() if k < 2 else ['submit'] * 4 for k, i in enumerate(ids)]
  rewards = np.zeros(4)
  for turn in range(4):
    result = env.step([script[turn] for script in scripts])
    rewards += result.rewards
  assert env.done.all()
  assert rewards[:2].tolist() == [1.0, 1.0]
  assert all(0.0 < r < 1.0 for r in rewards[2:])  # untouched: the other functions still pass


def test_view_ranges_and_fenced_replacements(sandbox):
  task = repo_repair.make_repo_task(8)
  env = _env(sandbox, tasks=[task], max_turns=3)
  env.reset(1, seed=0)
  shown = env.step([f'view {task.bug_file} {task.bug_line} {task.bug_line}']).observations[0]
  buggy = task.files[task.bug_file].split('\n')[task.bug_line - 1]
  assert shown == f'{task.bug_file}:\n{task.bug_line}|{buggy}\n'
  fenced = (
    f'replace {task.bug_file} {task.bug_line} {task.bug_line}\n```python\n{task.fixed_line}\n```'
  )
  env.step([fenced])
  assert env.files[0] == task.fixed_files()
  assert env.step(['submit']).rewards.tolist() == [1.0]
  env.reset(1, seed=0)
  env.step([f'```\n{task.reference_commands()[2]}```'])  # the whole command in one fence
  assert env.files[0] == task.fixed_files()


def test_a_test_flood_is_cut_to_head_and_tail(sandbox):
  task = repo_repair.make_repo_task(2)
  env = _env(sandbox, tasks=[task], output_chars=200)
  env.reset(1, seed=0)
  env.step(['replace test_repo.py 1 0\nprint("x" * 100000)'])
  out = env.step(['run']).observations[0]
  assert len(out) < 400 and 'cut' in out and out.startswith('x' * 50)


def test_registry_builds_it_and_groups_share_repositories(sandbox):
  env = registry.make_env(base.CodeEnvConfig(task='repo_repair', split='heldout'))
  assert isinstance(env, repo_repair.RepoRepairEnv) and env.max_turns == 8
  env.reset(6, seed=1, group_size=3)
  ids = [t.task_id for t in env.episode_tasks]
  assert ids == [ids[0]] * 3 + [ids[3]] * 3
  heldout = set(repo_repair.repo_task_indices('heldout', 0, 0.2))
  assert {int(i.split('/')[1]) for i in ids} <= heldout


def test_observations_are_printable(sandbox):
  task = repo_repair.make_repo_task(1)
  env = _env(sandbox, tasks=[task])
  env.reset(1, seed=0)
  env.step(['replace nums.py 1 1\n"""caf\u00e9"""'])
  shown = env.step(['view nums.py 1 1']).observations[0]
  assert shown == code_env.printable(shown) and 'caf?' in shown
  np.testing.assert_array_equal(env.done, [False])


def test_config_validation():
  with pytest.raises(ValueError, match='max_turns must be None or an int >= 2'):
    base.CodeEnvConfig(task='repo_repair', max_turns=1)
