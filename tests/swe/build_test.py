"""The SWE task builder end to end on a committed miniature project (its tests run in the
sandbox), and its rules: flaky tests, candidate order, the problem statement, resuming."""

import json
import os
import shutil
import sys

import pytest

from earl_jax.sandbox import Sandbox
from earl_jax.swe import build, mutations, patches, testrun
from earl_jax.testing.helpers import fixture_path
from earl_jax.testing.swe import MINICALC

FIXTURE = fixture_path('swe', 'minicalc-0.1')
CONFIG = build.BuildConfig(per_project=5, seed=0, workers=2)


def _build(out, config=CONFIG):
  return build.build(
    [(MINICALC, FIXTURE)], str(out), config, pythons={'minicalc': sys.executable}, log=print
  )


def _instances(out) -> list[dict]:
  with open(os.path.join(out, 'instances.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope='module')
def built(tmp_path_factory):
  out = tmp_path_factory.mktemp('swe') / 'tasks'
  manifest = _build(out)
  return out, manifest


def test_instances_of_the_miniature_project(built):
  out, manifest = built
  instances = _instances(out)
  assert len(instances) == manifest['instances'] == 5
  (row,) = manifest['projects']
  assert row['tests'] == row['tests_passing'] == 11 and row['flaky'] == []
  # unused() is never run by a test: no candidate there.
  assert row['candidates'] < sum(
    len(mutations.sites(build.read_tree(FIXTURE)[m]))
    for m in build.library_modules(MINICALC, build.read_tree(FIXTURE))
  )
  clean = build.read_tree(os.path.join(out, 'repos', 'minicalc-0.1'))
  assert clean == build.read_tree(FIXTURE)
  for item in instances:
    assert item['instance_id'].startswith('minicalc-0.1.' + item['kind'] + '.')
    assert item['FAIL_TO_PASS'] and not set(item['FAIL_TO_PASS']) & set(item['PASS_TO_PASS'])
    assert len(item['FAIL_TO_PASS']) + len(item['PASS_TO_PASS']) == 11
    buggy = patches.apply_all(clean, item['bug_patch'])
    assert buggy != clean and patches.apply_all(buggy, item['patch']) == clean
    statement = item['problem_statement']
    assert item['FAIL_TO_PASS'][0] in statement
    assert 'minicalc/stats.py' not in statement and 'minicalc/text.py' not in statement
  assert len({i['instance_id'] for i in instances}) == 5
  assert sum(manifest['by_kind'].values()) == 5 and len(manifest['by_kind']) >= 4  # kinds in turn


def test_an_instance_fails_as_recorded_and_its_gold_patch_fixes_it(built):
  out, _ = built
  item = _instances(out)[0]
  clean = build.read_tree(os.path.join(out, 'repos', 'minicalc-0.1'))
  buggy = patches.apply_all(clean, item['bug_patch'])
  with Sandbox(build.sandbox_config(1)) as box:
    run = testrun.run_tests(box, buggy, python=sys.executable, paths=item['test_args'])
    fixed = testrun.run_tests(
      box, patches.apply_all(buggy, item['patch']), python=sys.executable, paths=item['test_args']
    )
  assert sorted(t for t, o in run.outcomes.items() if o != 'passed') == item['FAIL_TO_PASS']
  assert fixed.passed == set(item['FAIL_TO_PASS']) | set(item['PASS_TO_PASS'])


def test_a_cut_build_resumes_to_the_same_instances_and_workers_do_not_matter(built, tmp_path):
  out, _ = built
  copy = tmp_path / 'tasks'
  shutil.copytree(out, copy)
  decisions = copy / '.build' / 'minicalc.decisions.jsonl'
  lines = decisions.read_text().splitlines(keepends=True)
  decisions.write_text(''.join(lines[:2]) + lines[2][:10])  # cut mid-line
  os.remove(copy / 'instances.jsonl')
  os.remove(copy / 'manifest.json')
  manifest = _build(copy)
  assert manifest['projects'][0]['resumed'] == 2
  assert (copy / 'instances.jsonl').read_bytes() == (out / 'instances.jsonl').read_bytes()
  one_worker = tmp_path / 'one'
  _build(one_worker, build.BuildConfig(per_project=5, seed=0, workers=1))
  assert (one_worker / 'instances.jsonl').read_bytes() == (out / 'instances.jsonl').read_bytes()
  with pytest.raises(build.BuildError, match=r"holds a build with \{'runs': 2, 'seed': 0\}"):
    _build(copy, build.BuildConfig(per_project=5, seed=1, workers=2))


@pytest.mark.parametrize(
  'failures, error, why',
  [
    (1, 'ran past 5 s', 'kept'),  # one overrun is the machine's load; past 4x, the bug's
    (2, 'ran past 5 s', 'slow or hung'),
    (1, 'reported no outcomes', 'kept'),
    (2, 'reported no outcomes', 'broken run'),
  ],
)
def test_a_bug_whose_run_fails_runs_again_past_a_time_limit_with_a_longer_one(
  monkeypatch, tmp_path, failures, error, why
):
  limits = []

  def run_tests(box, files, *, timeout_s, **kwargs):  # a loaded machine: the first runs fail
    limits.append(timeout_s)
    if len(limits) <= failures:
      raise testrun.TestRunError(f'the tests of [tests] {error}')
    return testrun.TestRun({'a': 'failed', 'b': 'passed'}, 1, 9.0)

  monkeypatch.setattr(testrun, 'run_tests', run_tests)
  files = build.read_tree(FIXTURE)
  baseline = build._Baseline({'a': 'passed', 'b': 'passed'}, (), 1.0, {})
  with Sandbox(build.sandbox_config(1)) as box:  # not run: the runs are scripted
    project = build._ProjectBuild(box, MINICALC, files, sys.executable, CONFIG, str(tmp_path))
    modules = {m: files[m] for m in project.modules}
    everything = {m: frozenset(range(1, 200)) for m in modules}
    decision = project._decide(baseline, build.candidates(modules, everything, 0, 'x')[0], 'bug')
  assert decision['why'] == why
  limit = 1.0 * CONFIG.timeout_factor + build.SLACK_S
  second = limit * (build.CONFIRM_FACTOR if error.startswith('ran past') else 1)
  assert limits == [limit, second] + [limit] * (failures == 1)
  if why == 'kept':
    assert decision['instance']['FAIL_TO_PASS'] == ['a'] and decision['seconds'] == [9.0, 9.0]


def test_flaky_tests_are_left_out_and_a_bug_must_judge_alike_in_every_run():
  outcomes, flaky = build.stable([
    {'a': 'passed', 'b': 'passed', 'c': 'passed'},
    {'a': 'passed', 'b': 'failed', 'c': 'passed'},
  ])  # fmt: skip
  assert outcomes == {'a': 'passed', 'c': 'passed'} and flaky == ('b',)
  alike = {'a': 'failed', 'b': 'passed', 'c': 'passed'}
  judgement = build.settle(outcomes, [alike, {**alike, 'b': 'failed'}], flaky)
  assert judgement == testrun.Judgement(('a',), ('c',))  # b's outcome does not count
  assert build.settle(outcomes, [alike, {'a': 'passed', 'b': 'passed', 'c': 'passed'}]) is None
  assert build.settle(outcomes, [alike, {'a': 'failed', 'b': 'passed', 'c': 'failed'}]) is None


def test_candidates_take_the_kinds_in_turn_on_run_lines_and_depend_on_the_seed():
  files = build.read_tree(FIXTURE)
  modules = {m: files[m] for m in build.library_modules(MINICALC, files)}
  assert sorted(modules) == ['minicalc/__init__.py', 'minicalc/stats.py', 'minicalc/text.py']
  everything = {m: frozenset(range(1, 200)) for m in modules}
  order = build.candidates(modules, everything, 0, 'minicalc')
  assert [c.site.kind for c in order[:8]] == list(mutations.KINDS)
  assert order == build.candidates(modules, everything, 0, 'minicalc')
  assert order != build.candidates(modules, everything, 1, 'minicalc')
  only_clamp = {'minicalc/stats.py': frozenset(range(10, 16))}
  assert {c.site.line for c in build.candidates(modules, only_clamp, 0, 'm')} <= set(range(10, 16))


def test_the_problem_statement_shows_failures_but_not_where_the_bug_is():
  messages = {
    'tests/test_x.py::test_a': 'AssertionError: assert 3 == 4\n  where 3 = <f at 0x7f3d4f07b7e0>()',
    'tests/test_x.py::test_b': 'File "pkg/core.py", line 9\nValueError: bad',
  }
  text = build.problem_statement(MINICALC, sorted(messages), messages, 40, hidden=['pkg/core.py'])
  assert text.startswith('2 tests of minicalc 0.1 fail (40 in its suite):')
  assert 'AssertionError: assert 3 == 4' in text and 'ValueError: bad' in text
  assert 'where 3 = <f at 0x...>()' in text  # the same text on every run
  assert 'pkg/core.py' not in text
  many = [f't{i}' for i in range(8)]
  assert '... and 3 more.' in build.problem_statement(MINICALC, many, {}, 8)


def test_config_errors_name_the_value():
  with pytest.raises(ValueError, match=r'BuildConfig.per_project=0: expected an int >= 1'):
    build.BuildConfig(per_project=0)
  with pytest.raises(ValueError, match=r'BuildConfig.timeout_factor=0.5'):
    build.BuildConfig(timeout_factor=0.5)
