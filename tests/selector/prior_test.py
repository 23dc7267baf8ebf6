"""The prior: a figure for every cell before it is measured, scaled by the cells measured since,
and the candidates it leaves unmeasured (the rule-out margin, the memory bound)."""

import pytest

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.selector import analytic, prior
from earl_jax.selector.profile import Cell, Profile
from earl_jax.selector.selector import DEFAULT_SHAPES
from earl_jax.stage import Stage

CFG = ModelConfig.preset('small-kv')  # H = K = 8: tp 1, 2, 4 and 8 are all valid
TABLE = BucketConfig(lengths=(128, 256, 512, 1024))
DP8, DP4TP2, DP2TP4, TP8 = (ParallelConfig.parse(n) for n in ('dp8', 'dp4.tp2', 'dp2.tp4', 'tp8'))
LAYOUTS = (DP8, DP4TP2, DP2TP4, TP8)
R = 16


def _key(stages=('rollout', 'train')) -> dict:
  return {
    'stages': list(stages),
    'candidates': {s: [c.name for c in LAYOUTS] for s in stages},
    'buckets': list(TABLE.lengths),
    'rows': [R],
  }


def _measured(stage, bucket, config, tgs, *, oom=False, peak=1 << 20) -> Cell:
  return Cell(
    stage=Stage.parse(stage),
    config=config.name,
    bucket=bucket,
    rows=R,
    peak_bytes=peak,
    oom=oom,
    throughput=None if oom else tgs,
  )


def _profile(*cells: Cell) -> Profile:
  return Profile(key=_key(), cells={(c.stage, c.bucket, c.rows, c.config): c for c in cells})


def _complete(profile: Profile) -> Profile:
  return prior.complete(profile, model=CFG, shapes=DEFAULT_SHAPES)


def _seconds(stage, config, bucket) -> float:
  return analytic.call_seconds(
    stage, CFG, config, bucket, R, decode_tokens=8, chunk=16, micro_batches=1
  )


def _work(stage, bucket) -> float:
  """The stage's whole work at a bucket: what the prior scales a measured time by."""
  return _seconds(stage, ParallelConfig(), bucket)


def test_every_cell_has_a_prior_before_any_measurement():
  full = _complete(_profile())
  assert len(full.cells) == 2 * len(TABLE.lengths) * len(LAYOUTS)
  for (stage, bucket, rows, name), cell in full.cells.items():
    assert not cell.measured and cell.prior == prior.ANALYTIC and cell.throughput > 0
    # Memory is the analytic model's.
    want = analytic.estimate(stage, CFG, ParallelConfig.parse(name), bucket, rows, chunk=16)
    assert cell.peak_bytes == want.total
  # The analytic time model: a call at a longer context takes longer, for every stage and layout.
  for stage in (Stage.ROLLOUT, Stage.TRAIN):
    for c in LAYOUTS:
      seconds = [prior.seconds_per_call(full.cell(stage, b, R, c), 8) for b in TABLE.lengths]
      assert seconds == sorted(seconds), (stage, c, seconds)
  assert _complete(_profile()).cells == full.cells  # a function of the measured cells alone


def test_measurements_scale_the_prior_and_are_kept_as_measured():
  dp8 = _measured('rollout', 256, DP8, 300.0)
  tp8 = _measured('rollout', 256, TP8, 200.0)
  full = _complete(_profile(dp8, tp8))
  assert full.cell(Stage.ROLLOUT, 256, R, DP8) is dp8
  up = full.cell(Stage.ROLLOUT, 512, R, DP8)
  assert not up.measured and up.prior == 'dp8.tp1@256'
  # Its time per call grows as the stage's whole work does (tokens per call are the same).
  ratio = _work(Stage.ROLLOUT, 512) / _work(Stage.ROLLOUT, 256)
  assert up.throughput == pytest.approx(300.0 / ratio)
  # Nearby, the layouts keep the order (and the ratio) they were measured in.
  assert up.throughput / full.cell(Stage.ROLLOUT, 512, R, TP8).throughput == pytest.approx(1.5)
  # The nearest measured cell is the one scaled (128 from 256, not from anything further).
  assert full.cell(Stage.ROLLOUT, 128, R, DP8).prior == 'dp8.tp1@256'
  # A layout measured nowhere takes the median time of the measured layouts, scaled so.
  other = full.cell(Stage.ROLLOUT, 512, R, DP2TP4)
  assert other.prior == prior.LAYOUTS
  assert other.throughput == pytest.approx(2 / (1 / 300.0 + 1 / 200.0) / ratio)
  # A stage with nothing measured takes the analytic model per layout, scaled to this device by
  # the other stages' cells (the median of measured over analytic time).
  train = full.cell(Stage.TRAIN, 512, R, DP8)
  assert train.prior == prior.DEVICE
  scale = sorted(
    prior.seconds_per_call(c, 8) / _seconds(Stage.ROLLOUT, ParallelConfig.parse(c.config), 256)
    for c in (dp8, tp8)
  )
  device = (scale[0] + scale[1]) / 2
  assert prior.seconds_per_call(train, 8) == pytest.approx(_seconds(Stage.TRAIN, DP8, 512) * device)
  # What a cache or a checkpoint keeps: the measurements only.
  assert set(full.measured_only().cells.values()) == {dp8, tp8}


def test_the_rule_out_margin():
  """At 256: dp4.tp2 300, dp2.tp4 140, tp8 40 tok/s/dev measured, dp8 nowhere; at 512 nothing.
  Their priors at 512 keep those ratios: a factor of 2 leaves dp2.tp4 (2.14x slower) and tp8
  (7.5x) unmeasured, 2.5 only tp8, 10 none. dp8, measured nowhere (the median, 140), is never
  ruled out by speed; on a tie the candidates' order decides."""
  measured = _profile(
    _measured('rollout', 256, DP4TP2, 300.0),
    _measured('rollout', 256, DP2TP4, 140.0),
    _measured('rollout', 256, TP8, 40.0),
  )
  full = _complete(measured)

  def wanted(factor):
    return prior.to_measure(full, Stage.ROLLOUT, 512, R, budget=None, margin=0.0, factor=factor)

  assert full.cell(Stage.ROLLOUT, 512, R, DP8).prior == prior.LAYOUTS
  assert wanted(2.0) == ['dp4.tp2', 'dp8.tp1']  # the most promising first
  assert wanted(2.5) == ['dp4.tp2', 'dp8.tp1', 'dp2.tp4']
  assert wanted(10.0) == ['dp4.tp2', 'dp8.tp1', 'dp2.tp4', 'dp1.tp8']
  assert wanted(0.0) == wanted(10.0)  # 0: never ruled out by speed
  # Where they were measured, nothing is left to measure but dp8.
  assert prior.to_measure(full, Stage.ROLLOUT, 256, R, budget=None, margin=0.0, factor=2.0) == [
    'dp8.tp1'
  ]
  # Before any measurement nothing is ruled out by speed: the analytic figures are nominal.
  empty = _complete(_profile())
  assert len(prior.to_measure(empty, Stage.TRAIN, 512, R, budget=None, margin=0.0, factor=2.0)) == 4


def test_memory_leaves_out_only_what_cannot_fit_even_within_the_models_error():
  full = _complete(_profile(_measured('rollout', 1024, DP2TP4, 1.0, oom=True, peak=1 << 30)))
  need = {c.name: full.cell(Stage.ROLLOUT, 1024, R, c).peak_bytes for c in LAYOUTS}
  # A budget below dp8's analytic need but above its lower bound: XLA decides, so it is measured.
  budget = int(need['dp8.tp1'] * 0.95)
  assert prior.lower_need(need['dp8.tp1']) < budget
  names = prior.to_measure(full, Stage.ROLLOUT, 1024, R, budget=budget, margin=0.0, factor=2.0)
  assert 'dp8.tp1' in names
  assert 'dp2.tp4' not in names  # XLA measured it over the budget
  # A budget below even the lower bound: left out, never compiled.
  low = int(prior.lower_need(need['dp8.tp1']) * 0.9)
  names = prior.to_measure(full, Stage.ROLLOUT, 1024, R, budget=low, margin=0.0, factor=2.0)
  assert 'dp8.tp1' not in names
  # The lower bound is the least XLA peak the stated error allows: |analytic - xla| <= max(rel x
  # xla, abs) holds there and fails just below it.
  n, lowest = need['dp8.tp1'], prior.lower_need(need['dp8.tp1'])

  def allowed(xla):
    return n - xla <= max(analytic.ANALYTIC_REL_ERROR * xla, analytic.ANALYTIC_ABS_ERROR) + 1e-6

  assert allowed(lowest) and not allowed(0.99 * lowest)
