"""experiments/profile.py: the offline table of a preset, and a run that starts from it."""

import json

from earl_jax.testing import helpers

# The smoke preset with a measured rollout stage (its two layouts, buckets 64 and 128).
ROLLOUT = ('--config=smoke', '--config.selector.profile.stages=rollout')


def test_a_run_started_from_the_table_measures_nothing(tmp_path):
  table = tmp_path / 'table.json'
  r = helpers.run_module(
    'experiments.profile', *ROLLOUT, f'--out={table}', '--repeats=1', '--rounds=2'
  )
  assert r.returncode == 0, r.stderr[-2000:]
  data = json.loads(table.read_text())
  cells = {(c['bucket'], c['config']) for c in data['cells']}
  assert cells == {(b, c) for b in (64, 128) for c in ('dp8.tp1', 'dp4.tp2')}
  assert all(len(c['times_ms']) == 2 for c in data['cells'])  # rounds x repeats
  assert f'--config.selector.profile.cache={table}' in r.stdout
  run = tmp_path / 'run'
  r = helpers.run_module(
    'experiments.train',
    *ROLLOUT,
    '--config.selector.profile.lazy=true',
    f'--config.selector.profile.cache={table}',
    '--config.steps=2',
    '--config.eval_every=0',
    f'--workdir={run}',
  )
  assert r.returncode == 0, r.stderr[-2000:]
  summary = json.loads((run / 'summary.json').read_text())
  assert summary['profile_s'] == 0
  rollout = [d for d in summary['decisions'] if d['stage'] == 'rollout']
  assert rollout and all('measured: dp8.tp1, dp4.tp2' in d['reason'] for d in rollout)


def test_a_preset_that_profiles_nothing_is_one_line_and_exit_code_2(tmp_path):
  r = helpers.run_module('experiments.profile', '--config=smoke', f'--out={tmp_path}/t.json')
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [x for x in r.stderr.splitlines() if x.startswith('error:')]
  assert len(lines) == 1 and 'profiles no stage' in lines[0], r.stderr[-2000:]
  assert not (tmp_path / 't.json').exists()
