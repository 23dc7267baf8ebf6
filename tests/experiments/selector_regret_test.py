"""experiments/selector_regret.py on a recorded run and profile: the table, the JSON, the PNG, and
bad input in one line."""

import json

from earl_jax.testing import helpers, profiles

TRUTH = profiles.crossing_truth()
_decision = profiles.decision


def _recorded_run(tmp_path):
  run = tmp_path / 'run'
  run.mkdir()
  measured = {k: c for k, c in TRUTH.cells.items() if k[1] == 128}
  summary = {
    'wall_s': 100.0,
    'profile_share': 0.05,
    'decisions': [
      _decision('rollout', 0, 'dp8.tp1', 128),
      _decision('rollout', 1, 'dp8.tp1', 512, measured=False),
      _decision('train', 0, 'dp4.tp2', 128),
    ],
    'profile': type(TRUTH)(key=TRUTH.key, cells=measured).to_json(),
  }
  (run / 'summary.json').write_text(json.dumps(summary))
  profile = tmp_path / 'truth.json'
  profile.write_text(json.dumps(TRUTH.to_json()))
  return run, profile


def test_the_regret_table_json_and_png_of_a_recorded_run(tmp_path):
  run, profile = _recorded_run(tmp_path)
  r = helpers.run_module(
    'experiments.selector_regret', f'--run={run}', f'--profile={profile}', f'--profile_b={profile}'
  )
  assert r.returncode == 0, r.stderr[-2000:]
  lines = r.stdout.splitlines()
  rollout = next(line for line in lines if line.split()[:1] == ['rollout'])
  # steps, mean, max, then beyond the noise of the two (here identical) profiles: the same
  assert rollout.split()[1:7] == ['2', '12.5%', '25.0%', '12.5%', '/', '25.0%'], rollout
  assert 'profile share of the run: 5.0%' in r.stdout
  assert "rollout: the run timed 2 cells at 1.00x the profile's throughput" in r.stdout
  assert 'same fastest layout in 100% of the cells' in r.stdout
  assert (
    'crossover rollout x16: dp8.tp1 @256 -> dp4.tp2 @512 by 25.0% (the other profile: +25.0%); '
    'the run chose dp8.tp1' in r.stdout
  )
  result = json.loads((run / 'regret.json').read_text())
  assert result['stages']['train']['mean'] == 0.25
  assert result['model_error']['rollout']['cells'] == 4  # 256 and 512, both layouts
  assert (run / 'regret.png').read_bytes()[:4] == b'\x89PNG'


def test_a_missing_run_or_profile_is_one_line_and_exit_code_2(tmp_path):
  run, profile = _recorded_run(tmp_path)
  for args, what in (
    ((f'--run={tmp_path}/none', f'--profile={profile}'), '--run='),
    ((f'--run={run}', f'--profile={tmp_path}/none.json'), '--profile='),
  ):
    r = helpers.run_module('experiments.selector_regret', *args)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith('error:')]
    assert len(errors) == 1 and what in errors[0], r.stderr[-2000:]


def test_a_profile_of_another_machine_is_refused_in_one_line(tmp_path):
  """A ground truth taken on another machine ranks by that machine's speeds: refused, naming
  the field, exit code 2, nothing written."""
  import dataclasses

  run, profile = _recorded_run(tmp_path)
  summary = json.loads((run / 'summary.json').read_text())
  summary['profile']['key']['hardware'] = {'cpu_model': 'AMD EPYC'}
  (run / 'summary.json').write_text(json.dumps(summary))
  other = dataclasses.replace(TRUTH, key={**TRUTH.key, 'hardware': {'cpu_model': 'Intel Xeon'}})
  profile.write_text(json.dumps(other.to_json()))
  r = helpers.run_module('experiments.selector_regret', f'--run={run}', f'--profile={profile}')
  assert r.returncode == 2, r.stderr[-2000:]
  errors = [x for x in r.stderr.splitlines() if x.startswith('error:')]
  assert len(errors) == 1, r.stderr[-2000:]
  assert (
    "--profile was taken on another setup than the run (hardware.cpu_model: 'AMD EPYC' vs "
    in errors[0]
  )
  assert not (run / 'regret.json').exists()
