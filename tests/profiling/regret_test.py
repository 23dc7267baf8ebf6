"""The regret of a run's decisions against an offline profile, the cost model's error on the cells
the run did not measure, crossovers, and the noise between two profiles."""

import dataclasses

import pytest

from earl_jax.profiling import regret
from earl_jax.profiling.table import Profile
from earl_jax.testing import profiles

TRUTH = profiles.crossing_truth()  # dp8 wins at 128 and 256, dp4.tp2 at 512, by 25%
_decision = profiles.decision


def test_the_regret_of_each_decision_at_the_cell_it_ran():
  decisions = [
    _decision('rollout', 0, 'dp8.tp1', 128),  # best: 0
    _decision('rollout', 1, 'dp8.tp1', 512, measured=False),  # 75 / 60 - 1 = 0.25
    _decision('rollout', 2, 'dp4.tp2', 512),  # best: 0
    _decision('train', 0, 'dp4.tp2', 128),  # 100 / 80 - 1 = 0.25
    _decision('train', 1, 'dp4.tp2', 256, reason='...; REFUSED: too big'),  # skipped
    _decision('train', 1, 'dp8.tp1', 256),  # 0
  ]
  rows = regret.per_step(decisions, TRUTH)
  assert [round(r.regret, 6) for r in rows] == [0.0, 0.25, 0.0, 0.25, 0.0]
  assert rows[1].best == 'dp4.tp2' and not rows[1].measured
  stages = regret.by_stage(rows)
  assert stages['rollout'] == {
    'steps': 3,
    'mean': pytest.approx(0.25 / 3),
    'max': 0.25,
    'off_best': 1,
    'model_only': 1,
    'unknown': 0,
    'beyond_noise_mean': None,
    'beyond_noise_max': None,
  }
  assert stages['train']['mean'] == pytest.approx(0.125) and stages['train']['off_best'] == 1
  # A cell the truth lacks is unknown, not zero.
  lacking = regret.per_step([_decision('rollout', 0, 'dp1.tp8', 128)], TRUTH)
  assert lacking[0].regret is None and regret.by_stage(lacking)['rollout']['unknown'] == 1


def test_crossovers_and_the_noise_between_two_profiles():
  found = regret.crossovers(TRUTH)
  assert [(c['stage'], c['from_bucket'], c['bucket'], c['before'], c['after']) for c in found] == [
    ('rollout', 256, 512, 'dp8.tp1', 'dp4.tp2'),
    ('train', 256, 512, 'dp8.tp1', 'dp4.tp2'),
  ]
  assert found[0]['margin'] == pytest.approx(0.25)
  # A second profile 10% slower on dp4.tp2 everywhere: dp4.tp2 still wins at 512 by 67.5/60.
  other = profiles.profile(
    {
      (str(s), b, n): c.throughput * (0.9 if n == 'dp4.tp2' else 1.0)
      for (s, b, r, n), c in TRUTH.cells.items()
    }
  )
  assert regret.crossovers(TRUTH, other)[0]['margin_other'] == pytest.approx(67.5 / 60 - 1)
  noise = regret.noise(TRUTH, other)
  assert noise['cells'] == 12 and noise['best_agree'] == 1.0
  # Half the cells agree exactly, half differ by 1/0.9 - 1: the median is between the two.
  assert noise['median'] == pytest.approx((1 / 0.9 - 1) / 2, rel=1e-6)
  assert noise['p90'] == pytest.approx(1 / 0.9 - 1, rel=1e-6)
  # The layouts a run chose at a crossover's bucket.
  steps = regret.per_step([_decision('rollout', 3, 'dp8.tp1', 512)], TRUTH)
  assert regret.crossovers(TRUTH, other, steps)[0]['run_chose'] == ['dp8.tp1']
  assert 'run_chose' not in regret.crossovers(TRUTH, other, steps)[1]


def test_regret_beyond_the_noise_of_two_profiles():
  """Where the second profile ranks the chosen layout first, the regret beyond noise is 0; where
  both rank it behind, it is the smaller of the two regrets."""
  other = profiles.profile(
    {
      (str(s), b, n): c.throughput * (1.5 if (b, n) == (512, 'dp8.tp1') else 1.0)
      for (s, b, r, n), c in TRUTH.cells.items()
      if not (str(s) == 'train' and b == 128)
    }
  )
  decisions = [
    _decision('rollout', 0, 'dp8.tp1', 512),  # truth: 75 / 60 - 1; other: dp8 first (90 > 75)
    _decision('rollout', 1, 'dp8.tp1', 256),  # the fastest in both: 0
    _decision('train', 0, 'dp4.tp2', 128),  # the other profile lacks the cell: unknown
  ]
  rows = regret.per_step(decisions, TRUTH, other)
  assert rows[0].regret == pytest.approx(0.25) and rows[0].regret_other == 0.0
  assert [r.beyond_noise for r in rows] == [0.0, 0.0, None]
  stages = regret.by_stage(rows)
  assert stages['rollout']['beyond_noise_max'] == 0.0 and stages['rollout']['max'] == 0.25
  assert stages['train']['beyond_noise_mean'] is None
  # Both ranking it behind: the smaller regret.
  slower = profiles.profile(
    {
      (str(s), b, n): c.throughput * (0.5 if n == 'dp8.tp1' else 1.0)
      for (s, b, r, n), c in TRUTH.cells.items()
    }
  )
  (row,) = regret.per_step([_decision('rollout', 0, 'dp8.tp1', 512)], TRUTH, slower)
  assert row.beyond_noise == pytest.approx(0.25) and row.regret_other == pytest.approx(1.5)


def test_the_model_error_on_the_cells_the_run_did_not_measure():
  """A run that measured the truth's own cells at 128 and 512: the model fitted to them is
  scored on the 256 cells only, and is within a few percent there (the truth is smooth)."""
  measured = Profile(
    key=TRUTH.key, cells={k: c for k, c in TRUTH.cells.items() if k[1] in (128, 512)}
  )
  errors = regret.model_error(measured, TRUTH)
  assert set(errors) == {'rollout', 'train'}
  assert all(e['cells'] == 2 for e in errors.values())
  assert all(0 <= e['median'] < 0.5 for e in errors.values())
  # Nothing left unmeasured: nothing to score.
  assert regret.model_error(TRUTH, TRUTH) == {}
  # Only where the run went: its loads, up to its longest run bucket (rollout to 256 here).
  steps = regret.per_step(
    [_decision('rollout', 0, 'dp8.tp1', 128), _decision('rollout', 1, 'dp8.tp1', 256)], TRUTH
  )
  within = regret.reach(steps)
  assert within == {'rollout': ({16}, 256)}
  assert regret.model_error(measured, TRUTH, within) == {
    'rollout': {**regret.model_error(measured, TRUTH)['rollout']}
  }
  # A machine twice as fast for the run: its model is scored against the truth x 2.
  faster = Profile(
    key=TRUTH.key,
    cells={
      k: dataclasses.replace(c, throughput=2 * c.throughput) for k, c in measured.cells.items()
    },
  )
  assert regret.drift(faster, TRUTH) == pytest.approx(2.0)
  for stage, e in regret.model_error(faster, TRUTH, scale=2.0).items():
    assert e['median'] == pytest.approx(errors[stage]['median'], rel=1e-4)
  assert all(e['median'] > 0.5 for e in regret.model_error(faster, TRUTH).values())


def test_the_runs_timings_against_the_truths():
  """A run that timed every rollout cell 20% faster and the train cells as the truth did."""
  run = profiles.profile(
    {
      (str(s), b, n): c.throughput * (1.2 if str(s) == 'rollout' else 1.0)
      for (s, b, r, n), c in TRUTH.cells.items()
      if b != 256
    }
  )
  found = regret.agreement(run, TRUTH)
  assert regret.drift(run, TRUTH) == pytest.approx(1.1)  # the median of 4 x 1.2 and 4 x 1.0
  assert found['rollout']['cells'] == 4 and found['rollout']['ratio'] == pytest.approx(1.2)
  assert found['rollout']['median'] == pytest.approx(0.2)
  assert found['train'] == {'cells': 4, 'ratio': 1.0, 'median': 0.0, 'max': 0.0}


def test_a_profile_of_another_machine_or_model_is_named_as_such():
  """The truth judges a run only on the setup the run measured on: each differing field of the
  machine and the model is named; candidates, buckets and loads may differ."""
  run_key = {**TRUTH.key, 'hardware': {'cpu_model': 'AMD EPYC', 'host_cpus': 2, 'jax': '0.10.2'}}
  run = dataclasses.replace(TRUTH, key=run_key)
  same = dataclasses.replace(TRUTH, key={**run_key, 'buckets': [128, 256]})
  assert regret.setup_differences(run, same) == []
  other = {**run_key['hardware'], 'cpu_model': 'Intel(R) Xeon(R) Processor'}
  model = {**run_key['model'], 'num_layers': 4}
  truth = dataclasses.replace(TRUTH, key={**run_key, 'hardware': other, 'model': model})
  assert regret.setup_differences(run, truth) == [
    "hardware.cpu_model: 'AMD EPYC' vs 'Intel(R) Xeon(R) Processor'",
    'model.num_layers: 2 vs 4',
  ]
  assert regret.setup_differences(run, TRUTH) == []  # the truth names no machine: not compared
