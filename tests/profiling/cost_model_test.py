"""The cost model: a figure and an uncertainty for every cell, a curve per layout that can cross
another's, and the measurement policy (pruned only while confidently slower; the memory bound)."""

import dataclasses
import math

import numpy as np
import pytest

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.profiling import analytic, cost_model
from earl_jax.profiling.table import Cell, Profile
from earl_jax.selector.selector import DEFAULT_SHAPES
from earl_jax.stage import Stage

CFG = ModelConfig.preset('small-kv')  # H = K = 8: tp 1, 2, 4 and 8 are all valid
TABLE = BucketConfig(lengths=(128, 256, 512, 1024, 2048))
DP8, DP4TP2, DP2TP4, TP8 = (ParallelConfig.parse(n) for n in ('dp8', 'dp4.tp2', 'dp2.tp4', 'tp8'))
LAYOUTS = (DP8, DP4TP2, DP2TP4, TP8)
R = 16
N = DEFAULT_SHAPES.decode_tokens


def _key(stages=('rollout', 'train')) -> dict:
  return {
    'stages': list(stages),
    'candidates': {s: [c.name for c in LAYOUTS] for s in stages},
    'buckets': list(TABLE.lengths),
    'rows': [R],
  }


def _terms(stage, config, bucket) -> np.ndarray:
  matmul, attention, memory, comm = analytic.call_terms(
    stage, CFG, config, bucket, R, decode_tokens=N, chunk=16, micro_batches=1
  )
  return np.array([matmul + attention + memory, comm, 1.0])  # the truth's: compute, comm, fixed


def _cell(stage, bucket, config, seconds=None, *, tgs=None, oom=False, peak=1 << 20, times=()):
  """A measured cell whose call takes `seconds` (or whose throughput is `tgs`)."""
  stage = Stage.parse(stage)
  if tgs is None and not oom:
    tgs = cost_model.tokens_per_call(stage, bucket, R, N) / (seconds * config.num_devices)
  return Cell(
    stage=stage,
    config=config.name,
    bucket=bucket,
    rows=R,
    peak_bytes=peak,
    oom=oom,
    throughput=None if oom else tgs,
    times_ms=tuple(times),
  )


def _profile(*cells: Cell) -> Profile:
  return Profile(key=_key(), cells={(c.stage, c.bucket, c.rows, c.config): c for c in cells})


def _complete(profile: Profile) -> Profile:
  return cost_model.complete(profile, model=CFG, shapes=DEFAULT_SHAPES)


def _seconds(profile: Profile, stage, bucket, config) -> float:
  return cost_model.seconds_per_call(profile.cell(stage, bucket, R, config), N)


def test_every_cell_has_a_figure_and_an_uncertainty_before_any_measurement():
  full = _complete(_profile())
  assert len(full.cells) == 2 * len(TABLE.lengths) * len(LAYOUTS)
  for (stage, bucket, rows, name), cell in full.cells.items():
    assert not cell.measured and cell.prior == cost_model.ANALYTIC and cell.throughput > 0
    assert cell.uncertainty == cost_model.MAX_UNCERTAINTY  # nothing measured: unknown
    want = analytic.estimate(stage, CFG, ParallelConfig.parse(name), bucket, rows, chunk=16)
    assert cell.peak_bytes == want.total  # memory is the analytic model's
  # A call at a longer context takes longer, for every stage and layout.
  for stage in (Stage.ROLLOUT, Stage.TRAIN):
    for c in LAYOUTS:
      seconds = [_seconds(full, stage, b, c) for b in TABLE.lengths]
      assert seconds == sorted(seconds), (stage, c, seconds)
  assert _complete(_profile()).cells == full.cells  # a function of the measured cells alone


def _truth(weights: dict[str, tuple[float, float, float]], stage=Stage.TRAIN):
  """Seconds per call of each layout at each bucket, from per-layout weights on the terms."""
  return {
    (name, b): float(_terms(stage, ParallelConfig.parse(name), b) @ np.array(w))
    for name, w in weights.items()
    for b in TABLE.lengths
  }


def test_the_fitted_model_reproduces_a_crossover_from_cells_on_either_side():
  """dp8: little fixed cost, a large compute weight; dp2.tp4: a large fixed cost and a small
  compute weight. The truth crosses between 512 (dp8 10% faster) and 1024 (dp2.tp4 18% faster);
  each layout is measured at 128, 256 and 2048 only, and the model must put the crossover where
  the truth has it."""
  s = 1.0 / sum(_terms(Stage.TRAIN, DP8, 128)[:2]) * 0.01  # dp8 takes ~10 ms at 128
  weights = {'dp8.tp1': (s, s, 0.001), 'dp2.tp4': (0.1 * s, 0.02 * s, 0.015)}
  truth = _truth(weights)
  winner = {b: min(weights, key=lambda n: truth[(n, b)]) for b in TABLE.lengths}
  assert winner[128] == 'dp8.tp1' and winner[2048] == 'dp2.tp4'  # a real crossover
  measured = [
    _cell('train', b, ParallelConfig.parse(n), truth[(n, b)], times=(1.0, 1.0, 1.0))
    for n in weights
    for b in (128, 256, 2048)
  ]
  full = _complete(_profile(*measured))
  for b in TABLE.lengths:
    model = {n: _seconds(full, Stage.TRAIN, b, ParallelConfig.parse(n)) for n in weights}
    assert min(model, key=model.get) == winner[b], (b, model, truth)
    for n in weights:
      assert model[n] == pytest.approx(truth[(n, b)], rel=0.1), (n, b)
  # The unmeasured figures say what they rest on and how uncertain they are.
  cell = full.cell(Stage.TRAIN, 1024, R, 'dp8.tp1')
  assert cell.prior == 'dp8.tp1@128,256,2048' and 0 < cell.uncertainty < 0.3


def test_a_single_scale_factor_could_not_cross():
  """The same two layouts measured at one bucket only: the model cannot know the crossover yet,
  and says so: its uncertainty at the far bucket is larger than once two buckets are measured."""
  s = 1.0 / sum(_terms(Stage.TRAIN, DP8, 128)[:2]) * 0.01
  weights = {'dp8.tp1': (s, s, 0.001), 'dp2.tp4': (0.1 * s, 0.02 * s, 0.015)}
  truth = _truth(weights)
  one = [
    _cell('train', 128, ParallelConfig.parse(n), truth[(n, 128)], times=(1, 1, 1)) for n in weights
  ]
  two = one + [
    _cell('train', 2048, ParallelConfig.parse(n), truth[(n, 2048)], times=(1, 1, 1))
    for n in weights
  ]
  far_one = _complete(_profile(*one)).cell(Stage.TRAIN, 1024, R, 'dp2.tp4')
  far_two = _complete(_profile(*two)).cell(Stage.TRAIN, 1024, R, 'dp2.tp4')
  truth_1024 = cost_model.tokens_per_call(Stage.TRAIN, 1024, R, N) / (truth[('dp2.tp4', 1024)] * 8)
  assert far_one.uncertainty > 1.0  # one bucket: the growth is not known within a factor e
  assert abs(far_one.throughput / truth_1024 - 1) > 0.3
  assert far_two.throughput == pytest.approx(truth_1024, rel=0.1)  # two: the curve is pinned
  # Near its one measured cell the model is sure of itself.
  near = _complete(_profile(*one)).cell(Stage.TRAIN, 128, R, 'dp4.tp2')
  assert near.prior == cost_model.STAGE  # dp4.tp2 measured nowhere: the stage's pooled curve


def test_a_stage_timed_at_one_bucket_takes_its_shape_from_the_other_stages():
  """The device runs every stage's work at the same per-term speeds (its compute 3x the
  nominal cost, its collectives a tenth of it), each stage with a fixed cost of its own.
  Experience is timed at 128, 512 and 2048, train at 2048 only: the model's train figures at the
  other buckets follow experience's shape, within 10% of the truth, where train's one cell alone
  cannot tell its fixed cost from its compute (off by over 30% at 128)."""
  s = 0.03 / sum(_terms(Stage.TRAIN, DP8, 2048)[:2])  # dp8 train takes ~30 ms at 2048
  truth = {
    stage: _truth({'dp8.tp1': (3 * s, 0.1 * s, fixed)}, stage=stage)
    for stage, fixed in ((Stage.EXPERIENCE, 0.002), (Stage.TRAIN, 0.004))
  }
  quiet = (1.0, 1.0, 1.0)
  experience = [
    _cell('experience', b, DP8, truth[Stage.EXPERIENCE][('dp8.tp1', b)], times=quiet)
    for b in (128, 512, 2048)
  ]
  train = _cell('train', 2048, DP8, truth[Stage.TRAIN][('dp8.tp1', 2048)], times=quiet)
  key = _key(stages=('experience', 'train'))

  def train_error(*cells):
    profile = Profile(key=key, cells={(c.stage, c.bucket, c.rows, c.config): c for c in cells})
    full = _complete(profile)
    return {
      b: _seconds(full, Stage.TRAIN, b, DP8) / truth[Stage.TRAIN][('dp8.tp1', b)] - 1
      for b in (128, 256, 512, 1024)
    }

  assert all(abs(e) < 0.1 for e in train_error(train, *experience).values())
  assert abs(train_error(train)[128]) > 0.3


def test_layouts_measured_nowhere_and_stages_measured_nowhere():
  dp8 = _cell('rollout', 256, DP8, tgs=300.0, times=(10.0, 10.2, 10.1))
  tp8 = _cell('rollout', 256, TP8, tgs=200.0, times=(10.0, 10.2, 10.1))
  full = _complete(_profile(dp8, tp8))
  assert full.cell(Stage.ROLLOUT, 256, R, DP8).throughput == 300.0  # measurements are kept
  assert full.cell(Stage.ROLLOUT, 256, R, DP8).uncertainty == cost_model.MIN_NOISE
  assert full.cell(Stage.ROLLOUT, 512, R, DP8).prior == 'dp8.tp1@256'
  other = full.cell(Stage.ROLLOUT, 256, R, DP2TP4)
  assert other.prior == cost_model.STAGE
  assert full.cell(Stage.ROLLOUT, 256, R, DP8).uncertainty < other.uncertainty
  train = full.cell(Stage.TRAIN, 512, R, DP8)
  # Train, timed nowhere, takes its compute weights from the rollout's cells (at one bucket):
  # a figure, but uncertain by a factor over e^2 either way.
  assert train.prior == cost_model.DEVICE and 2 < train.uncertainty <= cost_model.MAX_UNCERTAINTY
  kept = full.measured_only().cells  # what a cache keeps: the measurements
  assert {k: c.throughput for k, c in kept.items()} == {
    (c.stage, c.bucket, c.rows, c.config): c.throughput for c in (dp8, tp8)
  }


def test_a_layout_is_pruned_only_while_its_upper_bound_is_below_the_best_lower_bound():
  """At 256: dp4.tp2 300, dp2.tp4 250, tp8 40 tok/s/dev, each the median of 3 quiet calls; dp8
  nowhere. At 512 tp8's upper bound stays below dp4.tp2's lower bound: pruned; dp2.tp4 (1.2x
  slower, within the model's uncertainty at a bucket it was not measured at) is not."""
  quiet = (10.0, 10.1, 10.2)
  full = _complete(
    _profile(
      _cell('rollout', 256, DP4TP2, tgs=300.0, times=quiet),
      _cell('rollout', 256, DP2TP4, tgs=250.0, times=quiet),
      _cell('rollout', 256, TP8, tgs=40.0, times=quiet),
    )
  )

  def wanted(confidence, bucket=512, every=False):
    return cost_model.to_measure(
      full,
      Stage.ROLLOUT,
      bucket,
      R,
      budget=None,
      margin=0.0,
      confidence=confidence,
      every=every,
    )

  for name in ('dp4.tp2', 'dp2.tp4', 'dp1.tp8'):
    lower, upper = cost_model.bounds(full.cell(Stage.ROLLOUT, 512, R, name), 2.0)
    assert lower < full.cell(Stage.ROLLOUT, 512, R, name).throughput < upper
  best_lower = cost_model.bounds(full.cell(Stage.ROLLOUT, 512, R, 'dp4.tp2'), 2.0)[0]
  assert cost_model.bounds(full.cell(Stage.ROLLOUT, 512, R, 'dp1.tp8'), 2.0)[1] < best_lower
  assert 'dp1.tp8' not in wanted(2.0)
  assert {'dp4.tp2', 'dp2.tp4', 'dp8.tp1'} <= set(wanted(2.0))
  assert wanted(2.0)[0] == 'dp8.tp1'  # the most promising (highest upper bound) first
  assert set(wanted(0.0)) == {'dp8.tp1', 'dp4.tp2', 'dp2.tp4', 'dp1.tp8'}  # 0: no pruning
  assert set(wanted(2.0, every=True)) == set(wanted(0.0))  # the longest bucket: every layout
  assert wanted(2.0, bucket=256) == ['dp8.tp1']  # the measured ones are done


def test_measured_layouts_within_their_noise_of_the_best_are_timed_again():
  """At 256: dp4.tp2 300, dp2.tp4 270, dp8 200 tok/s/dev, each of 3 quiet calls (noise 5%: at
  confidence 2 the bounds are x e^-+0.1). dp2.tp4's upper bound (298) reaches dp4.tp2's lower
  bound (271): both are timed again, the fastest first; dp8 (244 at most) is not. Once each has
  been timed in `retimes` + 1 sessions it stands; with a cell far from every other, or one
  measured, none is wanted."""
  quiet = (10.0, 10.1, 10.2)

  def again(*cells, retimes=1):
    full = _complete(_profile(*cells))
    return cost_model.to_retime(full, Stage.ROLLOUT, 256, R, confidence=2.0, retimes=retimes)

  best = _cell('rollout', 256, DP4TP2, tgs=300.0, times=quiet)
  near = _cell('rollout', 256, DP2TP4, tgs=270.0, times=quiet)
  far = _cell('rollout', 256, DP8, tgs=200.0, times=quiet)
  assert again(best, near, far) == ['dp4.tp2', 'dp2.tp4']
  assert again(best, near, far, retimes=0) == []
  assert again(best, far) == [] and again(best) == []
  best2 = dataclasses.replace(best, sessions=2)
  assert again(best2, near, far) == ['dp2.tp4']  # the best has had its second session
  # A noisy cell's bounds are wider: 200 with calls spread by 40% reaches the best.
  noisy = _cell('rollout', 256, DP8, tgs=200.0, times=(8.0, 10.0, 12.0))
  assert again(best, noisy) == ['dp4.tp2', 'dp8.tp1']


def test_a_noisy_measurement_is_less_trusted_than_a_quiet_one():
  """The same median, but calls that spread by half: its bounds are wider, so it prunes less."""
  quiet = _cell('rollout', 256, DP8, tgs=100.0, times=(10.0, 10.0, 10.0))
  noisy = _cell('rollout', 256, DP8, tgs=100.0, times=(5.0, 10.0, 15.0))
  assert cost_model.noise(quiet) == cost_model.MIN_NOISE
  assert cost_model.noise(noisy) == pytest.approx(0.5)
  q = _complete(_profile(quiet)).cell(Stage.ROLLOUT, 256, R, DP8)
  n = _complete(_profile(noisy)).cell(Stage.ROLLOUT, 256, R, DP8)
  assert cost_model.bounds(n, 2.0)[0] < cost_model.bounds(q, 2.0)[0]
  assert math.isclose(n.throughput, q.throughput)


def test_memory_leaves_out_only_what_cannot_fit_even_within_the_models_error():
  full = _complete(_profile(_cell('rollout', 1024, DP2TP4, oom=True, peak=1 << 30)))
  need = {c.name: full.cell(Stage.ROLLOUT, 1024, R, c).peak_bytes for c in LAYOUTS}
  kw = {'margin': 0.0, 'confidence': 2.0}
  # A budget below dp8's analytic need but above its lower bound: XLA decides, so it is measured.
  budget = int(need['dp8.tp1'] * 0.95)
  assert cost_model.lower_need(need['dp8.tp1']) < budget
  names = cost_model.to_measure(full, Stage.ROLLOUT, 1024, R, budget=budget, **kw)
  assert 'dp8.tp1' in names
  assert 'dp2.tp4' not in names  # XLA measured it over the budget
  # A budget below even the lower bound: left out, never compiled.
  low = int(cost_model.lower_need(need['dp8.tp1']) * 0.9)
  assert 'dp8.tp1' not in cost_model.to_measure(full, Stage.ROLLOUT, 1024, R, budget=low, **kw)
  # The lower bound is the least XLA peak the stated error allows.
  n, lowest = need['dp8.tp1'], cost_model.lower_need(need['dp8.tp1'])

  def allowed(xla):
    return n - xla <= max(analytic.ANALYTIC_REL_ERROR * xla, analytic.ANALYTIC_ABS_ERROR) + 1e-6

  assert allowed(lowest) and not allowed(0.99 * lowest)
