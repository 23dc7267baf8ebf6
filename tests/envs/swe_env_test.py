"""The `swe` environment on the miniature project's instances: scripted agents (gold patch,
no-op, an edit of the tests, a line fix found by searching), refused replies, path escapes,
the Qwen tool-call format, and the SWE-bench-style loader."""

import json
import os
import sys

import numpy as np
import pytest

from earl_jax.envs import base, registry, swe_env
from earl_jax.errors import ConfigError
from earl_jax.sandbox import SandboxConfig
from earl_jax.swe import instances, patches, tools
from earl_jax.testing import swe


@pytest.fixture(scope='module')
def jsonl(tmp_path_factory):
  return swe.mini_instances(str(tmp_path_factory.mktemp('swe')))


def _config(jsonl, **changes):
  settings = {
    'task': 'swe', 'swe_tasks': jsonl, 'swe_python': sys.executable, 'heldout_fraction': 0.25,
    'sandbox': SandboxConfig(workers=2), 'max_reply_chars': 1 << 16,
  }  # fmt: skip
  return base.CodeEnvConfig(**{**settings, **changes})


def _play(env, scripts):
  """Plays one scripted reply list per episode; returns (total rewards, last observations)."""
  total = np.zeros(env.num_envs, np.float32)
  last = [''] * env.num_envs
  turn = 0
  while not env.done.all():
    replies = [s[turn] if turn < len(s) else 'submit' for s in scripts]
    result = env.step(replies)
    total += result.rewards
    last = [o or x for o, x in zip(result.observations, last)]
    turn += 1
  return total, last


def test_splits_and_the_registry(jsonl):
  train = registry.make_env(_config(jsonl))
  held = registry.make_env(_config(jsonl, split='heldout'))
  assert isinstance(train, swe_env.SWEEnv)
  ids = {t.instance_id for t in train.tasks}
  assert len(ids) == 6 and len(held.tasks) == 2 and not ids & {t.instance_id for t in held.tasks}


def test_gold_solves_no_op_fails_and_an_edit_of_the_tests_does_not_count(jsonl):
  env = registry.make_env(_config(jsonl, max_turns=4))
  observations = env.reset(3, seed=0)
  gold, _, cheat = env.episode_tasks
  assert gold.fail_to_pass[0] in observations[0] and 'ls [DIR]' in observations[0]
  # The cheat empties every failing test's body in its test file: its own runs pass, but the
  # judgement runs the original tests.
  files = env.workspaces[2].files
  cheats = {}
  for test in cheat.fail_to_pass:
    path, name = test.split('::')
    text = cheats.get(path, files[path])
    head, _, rest = text.partition(f'def {name}(')
    body_end = rest.find('\ndef ')
    rest = '):\n    pass\n' + (rest[body_end:] if body_end >= 0 else '\n')
    cheats[path] = f'{head}def {name}{rest}'
  cheat_diff = ''.join(patches.make(p, files[p], t) for p, t in cheats.items())
  total, last = _play(
    env,
    [
      [f'diff\n{gold.patch}', 'test', 'submit'],
      ['submit'],
      [f'diff\n{cheat_diff}', 'test ' + ' '.join(cheat.fail_to_pass), 'submit'],
    ],
  )
  assert total.tolist() == [1.0, 0.0, 0.0]
  assert env.outcomes == ['win', 'loss', 'loss']
  n = len(cheat.fail_to_pass)
  assert (
    last[2]
    == f'FAIL_TO_PASS 0/{n}, PASS_TO_PASS {len(cheat.pass_to_pass)}/{len(cheat.pass_to_pass)}\n'
  )
  stats = env.episode_stats()
  assert stats['test_runs'].tolist() == [1, 0, 1] and stats['programs'].tolist() == [2, 1, 2]
  assert (stats['test_s'] > 0).all() and stats['tool_errors'].tolist() == [0, 0, 0]


def test_a_fix_found_with_view_search_and_replace(jsonl):
  env = registry.make_env(_config(jsonl, max_turns=6))
  env.reset(1, seed=3)
  (task,) = env.episode_tasks
  (path,) = patches.files(task.patch)
  fixed = patches.apply_all(env.workspaces[0].files, task.patch)[path].splitlines()
  buggy = env.workspaces[0].files[path].splitlines()
  first = next(k for k, (a, b) in enumerate(zip(buggy, fixed)) if a != b) + 1
  last_buggy = len(buggy) - next(
    k for k, (a, b) in enumerate(zip(buggy[::-1], fixed[::-1])) if a != b
  )
  last_fixed = len(fixed) - (len(buggy) - last_buggy)
  new = '\n'.join(fixed[first - 1 : last_fixed])
  word = buggy[first - 1].split()[0] if buggy[first - 1].split() else 'def'
  observations = []
  for reply in (f'search {word} minicalc/', f'view {path} {first} {max(first, last_buggy)}',
                f'replace {path} {first} {last_buggy}\n{new}', 'test'):  # fmt: skip
    observations.append(env.step([reply]).observations[0])
  assert f'{path}:{first}|' in observations[0] and observations[1].startswith(f'{path}:\n{first}|')
  assert observations[2].startswith(f'{path}: replaced lines {first}-{last_buggy}')
  assert observations[3].startswith(f'{len(task.fail_to_pass) + len(task.pass_to_pass)} passed')
  assert env.step(['submit']).rewards.tolist() == [1.0]


@pytest.mark.parametrize(
  'reply, error',
  [
    ('view ../../etc/passwd', "error: '../../etc/passwd' is outside the repository"),
    ('view /etc/passwd', "error: '/etc/passwd' is outside the repository"),
    ('ls ../', "error: '../' is outside the repository"),
    ('diff\n--- a/../evil.py\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+x = 1\n',
     "error: '../evil.py' is outside the repository"),
    ('diff\n--- a/minicalc/new.py\n+++ b/minicalc/new.py\n@@ -0,0 +1 @@\n+x = 1\n',
     "error: no file 'minicalc/new.py' in the repository (ls lists them)"),
    ('diff\n--- a/minicalc/stats.py\n+++ b/minicalc/stats.py\n@@ -1,1 +1,1 @@\n-nope\n+x\n',
     'error: the diff does not apply: line 1 does not match the diff'),
    ('replace minicalc/stats.py 90 95\nx', 'error: lines 90-95 cannot be replaced in minicalc/stats.py'),
    ('rm -rf /', "error: unknown command 'rm'"),
    ('', 'error: empty reply'),
  ],
)  # fmt: skip
def test_refused_replies_answer_one_line_count_and_the_episode_goes_on(jsonl, reply, error):
  env = registry.make_env(_config(jsonl, max_turns=3))
  env.reset(1, seed=0)
  before = env.workspaces[0].files
  result = env.step([reply])
  assert result.observations[0].startswith(error) and result.observations[0].count('\n') == 1
  assert not result.dones[0] and env.workspaces[0].files == before
  assert env.episode_stats()['tool_errors'].tolist() == [1]


def test_the_last_turn_submits_and_a_long_reply_is_refused(jsonl):
  env = registry.make_env(_config(jsonl, max_turns=2, max_reply_chars=100))
  env.reset(2, seed=0)
  gold = env.episode_tasks[0]
  result = env.step(['ls', 'x' * 101])
  assert result.observations[1] == 'error: the reply is longer than 100 characters\n'
  result = env.step(['test', 'ls'])  # the last turn: judged after its call
  assert result.dones.all() and env.outcomes == ['loss', 'loss']
  assert len(gold.patch) > 0


def test_the_qwen_tool_format(jsonl):
  env = registry.make_env(_config(jsonl, tool_format='qwen', max_turns=4))
  observations = env.reset(2, seed=0)
  assert 'use the tools' in observations[0] and 'ls [DIR]' not in observations[0]
  task = env.episode_tasks[0]
  call = json.dumps({'name': 'apply_diff', 'arguments': {'diff': task.patch}})
  result = env.step([f'Let me fix it.\n<tool_call>\n{call}\n</tool_call>', '<tool_call>{oops'])
  assert result.observations[0].startswith('<tool_response>\napplied to ')
  assert result.observations[1].startswith('<tool_response>\nerror: the tool call is not JSON')
  result = env.step([
    '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "view_file", "arguments": {"path": 3}}\n</tool_call>',
  ])  # fmt: skip
  assert result.rewards.tolist() == [1.0, 0.0] and result.observations[1].endswith(
    'error: view_file: path must be a string, got 3\n</tool_response>'
  )
  assert env.episode_stats()['tool_errors'].tolist() == [0, 2]


def test_tools_parse_both_formats_to_the_same_calls():
  assert tools.parse_plain('```\nview a.py 3 4\n```') == tools.Call(
    'view', {'path': 'a.py', 'start': 3, 'end': 4}
  )
  assert tools.parse_plain('search return x + 1 pkg/') == tools.Call(
    'search', {'text': 'return x + 1', 'path': 'pkg/'}
  )
  assert tools.parse_plain('test t.py::a t.py::b') == tools.Call(
    'test', {'tests': ['t.py::a', 't.py::b']}
  )
  qwen = '<tool_call>{"name": "run_tests", "arguments": {"tests": ["t.py::a"]}}</tool_call>'
  assert tools.parse_qwen(qwen) == tools.Call('test', {'tests': ['t.py::a']})
  with pytest.raises(tools.ToolError, match="unknown tool 'rm'"):
    tools.parse_qwen('<tool_call>{"name": "rm", "arguments": {}}</tool_call>')
  with pytest.raises(tools.ToolError, match=r"missing \['path'\]"):
    tools.parse_qwen('<tool_call>{"name": "view_file", "arguments": {}}</tool_call>')


def test_a_swebench_style_jsonl_is_loaded_checked_and_the_invalid_listed(jsonl, tmp_path):
  """The miniature instances rewritten as SWE-bench rows (the buggy repository on disk, lists
  as JSON strings, a gold `patch`) and as SWE-smith rows (the clean repository, `patch` makes
  the bug); one row of each with a broken gold patch is listed as invalid."""
  ours = instances.load(jsonl)[:2]
  repos = tmp_path / 'repos'
  bench = []
  for k, task in enumerate(ours):
    root = repos / task.instance_id
    for path, text in task.buggy_files().items():
      os.makedirs(root / os.path.dirname(path), exist_ok=True)
      (root / path).write_text(text)
    common = {'instance_id': task.instance_id, 'repo': 'org/minicalc',
              'problem_statement': task.problem_statement,
              'FAIL_TO_PASS': json.dumps(list(task.fail_to_pass)),
              'PASS_TO_PASS': json.dumps(list(task.pass_to_pass))}  # fmt: skip
    bench.append({**common, 'patch': task.patch if k == 0 else task.bug_patch, 'test_patch': ''})
  (tmp_path / 'bench.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in bench))
  loaded = instances.load(str(tmp_path / 'bench.jsonl'), format='swebench', repos_dir=str(repos))
  assert [t.test_args for t in loaded] == [t.fail_to_pass + t.pass_to_pass for t in ours]
  valid, invalid, _ = swe_env.check(_config(jsonl, max_turns=2), loaded)
  assert [t.instance_id for t in valid] == [ours[0].instance_id]
  assert invalid == [(ours[1].instance_id, invalid[0][1])] and 'does not apply' in invalid[0][1]
  smith_root = tmp_path / 'clean'
  for path, text in instances._tree(ours[0].root).items():
    os.makedirs(smith_root / 'org__minicalc' / os.path.dirname(path), exist_ok=True)
    (smith_root / 'org__minicalc' / path).write_text(text)
  row = {**bench[0], 'instance_id': 'smith-1', 'patch': ours[0].bug_patch}
  (tmp_path / 'smith.jsonl').write_text(json.dumps(row) + '\n')
  (task,) = instances.load(
    str(tmp_path / 'smith.jsonl'), format='swesmith', repos_dir=str(smith_root)
  )
  assert task.buggy_files() == ours[0].buggy_files()
  assert patches.apply_all(task.buggy_files(), task.patch) == instances._tree(ours[0].root)
  with pytest.raises(instances.InstanceError, match=r'bench.jsonl:1: no repository for it'):
    instances.load(str(tmp_path / 'bench.jsonl'), format='swebench', repos_dir=str(tmp_path))


def test_missing_or_bad_instances_are_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match=r"swe_tasks='/nonexistent/x.jsonl': no such file; build"):
    registry.make_env(base.CodeEnvConfig(task='swe', swe_tasks='/nonexistent/x.jsonl'))
  (tmp_path / 'bad.jsonl').write_text('{"instance_id": 3}\n')
  with pytest.raises(ConfigError, match=r"bad.jsonl:1: missing or non-string field 'instance_id'"):
    registry.make_env(base.CodeEnvConfig(task='swe', swe_tasks=str(tmp_path / 'bad.jsonl')))
