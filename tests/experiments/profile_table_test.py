"""experiments/profile.py: the offline table of a preset, its report, and a run that starts from
it."""

import json

import pytest

from earl_jax.profiling.table import Cell, Profile, report
from earl_jax.stage import STAGES, Stage
from earl_jax.testing import helpers

# The smoke preset with a measured rollout stage (its two layouts, buckets 64 and 128).
ROLLOUT = ('--config=smoke', '--config.selector.profile.stages=rollout')


def test_a_run_started_from_the_table_measures_nothing(tmp_path):
  table = tmp_path / 'table.json'
  r = helpers.run_module(
    'experiments.profile', *ROLLOUT, f'--out={table}', '--repeats=1', '--rounds=3'
  )
  assert r.returncode == 0, r.stderr[-2000:]
  data = json.loads(table.read_text())
  cells = {(c['bucket'], c['config']) for c in data['cells']}
  assert cells == {(b, c) for b in (64, 128) for c in ('dp8.tp1', 'dp4.tp2')}
  assert all(len(c['times_ms']) == 3 for c in data['cells'])  # rounds x repeats
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


def test_every_stage_of_the_smoke_preset_end_to_end_report_included(tmp_path):
  table = tmp_path / 'table.json'
  r = helpers.run_module(
    'experiments.profile',
    '--config=smoke',
    '--config.selector.profile.stages=rollout,experience,train',
    f'--out={table}',
    '--rounds=3',
    '--repeats=1',
  )
  assert r.returncode == 0, r.stderr[-2000:]
  data = json.loads(table.read_text())
  assert {c['stage'] for c in data['cells']} == {'rollout', 'experience', 'train'}
  assert all(len(c['times_ms']) == 3 for c in data['cells'] if not c['oom'])
  for stage in ('rollout', 'experience', 'train'):
    assert f'{stage} (' in r.stdout, r.stdout  # a line per stage and load in the report
  assert 'within-cell spread' in r.stdout


def _default_shaped() -> Profile:
  """A profile keyed as the default's: rollout on its 16 slots, experience and train at 16 and
  64 rows (the load bins), two buckets, dp8 and dp4.tp2."""
  key = {
    'stages': [str(s) for s in STAGES],
    'candidates': {str(s): ['dp8.tp1', 'dp4.tp2'] for s in STAGES},
    'buckets': [128, 256],
    'rows': [16, 64],
    'stage_rows': {'rollout': 16},
  }
  cells = {}
  for stage in STAGES:
    for rows in (16,) if stage == Stage.ROLLOUT else (16, 64):
      for bucket in (128, 256):
        for name, tgs in (('dp8.tp1', 100.0), ('dp4.tp2', 120.0 if bucket == 256 else 80.0)):
          cells[(stage, bucket, rows, name)] = Cell(
            stage=stage,
            config=name,
            bucket=bucket,
            rows=rows,
            peak_bytes=1,
            oom=False,
            throughput=tgs,
            times_ms=(1.0, 1.1, 1.2),
          )
  return Profile(key=key, cells=cells)


def test_the_report_on_the_defaults_own_shapes():
  """The report reads each stage at the loads it was profiled at: the rollout at its slots only
  (it asked for the rollout at 64 rows, which the default never profiles, and crashed)."""
  profile = _default_shaped()
  with pytest.raises(KeyError):
    profile.cell(Stage.ROLLOUT, 128, 64, 'dp8.tp1')
  text = report(profile)
  assert 'rollout (16 responses): 128: dp8.tp1, 256: dp4.tp2' in text
  assert 'rollout (64 responses)' not in text
  assert 'train (64 responses): 128: dp8.tp1, 256: dp4.tp2' in text
  assert 'median 9.1%' in text  # (1.15 - 1.05) / 1.1
