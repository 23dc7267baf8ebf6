"""The function-writing environments ('functions', 'humaneval'): scripted policies against the
real sandbox, single turn and multi-turn repair."""

import numpy as np
import pytest

from earl_jax.envs import base, code_env, code_tasks, registry
from earl_jax.sandbox import Sandbox, SandboxConfig, SandboxError, TestResult

WRONG_BODY = '    return None'


def _env(sandbox, **config) -> code_env.CodeEnv:
  return code_env.CodeEnv(base.CodeEnvConfig(**config), sandbox=sandbox)


def test_single_turn_references_win_and_wrong_bodies_lose(counting_sandbox):
  counting = counting_sandbox
  env = _env(counting)
  obs = env.reset(6, seed=0)
  tasks = env.episode_tasks
  assert obs == [t.prompt for t in tasks]
  assert env.max_turns == 1 and env.num_actions is None
  replies = [t.reference if i % 2 == 0 else WRONG_BODY for i, t in enumerate(tasks)]
  result = env.step(replies)
  assert counting.batches == [6]  # one batch for the whole step
  np.testing.assert_array_equal(result.rewards, [1, 0, 1, 0, 1, 0])
  assert result.dones.all()
  assert [info['outcome'] for info in result.infos] == ['win', 'loss'] * 3
  assert result.infos[0]['passed'] == result.infos[0]['total'] == code_tasks.NUM_HIDDEN_TESTS
  assert result.infos[1]['status'] == 'fail' and result.infos[1]['passed'] == 0
  assert result.observations[0] == 'passed 5/5 hidden tests\n'
  # Stepping finished episodes is allowed: reward 0, done, '' and the same outcome.
  again = env.step(replies)
  assert counting.batches == [6]
  assert again.rewards.tolist() == [0.0] * 6 and again.observations == [''] * 6
  assert all(info['ignored'] and info['turn'] == 1 for info in again.infos)
  assert [info['outcome'] for info in again.infos] == ['win', 'loss'] * 3


def test_a_whole_definition_or_a_fenced_one_also_counts(sandbox):
  task = code_tasks.all_function_tasks()[0]
  signature = task.prompt.split('\n')[0]  # 'def f(x):'
  whole = f'{signature}\n{task.reference}'
  fenced = f'Here it is:\n```python\n{whole}```\nDone.'
  env = code_env.CodeEnv(base.CodeEnvConfig(), tasks=[task], sandbox=sandbox)
  env.reset(3, seed=0)
  result = env.step([whole, fenced, f'```python\n{signature}\n{WRONG_BODY}\n```'])
  assert result.rewards.tolist() == [1.0, 1.0, 0.0]


def test_fraction_and_all_or_nothing_rewards(sandbox):
  """A body right on some inputs only: its fraction, or 0 with reward='all'."""

  def right(task):
    return [eval(t.call[2:-1]) >= int(task.task_id.split('/')[2]) for t in task.hidden_tests]

  maxes = [t for t in code_tasks.all_function_tasks() if t.task_id.startswith('functions/max/')]
  task = next(t for t in maxes if 0 < sum(right(t)) < len(t.hidden_tests))
  partial = '    return x'  # max(x, a) == x exactly when x >= a
  for mode, want in (('fraction', sum(right(task)) / len(task.hidden_tests)), ('all', 0.0)):
    env = code_env.CodeEnv(base.CodeEnvConfig(reward=mode), tasks=[task], sandbox=sandbox)
    env.reset(1, seed=0)
    result = env.step([partial])
    assert result.rewards[0] == pytest.approx(want)
    assert result.infos[0]['outcome'] == 'loss'


def test_bad_replies_end_the_episode_with_a_reward_not_an_exception(sandbox):
  env = _env(sandbox, max_turns=3, invalid_reward=-0.5, max_reply_chars=200)
  env.reset(4, seed=1)
  replies = ['', '```python\n```', '    return ' + 'x' * 300, '    return (']
  result = env.step(replies)
  assert result.rewards.tolist()[:3] == [-0.5, -0.5, -0.5]
  assert [info['outcome'] for info in result.infos[:3]] == ['invalid'] * 3
  assert result.dones.tolist() == [True, True, True, False]
  # A program that does not compile is a failed attempt: feedback, then a reward at the end.
  assert 'SyntaxError' in result.observations[3] or 'error' in result.observations[3]
  for _ in range(2):
    result = env.step(['    return (' for _ in range(4)])
  assert result.dones.all() and result.rewards[3] == 0.0
  assert result.infos[3]['outcome'] == 'loss' and result.infos[3]['turn'] == 2


def test_replies_with_nul_or_lone_surrogates_are_judged_like_any_other(sandbox):
  env = _env(sandbox)
  env.reset(3, seed=0)
  result = env.step(['    return "\ud800"', '    return \x00', '\ud800\x00'])
  assert result.dones.all() and result.rewards.tolist() == [0.0, 0.0, 0.0]
  assert [info['status'] for info in result.infos] == ['fail', 'error', 'error']
  env.reset(1, seed=0)  # the pool is still healthy
  assert env.step([env.episode_tasks[0].reference]).rewards.tolist() == [1.0]


def test_repair_turns_show_the_failing_public_tests_and_grow_the_context(sandbox):
  env = _env(sandbox, max_turns=3)
  obs = env.reset(2, seed=5)
  tasks = env.episode_tasks
  contexts = [obs[0]]
  first = env.step([WRONG_BODY, tasks[1].reference])
  assert first.dones.tolist() == [False, True] and first.rewards.tolist() == [0.0, 1.0]
  feedback = first.observations[0]
  public = tasks[0].public_tests
  for test in public:
    assert f'{test.call} == {test.expected!r} failed: got None\n' in feedback
  assert feedback.endswith(tasks[0].prompt)
  contexts.append(feedback)
  second = env.step(['    return 1/0', 'ignored'])
  assert 'failed: ZeroDivisionError: division by zero' in second.observations[0]
  assert second.infos[1]['ignored']
  contexts.append(second.observations[0])
  third = env.step([tasks[0].reference, ''])
  assert third.dones.all() and third.rewards.tolist() == [1.0, 0.0]
  assert third.infos[0]['turn'] == 2 and third.infos[0]['outcome'] == 'win'
  total = np.cumsum([len(c) for c in contexts])
  assert (np.diff(total) > 0).all()


def test_episode_stats_count_what_the_sandbox_ran_and_judged():
  """Pass rates (first attempt, final), programs, time-outs and crashes per episode, from the
  sandbox's verdicts; the wall time of each sandbox call shared among its programs."""
  with Sandbox(SandboxConfig(workers=2, test_timeout_s=0.3, program_timeout_s=3.0)) as pool:
    env = _env(pool, max_turns=2)
    assert env.episode_stats()['programs'].shape == (0,)  # the names before any reset
    env.reset(5, seed=0)
    task = env.episode_tasks
    crash, hang = '    import os; os._exit(3)', '    while True: pass'
    first = env.step([task[0].reference, WRONG_BODY, crash, hang, 'ok ' * 1000])
    assert [i['status'] for i in first.infos] == ['pass', 'fail', 'crash', 'timeout', None]
    env.step(['', task[1].reference, WRONG_BODY, task[3].reference, ''])
    assert env.outcomes == ['win', 'win', 'loss', 'win', 'invalid']
    stats = env.episode_stats()
    assert list(stats) == [
      'pass_first_rate', 'task_id', 'pass_final_rate', 'programs', 'timeouts', 'crashes',
      'sandbox_s',
    ]  # fmt: skip
    assert [env.tasks[int(i)] for i in stats['task_id']] == task
    np.testing.assert_array_equal(stats['pass_first_rate'], [1, 0, 0, 0, 0])
    np.testing.assert_array_equal(stats['pass_final_rate'], [1, 1, 0, 1, 0])
    np.testing.assert_array_equal(stats['programs'], [1, 2, 2, 2, 0])
    np.testing.assert_array_equal(stats['timeouts'], [0, 0, 0, 1, 0])
    np.testing.assert_array_equal(stats['crashes'], [0, 0, 1, 0, 0])
    # The first call (4 programs, one of them waiting out its time-out) is shared by episodes
    # 0-3, the second (3 programs) by 1-3; the invalid reply ran nothing.
    seconds = stats['sandbox_s']
    assert 4 * seconds[0] >= 0.3 and seconds[0] < seconds[1] and seconds[4] == 0
    np.testing.assert_allclose(seconds[1:4], seconds[1])
    env.reset(2, seed=0)  # a reset starts the counts afresh
    assert env.episode_stats()['programs'].tolist() == [0, 0]


def test_the_last_turn_is_rewarded_by_the_hidden_tests(sandbox):
  env = _env(sandbox, max_turns=2)
  env.reset(1, seed=2)
  assert not env.step([WRONG_BODY]).dones[0]
  last = env.step([WRONG_BODY])
  assert last.dones[0] and last.rewards[0] == 0.0 and last.infos[0]['outcome'] == 'loss'


def test_feedback_lines_show_the_value_or_the_error_and_are_cut():
  test = code_tasks.all_function_tasks()[0].public_tests[0]
  wrong = TestResult(ok=False, got="'" + 'y' * 500 + "'", error='wrong value', status='fail')
  line = code_env.failure_line(test, wrong, 40)
  assert len(line) == 40 and line.startswith(f'{test.call} == {test.expected!r} failed: got ')
  assert line.endswith('...')
  raised = TestResult(ok=False, got='', error='Traceback:\nValueError: bad\n\n', status='error')
  assert code_env.failure_line(test, raised, 200).endswith('failed: ValueError: bad')
  assert code_env.printable('a\tb\r\nc\x00\u00e9<|im_end|>') == 'a\tb\nc??<?|im_end|>'
  cut = code_env.head_tail('a' * 50 + 'b' * 50, 20)
  assert cut.startswith('a' * 10) and cut.endswith('b' * 10) and 'cut' in cut


def test_groups_share_tasks_and_rows_play_the_full_batch_tasks(sandbox):
  env = _env(sandbox)
  env.reset(8, seed=4, group_size=4)
  ids = [t.task_id for t in env.episode_tasks]
  assert ids[:4] == [ids[0]] * 4 and ids[4:] == [ids[4]] * 4 and ids[0] != ids[4]
  part = _env(sandbox)
  part.reset(8, seed=4, group_size=4, rows=[6, 1])
  assert [t.task_id for t in part.episode_tasks] == [ids[6], ids[1]]
  every = _env(sandbox, split='heldout')
  every.reset(128, seed=0)
  assert len({t.task_id for t in every.episode_tasks}) == 128  # n >= T plays every task


def test_task_weights_draw_the_groups_tasks():
  """With a curriculum's weights the groups' tasks are drawn in proportion to them, from the
  seed (a subset of rows plays the full batch's tasks), without replacement while tasks of
  weight > 0 last; a task of weight 0 is never drawn; bad weights are refused by name."""
  weights = np.zeros(10)
  weights[[2, 5, 7]] = (1.0, 2.0, 1.0)
  played, tasks = code_env.assign(10, 12, 3, 4, None, weights)
  assert played.tolist() == list(range(12)) and sorted(set(tasks.tolist())) == [2, 5, 7]
  assert [len(set(tasks[g * 4 : g * 4 + 4].tolist())) for g in range(3)] == [1, 1, 1]
  _, part = code_env.assign(10, 12, 3, 4, [9, 0, 5], weights)
  assert part.tolist() == tasks[[9, 0, 5]].tolist()
  _, again = code_env.assign(10, 12, 3, 4, None, weights)
  assert again.tolist() == tasks.tolist()  # reproducible by seed
  # Many groups on two tasks of weights 1 and 3: about a quarter and three quarters.
  two = np.zeros(10)
  two[[1, 8]] = (1.0, 3.0)
  _, drawn = code_env.assign(10, 4000, 0, 1, None, two)
  assert abs(np.mean(drawn == 8) - 0.75) < 0.03 and set(drawn.tolist()) == {1, 8}
  with pytest.raises(ValueError, match=r'task_weights: expected 10 weights >= 0'):
    code_env.assign(10, 4, 0, 1, None, np.zeros(10))
  with pytest.raises(ValueError, match=r'task_weights: expected 10 weights >= 0'):
    code_env.assign(10, 4, 0, 1, None, np.ones(3))


def test_a_sandbox_failure_propagates():
  class BrokenSandbox:
    def check_many(self, items):
      raise SandboxError('worker pool is gone')

  env = _env(BrokenSandbox())
  env.reset(2, seed=0)
  with pytest.raises(SandboxError, match='worker pool is gone'):
    env.step(['    return 1', '    return 2'])


def test_misuse_is_refused(sandbox):
  env = _env(sandbox)
  with pytest.raises(RuntimeError, match='Call reset'):
    env.step(['x'])
  env.reset(2, seed=0)
  with pytest.raises(ValueError, match='one reply per episode'):
    env.step('    return 1')
  with pytest.raises(ValueError, match='group_size=3'):
    env.reset(4, seed=0, group_size=3)
  with pytest.raises(TypeError, match='free-text replies'):
    env.legal_mask()
  with pytest.raises(TypeError, match='free-text replies'):
    env.action_text(0)


def test_humaneval_canonical_solutions_pass_and_wrong_bodies_fail(sandbox):
  env = registry.make_env(base.CodeEnvConfig(task='humaneval'))
  assert isinstance(env, code_env.CodeEnv) and len(env.tasks) == 164
  env = code_env.CodeEnv(base.CodeEnvConfig(task='humaneval'), tasks=env.tasks[:6], sandbox=sandbox)
  obs = env.reset(12, seed=0, group_size=2)
  assert obs[0] == code_env.printable(env.episode_tasks[0].prompt)
  replies = [t.reference if i % 2 == 0 else WRONG_BODY for i, t in enumerate(env.episode_tasks)]
  result = env.step(replies)
  assert [info['outcome'] for info in result.infos] == ['win', 'loss'] * 6
  assert result.rewards[0::2].tolist() == [1.0] * 6
  assert (result.rewards[1::2] < 0.5).all()
