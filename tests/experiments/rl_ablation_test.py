"""experiments/rl_ablation.py as a user runs it: bad input in one line before any run, the smoke
preset's runs aggregated over seeds (each figure against the runs' own summaries), and a second
call that only runs what is missing."""

import json
import os
import statistics

import pytest

from earl_jax.testing import helpers

_RUN = (
  '--presets=smoke',
  '--seeds=0,1',
  '--extra=--config.steps=2',
  '--extra=--config.eval_every=2',
)


@pytest.mark.parametrize(
  ('args', 'fragment'),
  [
    (('--presets=nope',), "--presets: unknown preset 'nope'; expected some of default,"),
    (('--settings=as_is,fancy',), "--settings: unknown setting 'fancy'; expected some of as_is,"),
    (('--seeds=0,x',), "--seeds: 'x' is not an int in [0, 2147483646]."),
    (('--custom=lr',), "--custom='lr': expected 'NAME:FLAG ...'"),
    (('--custom=rloo:--config.seed=3',), "--custom name 'rloo' is taken"),
    (('--custom=a:--steps=3',), "--custom 'a': '--steps=3' is not a --config.<field>=<value>"),
  ],
)
def test_bad_input_ends_in_one_line_before_any_run(tmp_path, args, fragment):
  out = tmp_path / 'out'
  done = helpers.run_module('experiments.rl_ablation', f'--out={out}', *args, timeout=120)
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ') and fragment in lines[0], lines
  assert not out.exists()


@pytest.mark.slow
def test_seeds_aggregate_into_one_table_and_a_second_call_runs_only_what_is_missing(tmp_path):
  out = tmp_path / 'out'
  args = (
    f'--out={out}',
    *_RUN,
    '--settings=as_is,lr',
    '--custom=lr:--config.optim.learning_rate=3e-3',
  )
  first = helpers.run_module('experiments.rl_ablation', *args, timeout=900)
  assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
  data = json.loads((out / 'ablation.json').read_text())
  assert [(r['setting'], r['seed']) for r in data['runs']] == [
    ('as_is', 0),
    ('as_is', 1),
    ('lr', 0),
    ('lr', 1),
  ]
  assert data['runs'][2]['flags'] == ['--config.optim.learning_rate=3e-3']
  for agg in data['aggregates']:
    wins = []
    for seed in (0, 1):
      workdir = out / 'smoke' / agg['setting'] / f'seed{seed}'
      summary = json.loads((workdir / 'summary.json').read_text())
      config = json.loads((workdir / 'config.json').read_text())
      assert config['seed'] == seed and summary['steps'] == 2
      wins.append(summary['eval_last']['win_rate'])
    cell = agg['eval/win_rate']
    assert cell['values'] == wins and cell['n'] == 2
    assert cell['mean'] == pytest.approx(statistics.mean(wins))
    assert cell['std'] == pytest.approx(statistics.stdev(wins))
    assert 'diag/entropy' in agg and 'wall_s' in agg
  table = (out / 'ablation.md').read_text()
  assert '| figure | `as_is` (n=2) | `lr` (n=2) |' in table
  assert '- `lr`: --config.optim.learning_rate=3e-3' in table
  assert (out / 'ablation.png').stat().st_size > 0
  # --report_only: a setting not run yet is left out, and nothing runs.
  report = helpers.run_module(
    'experiments.rl_ablation', *args[:-2], '--settings=as_is,lr,gspo', args[-1], '--report_only'
  )
  assert report.returncode == 0 and 'gspo' not in report.stdout.split('### `smoke`')[1]
  assert not (out / 'smoke' / 'gspo').exists()
  # A cut ablation: one run's summary gone. The same command runs that one alone (resumed from
  # its checkpoint), and the table is the same.
  os.remove(out / 'smoke' / 'lr' / 'seed1' / 'summary.json')
  second = helpers.run_module('experiments.rl_ablation', *args, timeout=900)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  assert second.stdout.count(': done before') == 3
  assert 'smoke/lr/seed1: ' in second.stdout and '--resume' in second.stdout
  again = json.loads((out / 'ablation.json').read_text())
  assert [(r['setting'], r['seed'], r['figures']['eval/win_rate']) for r in again['runs']] == [
    (r['setting'], r['seed'], r['figures']['eval/win_rate']) for r in data['runs']
  ]
