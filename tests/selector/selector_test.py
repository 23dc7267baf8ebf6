"""The decision rule on a synthetic profile: statistic, feasibility, hysteresis, errors, records."""

import dataclasses
import itertools
import json

import numpy as np
import pytest

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.profiling import analytic
from earl_jax.profiling.table import Cell, Profile
from earl_jax.programs import memory
from earl_jax.programs.builders import StageSpec
from earl_jax.selector.selector import (
  DEFAULT_SHAPES,
  ProfileSettings,
  Selector,
  SelectorConfig,
  StageState,
  StepStats,
  context_statistic,
)
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage
from earl_jax.testing.typecheck import unchecked

MiB = memory.MiB
TABLE = BucketConfig(lengths=(1024, 2048, 4096, 8192))
DP8, DP2TP4, TP8 = ParallelConfig(dp=8), ParallelConfig(dp=2, tp=4), ParallelConfig(tp=8)

# Paper-like numbers: the low-tp layout is fastest at short context but holds the weights 8x
# (more memory), so it stops fitting first; tp8 is slowest at short context and fits everywhere.
#             bucket: (tgs, MiB) for dp8, dp2.tp4, tp8
_CELLS = {
  1024: ((300.0, 40), (250.0, 25), (200.0, 20)),
  2048: ((200.0, 60), (190.0, 45), (150.0, 40)),
  4096: ((100.0, 100), (110.0, 85), (120.0, 80)),
  8192: ((50.0, 180), (60.0, 165), (80.0, 160)),
}


def _profile(rows=(16, 64)) -> Profile:
  cells = {}
  for bucket, triples in _CELLS.items():
    for r in rows:
      for c, (tgs, mib) in zip((DP8, DP2TP4, TP8), triples):
        scale = r / rows[0]
        cells[(Stage.ROLLOUT, bucket, r, c.name)] = Cell(
          stage=Stage.ROLLOUT,
          config=c.name,
          bucket=bucket,
          rows=r,
          peak_bytes=int(mib * scale * MiB),
          oom=False,
          throughput=tgs,
        )
  key = {
    'stages': ['rollout'],
    'candidates': {'rollout': [DP8.name, DP2TP4.name, TP8.name]},
    'buckets': list(TABLE.lengths),
    'rows': list(rows),
  }
  return Profile(key=key, cells=cells)


def _selector(**kw) -> Selector:
  kw.setdefault('budget_mib', 170)
  kw.setdefault('safety_margin', 0.0)
  return Selector(SelectorConfig(**kw), buckets=TABLE, rows=(16, 64), profile=_profile())


def _stats(*lengths, n=16, free=None) -> StepStats:
  return StepStats(episode_lengths=lengths, num_responses=n, free_memory_bytes=free)


def test_fastest_feasible_per_bucket_and_the_record():
  sel = _selector()
  d = sel.decide(Stage.ROLLOUT, _stats(900, 1000))
  assert (d.config, d.bucket, d.run_bucket, d.rows) == (DP8, 1024, 1024, 16)
  assert d.throughput == 300.0 and not d.switched and d.previous is None
  assert 'first decision' in d.reason and 'bucket 1024' in d.reason
  d = sel.decide(Stage.ROLLOUT, _stats(3000, 4000))
  assert (d.config, d.bucket) == (TP8, 4096)
  assert d.switched and d.previous == DP8
  assert 'tp8 is 20% faster than dp8.tp1' in d.reason
  assert [x.config for x in sel.history] == [DP8, TP8]
  assert d.as_dict()['config'] == 'dp1.tp8'


def test_the_statistic_picks_the_ranking_row():
  lengths = (1000,) * 18 + (3000, 8000)  # mean 1450, p95 ~3250, max 8000
  assert context_statistic(lengths, 'mean') == pytest.approx(1450)
  assert 3000 < context_statistic(lengths, 'p95') < 8000
  for statistic, bucket in (('mean', 2048), ('p95', 4096), ('max', 8192)):
    d = _selector(statistic=statistic).decide(Stage.ROLLOUT, _stats(*lengths))
    assert d.bucket == bucket, statistic
    assert d.run_bucket == 8192  # memory is always checked where the longest episode runs
  with pytest.raises(ValueError, match='statistic must be one of'):
    context_statistic(lengths, 'median')


def test_memory_is_checked_at_the_longest_context_even_with_the_mean():
  # The mean reads bucket 1024 where dp8 is fastest, but the longest episode needs 8192, where
  # dp8 needs 180 MiB > 170: it would run out of memory mid-step, so it is not chosen. Of the two
  # that fit there, dp2.tp4 is the faster at 1024.
  d = _selector(statistic='mean').decide(Stage.ROLLOUT, _stats(*(500,) * 31, 8000))
  assert d.bucket == 1024 and d.run_bucket == 8192
  assert d.config == DP2TP4
  assert 'infeasible: dp8.tp1' in d.reason
  assert {o.config: o.feasible for o in d.options} == {
    'dp8.tp1': False,
    'dp2.tp4': True,
    'dp1.tp8': True,
  }


def test_safety_margin_and_free_memory():
  # 165 MiB (dp2.tp4 at 8192) fits 170 MiB bare, not with a 5% margin (173.25).
  bare = _selector().decide(Stage.ROLLOUT, _stats(3000, 8000, n=16))
  assert bare.config == TP8  # fastest anyway at 8192
  sel = _selector(safety_margin=0.05)
  d = sel.decide(Stage.ROLLOUT, _stats(8000, n=16))
  assert d.config == TP8
  assert [o.feasible for o in d.options] == [False, False, True]
  # Free memory below the budget shrinks it: at 2048 dp8 needs 60 MiB, so 50 MiB free rules it out.
  d = _selector().decide(Stage.ROLLOUT, _stats(1500, n=16, free=50 * MiB))
  assert d.config == DP2TP4 and d.budget_bytes == 50 * MiB
  assert 'free memory 50.0 MiB' in d.reason


def test_switch_threshold_keeps_a_near_tie():
  sel = _selector(switch_threshold=0.06, budget_mib=1000)
  assert sel.decide(Stage.ROLLOUT, _stats(1500)).config == DP8  # 200 vs 190 vs 150 at 2048
  d = sel.decide(Stage.ROLLOUT, _stats(1500))
  assert d.config == DP8 and not d.switched and 'kept dp8.tp1 (fastest feasible)' in d.reason
  # At 4096 tp8 (120) beats dp8 (100) by 20% > 6%: switch.
  d = sel.decide(Stage.ROLLOUT, _stats(3500))
  assert d.config == TP8 and d.switched
  # With a 20% band the same move keeps dp8 (100 >= 0.8 x 120).
  sel = _selector(switch_threshold=0.2, budget_mib=1000)
  sel.decide(Stage.ROLLOUT, _stats(1500))
  d = sel.decide(Stage.ROLLOUT, _stats(3500))
  assert d.config == DP8 and not d.switched
  assert 'kept dp8.tp1 (within 20% of best dp1.tp8' in d.reason


def test_hysteresis_never_flip_flops_around_a_bucket_boundary():
  sel = _selector(patience=3, budget_mib=1000)
  # The mean oscillates around 4096 (between the 4096 and 8192 rows): the bucket goes up at
  # once, and comes down only after three consecutive lower readings.
  readings = [3000, 5000, 4000, 5000, 4000, 5000, 4000, 4000, 4000, 4000]
  decisions = [sel.decide(Stage.ROLLOUT, _stats(n)) for n in readings]
  buckets = [d.bucket for d in decisions]
  assert buckets == [4096, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 4096, 4096]
  assert sum(d.switched for d in decisions) <= 1
  assert 'held bucket 8192' in decisions[2].reason and '1/3 lower readings' in decisions[2].reason
  # Each config change would need a bucket change, and those are monotone here: no A -> B -> A.
  configs = [d.config for d in decisions]
  changes = [i for i in range(1, len(configs)) if configs[i] != configs[i - 1]]
  for i, j in itertools.pairwise(changes):
    assert configs[j] != configs[i - 1] or j - i >= sel.config.patience


def test_load_bins_and_bad_inputs():
  sel = _selector()
  assert sel.decide(Stage.ROLLOUT, _stats(1000, n=20)).rows == 64
  with pytest.raises(ValueError, match='100 responses is more than the largest profiled load 64'):
    sel.decide(Stage.ROLLOUT, _stats(1000, n=100))
  with pytest.raises(ValueError, match=r'context too long.*9000.*largest bucket 8192'):
    sel.decide(Stage.ROLLOUT, _stats(1000, 9000))
  with unchecked(), pytest.raises(ValueError, match="Unknown stage 'decode'"):
    sel.decide('decode', _stats(1000))
  # The trainer checkpoints the statistics as JSON and rebuilds them.
  stats = StepStats(episode_lengths=[900, 1000], turn_lengths=[300, 300], num_responses=16)
  assert StepStats(**json.loads(json.dumps(dataclasses.asdict(stats)))) == stats
  with pytest.raises(ValueError, match='episode_lengths is empty'):
    StepStats(episode_lengths=(), num_responses=4)
  # (The runtime type checker of the tests rejects the Literal first; without it, __post_init__.)
  with pytest.raises((ValueError, TypeError), match='median'):
    SelectorConfig(statistic='median')
  with pytest.raises(ValueError, match='safety_margin must be in'):
    SelectorConfig(safety_margin=-0.1)
  with pytest.raises(ValueError, match='budget_mib must be positive'):
    SelectorConfig(budget_mib=0)
  with pytest.raises(ValueError, match="Cannot parse parallel config 'dp2xtp4'"):
    SelectorConfig(candidates=('dp2xtp4',))
  with pytest.raises(ValueError, match='differ from the profiled buckets'):
    Selector(SelectorConfig(), buckets=BucketConfig(lengths=(1024,)), rows=16, profile=_profile())


@pytest.mark.parametrize(
  'lengths,match',
  [((), 'is empty'), ((2048, 1024), 'strictly increasing.*did you mean \\(1024, 2048\\)')],
)
def test_bucket_table_must_be_sorted_and_non_empty(lengths, match):
  with pytest.raises(ValueError, match=match):
    BucketConfig(lengths=lengths)


def test_budget_too_small_names_the_smallest_need():
  sel = _selector(budget_mib=100, safety_margin=0.05)
  with pytest.raises(memory.InfeasibleError) as e:
    sel.decide(Stage.ROLLOUT, _stats(6000))
  msg = str(e.value)
  assert 'No rollout layout fits the per-device budget of 100.0 MiB at bucket 8192' in msg
  assert 'smallest need is dp1.tp8 with 160.0 MiB per device' in msg
  assert '168.0 MiB' in msg  # with the margin


def test_lookahead_names_the_neighbouring_buckets_best():
  sel = _selector(budget_mib=1000)
  d = sel.decide(Stage.ROLLOUT, _stats(1500))
  # 1500 is not near the next bucket up yet (not 3/4 of the way from 1024 to 2048): only the
  # bucket below, whose fastest is the current layout.
  assert sel.lookahead(d) == [(Stage.ROLLOUT, DP8, 2048, 16), (Stage.ROLLOUT, DP8, 1024, 16)]
  d = sel.decide(Stage.ROLLOUT, _stats(1800))
  # Near it: the next bucket's fastest (tp8), and the current layout there in case hysteresis
  # keeps it; the bucket below.
  assert sel.lookahead(d) == [
    (Stage.ROLLOUT, DP8, 2048, 16),
    (Stage.ROLLOUT, TP8, 4096, 16),
    (Stage.ROLLOUT, DP8, 4096, 16),
    (Stage.ROLLOUT, DP8, 1024, 16),
  ]
  d = sel.decide(Stage.ROLLOUT, _stats(8000))
  # No larger bucket; below, tp8 is the fastest too.
  assert sel.lookahead(d) == [(Stage.ROLLOUT, TP8, 8192, 16), (Stage.ROLLOUT, TP8, 4096, 16)]


def test_unprofiled_stages_use_the_analytic_model_and_the_state_round_trips():
  spec = StageSpec(chunk=1)  # one prompt token per rollout call: decode dominates its memory
  cfg = ModelConfig.preset('small-kv')
  table = BucketConfig(lengths=(128, 4096))
  need = {
    c: analytic.estimate(Stage.ROLLOUT, cfg, c, 4096, 8, chunk=spec.chunk).total
    for c in (DP8, ParallelConfig(dp=4, tp=2))
  }
  # Train holds the AdamW moments too: replicated 8 ways, it needs more at 128 tokens than the
  # rollout's dp4.tp2 at 4096. A budget between them fits neither dp8 program.
  train_dp8 = analytic.estimate(Stage.TRAIN, cfg, DP8, 128, 8).total
  fits = need[ParallelConfig(dp=4, tp=2)]
  assert fits < min(need[DP8], train_dp8)
  budget_mib = (fits + min(need[DP8], train_dp8)) / 2 / MiB
  # Nothing is compiled or measured: analytic memory, the fewest-splits preference.
  config = SelectorConfig(
    profile=ProfileSettings(stages=()), budget_mib=budget_mib, safety_margin=0.0
  )
  sel = Selector(config, model=cfg, buckets=table, rows=8, spec=spec)
  first = sel.initial_decisions()
  assert set(first) == {Stage.ROLLOUT, Stage.EXPERIENCE, Stage.TRAIN} and not sel.history
  assert first[Stage.ROLLOUT].config == DP8 and not first[Stage.ROLLOUT].measured
  assert sel.decide(Stage.ROLLOUT, None).config == DP8  # before any statistics: the initial context
  d = sel.decide(Stage.ROLLOUT, _stats(4000, n=8))
  assert d.config == ParallelConfig(dp=4, tp=2) and d.switched
  assert 'dp8.tp1 no longer fits' in d.reason and 'infeasible: dp8.tp1' in d.reason
  t = sel.decide(Stage.TRAIN, _stats(100, n=8))
  # The train program's AdamW moments do not fit dp4.tp2 either at this budget (its need is
  # above the rollout's dp8 need); the choice is a layout with more splits that fits.
  train_need = lambda c: analytic.estimate(Stage.TRAIN, cfg, c, 128, 8).total  # noqa: E731
  assert train_need(ParallelConfig(dp=4, tp=2)) > budget_mib * MiB
  assert 'infeasible: dp8.tp1' in t.reason and 'dp4.tp2' in t.reason
  assert t.config.tp * t.config.fsdp > 2 and train_need(t.config) <= budget_mib * MiB
  state = json.loads(json.dumps(sel.state_dict()))
  other = Selector(config, model=cfg, buckets=table, rows=8, spec=spec)
  other.load_state_dict(state)
  assert other.current(Stage.ROLLOUT) == d.config and other.current(Stage.TRAIN) == t.config
  log = json.loads(json.dumps(sel.log()))
  assert [x['config'] for x in log] == ['dp8.tp1', 'dp4.tp2', t.config.name]
  # Without the model, a stage the profile does not cover cannot be decided.
  with pytest.raises(ValueError, match="no ranking for 'train'"):
    _selector().decide(Stage.TRAIN, _stats(1000))


def _flip_backs(decisions):
  """(i, j) for every A -> B at decision i followed by B -> A at decision j."""
  out = []
  for i in range(1, len(decisions)):
    if decisions[i].config == decisions[i - 1].config:
      continue
    for j in range(i + 1, len(decisions)):
      if decisions[j].config != decisions[j - 1].config:
        if decisions[j].config == decisions[i - 1].config:
          out.append((i, j))
        break
  return out


@pytest.mark.parametrize('seed', range(6))
@pytest.mark.parametrize('patience', [1, 2, 4])
def test_the_layout_never_flips_back_within_patience(seed, patience):
  """Random and adversarial statistics: a layout that was left is never taken again within
  `patience` decisions, unless the current one stopped fitting. The adversary alternates the
  free memory at one bucket: dp8 (60 MiB at 2048) fits, then not, then again, so the fastest
  feasible layout flips every step."""
  rng = np.random.default_rng(seed)
  if seed % 2:
    lengths = rng.integers(500, 4096, 60)
    free = [None if rng.random() < 0.5 else int(rng.integers(82, 200)) * MiB for _ in lengths]
  else:
    lengths = [1500] * 60
    free = [50 * MiB if k % 2 else None for k in range(60)]
  sel = _selector(patience=patience, budget_mib=1000, switch_threshold=0.0)
  decisions = [sel.decide(Stage.ROLLOUT, _stats(int(n), free=f)) for n, f in zip(lengths, free)]
  for i, j in _flip_backs(decisions):
    forced = 'no longer fits' in decisions[j].reason
    assert forced or j - i > patience, (i, j, decisions[j].reason)
  if not seed % 2:  # the adversary is held off: dp8 comes back only every patience + 1 steps
    assert sum(d.switched for d in decisions) >= 60 // (patience + 1) - 1
    assert any('decisions since the last switch' in d.reason for d in decisions)
    back = [k for k in range(1, 60) if decisions[k].config == DP8 and decisions[k].switched]
    assert all(b - a >= patience + 1 for a, b in itertools.pairwise(back))


def test_a_layout_refused_at_compile_time_is_left_out_and_the_decision_retaken():
  sel = _selector(budget_mib=1000)
  stats = _stats(1500)
  d, state = sel.propose(Stage.ROLLOUT, stats)
  assert d.config == DP8 and not sel.history and state.decisions == 1
  sel.mark_infeasible(d, 'rollout/dp8.tp1/S2048 needs 99 MiB; the budget is 90 MiB')
  assert 'REFUSED: rollout/dp8.tp1/S2048 needs 99 MiB' in sel.history[0].reason
  assert sel.state(Stage.ROLLOUT) == StageState()  # the proposal was never committed
  again = sel.decide(Stage.ROLLOUT, stats)
  assert again.config == DP2TP4 and again.step == 0 and 'infeasible: dp8.tp1' in again.reason
  assert 'first decision' in again.reason
  assert [x.config for x in sel.history] == [DP8, DP2TP4]
  # From then on the refused layout is out at that bucket, even when it would be fastest...
  assert sel.decide(Stage.ROLLOUT, stats).config == DP2TP4
  # ... and not elsewhere.
  d = sel.decide(Stage.ROLLOUT, _stats(900))
  assert d.run_bucket == 1024 and all(o.feasible for o in d.options if o.config == 'dp8.tp1')
  state = json.loads(json.dumps(sel.state_dict()))
  other = _selector(budget_mib=1000)
  other.load_state_dict(state)
  assert other.decide(Stage.ROLLOUT, stats).config == DP2TP4
  for s in (sel, other):
    for d in list(s.history):
      if d.config == DP2TP4 and d.run_bucket == 2048:
        s.mark_infeasible(d, 'too big')
        break
  d = sel.decide(Stage.ROLLOUT, stats)
  assert d.config == TP8
  sel.mark_infeasible(d, 'too big')
  with pytest.raises(memory.InfeasibleError, match='XLA refused every candidate'):
    sel.decide(Stage.ROLLOUT, stats)


def test_a_switch_must_pay_for_itself():
  """dp8 -> tp8 at 4096 saves 20% of the stage's time; it is taken only when that saving over
  the expected steps in the bucket exceeds the switch's cost, and both numbers are logged."""
  costs = []

  def cost(stage, src, dst, bucket, rows):
    costs.append((stage, src, dst, bucket, rows))
    return cost.ms

  # 64000 tokens over 8 devices: 8000 / 100 tok/s = 80 s on dp8, 8000 / 120 = 66.7 s on tp8.
  stats = StepStats(episode_lengths=(3500,), num_responses=16, stage_tokens={'rollout': 64000})
  for ms, switched in ((1e9, False), (1e3, True)):
    cost.ms = ms
    sel = Selector(
      SelectorConfig(budget_mib=1000, safety_margin=0.0, patience=2),
      buckets=TABLE,
      rows=(16, 64),
      profile=_profile(),
      switch_cost=cost,
    )
    sel.decide(Stage.ROLLOUT, _stats(1500))
    d = sel.decide(Stage.ROLLOUT, stats)
    assert d.switched is switched and d.cost_ms == ms
    # Saved: (80 - 66.7) s per step x 2 expected steps (patience, before any bucket finished).
    assert d.gain_ms == pytest.approx(2 * 1e3 * (80 - 8000 / 120), rel=1e-6)
    assert f'switch costs {ms:.0f} ms' in d.reason and 'expected steps' in d.reason
    assert costs[-1] == (Stage.ROLLOUT, DP8, TP8, 4096, 16)
  # Without a token count the time saved is unknown: the faster layout wins as before.
  sel = Selector(
    SelectorConfig(budget_mib=1000, safety_margin=0.0),
    buckets=TABLE,
    rows=(16, 64),
    profile=_profile(),
    switch_cost=cost,
  )
  sel.decide(Stage.ROLLOUT, _stats(1500))
  d = sel.decide(Stage.ROLLOUT, _stats(3500))
  assert d.switched and d.gain_ms is None


def test_expected_steps_follow_the_runs_of_buckets():
  sel = _selector(budget_mib=1000, patience=3)
  assert sel.expected_steps(Stage.ROLLOUT) == 3.0  # before any run ends: patience
  for n in (900,) * 4 + (1500,) * 2 + (3500,):
    sel.decide(Stage.ROLLOUT, _stats(n))
  assert sel.expected_steps(Stage.ROLLOUT) == 3.0  # runs of 4 and 2 decisions


def test_a_lazy_profile_reports_each_missing_bucket_once_when_needed():
  """The selector measures nothing: it names the buckets a decision needs that its profile
  lacks; the caller measures them (here: copies them from the full profile) and hands them over."""
  full = _profile()
  measured = []

  def decide(sel, stats):
    while missing := sel.missing(Stage.ROLLOUT, stats):
      measured.append(missing[0])
      cells = {k: c for k, c in full.cells.items() if k[1] in set(measured)}
      sel.use_profile(Profile(key=full.key, cells=cells))
    return sel.decide(Stage.ROLLOUT, stats)

  sel = Selector(
    SelectorConfig(budget_mib=1000, profile=ProfileSettings(lazy=True)),
    buckets=TABLE,
    rows=(16, 64),
    profile=Profile(key=full.key, cells={}),
  )
  with pytest.raises(KeyError, match='no cell'):
    sel.decide(Stage.ROLLOUT, _stats(900, 1000))  # asked before measuring
  assert decide(sel, _stats(900, 1000)).config == DP8
  assert measured == [1024]
  decide(sel, _stats(900, 1000))
  # The statistic reads 2048 and the longest episode 4096: both are measured, once.
  d = decide(sel, StepStats(episode_lengths=(1500,) * 5 + (4000,), num_responses=16))
  assert measured == [1024, 2048, 4096] and (d.bucket, d.run_bucket) == (2048, 4096)
  # The lookahead does not measure: the unmeasured neighbour gets the current layout only.
  assert (Stage.ROLLOUT, d.config, 8192, 16) in sel.lookahead(d) and 8192 not in measured
  # An unprofiled stage never misses anything.
  assert sel.missing(Stage.TRAIN, _stats(900)) == []


def test_the_rule_is_pure_on_a_json_profile():
  """The rule from a profile read back from JSON alone: the same inputs give the same decision
  and the same next state, and neither the selector nor the state passed in changes."""
  profile = Profile.from_json(json.loads(json.dumps(_profile().to_json())))
  sel = Selector(
    SelectorConfig(budget_mib=1000, safety_margin=0.0, patience=2),
    buckets=TABLE,
    rows=(16, 64),
    profile=profile,
  )
  state = StageState(config=DP8, bucket=4096, decisions=3, since_switch=5, bucket_runs=(2, 4))
  before = (json.dumps(sel.state_dict()), sel.log(), dataclasses.asdict(state))
  stats = _stats(3500, 3600)
  first = sel.rule(Stage.ROLLOUT, state, stats, profile)
  second = sel.rule(Stage.ROLLOUT, state, stats, profile)
  assert first == second
  decision, after = first
  assert decision.config == TP8 and decision.switched and decision.step == 3
  assert after == StageState(
    config=TP8,
    bucket=4096,
    decisions=4,
    since_switch=0,
    bucket_steps=1,
    bucket_runs=(2, 4),
    top_bucket=4096,
  )
  assert (json.dumps(sel.state_dict()), sel.log(), dataclasses.asdict(state)) == before
  # A lower reading is counted in the returned state only.
  held, state2 = sel.rule(Stage.ROLLOUT, after, _stats(1500), profile)
  assert held.bucket == 4096 and state2.lower_readings == 1 and after.lower_readings == 0
  # Committing a proposal is what changes the selector, and it round-trips through JSON.
  sel.commit(decision, after)
  assert sel.state(Stage.ROLLOUT) == after and sel.history == [decision]
  other = Selector(sel.config, buckets=TABLE, rows=(16, 64), profile=profile)
  other.load_state_dict(json.loads(json.dumps(sel.state_dict())))
  assert other.state(Stage.ROLLOUT) == after


def test_the_default_analytic_shapes_are_those_of_a_default_stage_spec():
  spec = StageSpec()
  assert (DEFAULT_SHAPES.decode_tokens, DEFAULT_SHAPES.chunk, DEFAULT_SHAPES.micro_batches) == (
    spec.decode_tokens,
    spec.chunk,
    spec.micro_batches,
  )


def test_importing_the_selector_never_imports_the_programs():
  """The decision package stands on its own: `import earl_jax.selector` (a fresh interpreter)
  loads nothing of `earl_jax.programs`, the package that compiles and runs programs."""
  import subprocess
  import sys

  code = (
    'import sys, earl_jax.selector; '
    "print(sorted(m for m in sys.modules if m.startswith(('earl_jax.programs', 'earl_jax.models'))))"
  )
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == '[]', out.stdout


def test_a_decision_with_no_measured_cell_runs_on_the_model_and_says_so():
  """A lazy profile with the cost model: the first decision needs no measurement (every figure is
  the analytic model's); the cells it would rank by are named to measure (`wanted`), and the next
  bucket's ahead; once measured, the reason says which figures were measured, and the model's
  figure, uncertainty and basis of the others."""
  cfg = ModelConfig.preset('small-kv')
  table = BucketConfig(lengths=(128, 256, 512))
  empty = Profile(
    key={
      'stages': ['rollout'],
      'candidates': {'rollout': [DP8.name, DP2TP4.name, TP8.name]},
      'buckets': list(table.lengths),
      'rows': [16],
    },
    cells={},
  )
  settings = ProfileSettings(stages=('rollout',), lazy=True, confidence=2.0, settle=1)
  sel = Selector(SelectorConfig(profile=settings), buckets=table, rows=16, profile=empty, model=cfg)
  d = sel.decide(Stage.ROLLOUT, None)
  assert not d.measured and all(not o.measured and o.prior == 'analytic' for o in d.options)
  assert 'measured: none; model: dp8.tp1 (' in d.reason and '+-500%, analytic)' in d.reason
  assert d.uncertainty >= 1.0 and d.basis == 'analytic'
  # Nothing measured yet: the analytic figures are nominal, so none is pruned.
  assert sorted(c[2] for c in sel.wanted(Stage.ROLLOUT, None)) == ['dp1.tp8', 'dp2.tp4', 'dp8.tp1']
  assert [c[0] for c in sel.wanted(Stage.ROLLOUT, None, ahead=True)] == [256] * 3
  assert sel.wanted(Stage.TRAIN, None) == []  # a stage ranked by the analytic model
  # Measured at 128: tp8 is 3x slower than dp2.tp4 and dp8 was not timed (say, over the share).
  cells = {
    (Stage.ROLLOUT, 128, 16, c.name): Cell(
      stage=Stage.ROLLOUT,
      config=c.name,
      bucket=128,
      rows=16,
      peak_bytes=MiB,
      oom=False,
      throughput=tgs,
      times_ms=(1.0, 1.0, 1.0),
    )
    for c, tgs in ((DP2TP4, 300.0), (TP8, 100.0))
  }
  sel.use_profile(Profile(key=empty.key, cells=cells))
  d = sel.decide(Stage.ROLLOUT, _stats(100))
  # dp8, measured nowhere, ranks by the model's lower bound: below dp2.tp4's measurement. It
  # runs, known only from the others' cells beyond a factor e: kept until it is measured.
  dp8 = next(o for o in d.options if o.config == DP8.name)
  assert dp8.score == pytest.approx(dp8.throughput * np.exp(-2.0 * dp8.uncertainty))
  assert d.config == DP8 and not d.measured and 'kept dp8.tp1: measured nowhere near' in d.reason
  assert 'measured: dp2.tp4, dp1.tp8; model: dp8.tp1 (' in d.reason and ', stage)' in d.reason
  assert sel.wanted(Stage.ROLLOUT, _stats(100)) == [(128, 16, 'dp8.tp1')]
  # Measured there at 200, below dp2.tp4's 300: the switch.
  cells[(Stage.ROLLOUT, 128, 16, DP8.name)] = dataclasses.replace(
    cells[(Stage.ROLLOUT, 128, 16, DP2TP4.name)], config=DP8.name, throughput=200.0
  )
  sel.use_profile(Profile(key=empty.key, cells=cells))
  d = sel.decide(Stage.ROLLOUT, _stats(100))
  assert d.config == DP2TP4 and d.measured and d.uncertainty == pytest.approx(0.05)
  assert d.switched and 'dp2.tp4 is 50% faster than dp8.tp1' in d.reason, d.reason
  # At 256, ahead: tp8's upper bound (from its own cell at 128) is below dp2.tp4's lower bound.
  ahead = sel.wanted(Stage.ROLLOUT, _stats(100), ahead=True)
  assert {c[2] for c in ahead} == {'dp2.tp4', 'dp8.tp1'} and {c[0] for c in ahead} == {256}
  # Ahead only once the longest context has come 3/4 of the way up its bucket (96 of 0-128).
  assert sel.wanted(Stage.ROLLOUT, _stats(95), ahead=True) == []
  # At 256, nothing measured yet: the decision runs on the model fitted at 128, and says so.
  d = sel.decide(Stage.ROLLOUT, _stats(200))
  assert d.config == DP2TP4 and not d.measured and d.basis == 'dp2.tp4@128'
  assert 'dp2.tp4 (' in d.reason and ', dp2.tp4@128)' in d.reason
  # Once it stays there (`settle`, 1 decision here), the longest bucket reached wants every
  # layout, tp8 included.
  assert {c[2] for c in sel.wanted(Stage.ROLLOUT, _stats(200))} == {
    'dp8.tp1',
    'dp2.tp4',
    'dp1.tp8',
  }
  # What could beat the best there: tp8, which the bounds rank below, left out.
  assert {c[2] for c in sel.wanted(Stage.ROLLOUT, _stats(200), contenders=True)} == {
    'dp8.tp1',
    'dp2.tp4',
  }


# A rollout profile of dp8 and dp2.tp4 at buckets 128 and 256, and a cell of it timed 3 times.
_TWO_LAYOUTS = {
  'stages': ['rollout'],
  'candidates': {'rollout': [DP8.name, DP2TP4.name]},
  'buckets': [128, 256],
  'rows': [16],
}


def _timed_cell(config: ParallelConfig, bucket: int, tgs: float, **kw) -> Cell:
  return Cell(
    stage=Stage.ROLLOUT,
    config=config.name,
    bucket=bucket,
    rows=16,
    peak_bytes=MiB,
    oom=False,
    throughput=tgs,
    times_ms=(1.0, 1.0, 1.0),
    **kw,
  )


def test_the_current_layout_is_weighed_at_its_figure_where_the_model_fitted_it():
  """At 256, dp2.tp4 runs on the model fitted to its own cell at 128 (uncertain: a figure F with
  a wide lower bound). A measurement of dp8 there beats that lower bound but not F by the switch
  threshold: dp2.tp4 is kept (a layout is not left on the model's caution alone); one that beats
  F by more wins."""
  cfg = ModelConfig.preset('small-kv')
  table, key, cell = BucketConfig(lengths=(128, 256)), _TWO_LAYOUTS, _timed_cell
  at128 = {
    (Stage.ROLLOUT, 128, 16, c.name): cell(c, 128, t) for c, t in ((DP8, 100.0), (DP2TP4, 300.0))
  }
  settings = ProfileSettings(stages=('rollout',), lazy=True, confidence=2.0)
  sel = Selector(
    SelectorConfig(profile=settings, switch_threshold=0.1),
    buckets=table,
    rows=16,
    profile=Profile(key=key, cells=at128),
    model=cfg,
  )
  assert sel.decide(Stage.ROLLOUT, _stats(100)).config == DP2TP4
  d = sel.decide(Stage.ROLLOUT, _stats(200))
  assert d.config == DP2TP4 and d.basis == 'dp2.tp4@128' and d.uncertainty > 0.2
  figure = d.throughput
  lower = figure * np.exp(-2.0 * d.uncertainty)
  for dp8, kept in ((1.05 * figure, True), (2.0 * figure, False)):
    assert dp8 > lower
    cells = {**at128, (Stage.ROLLOUT, 256, 16, DP8.name): cell(DP8, 256, dp8)}
    sel.use_profile(Profile(key=key, cells=cells))
    decision, _ = sel.propose(Stage.ROLLOUT, _stats(200))
    assert (decision.config == DP2TP4) == kept, decision.reason
    held = next(o for o in decision.options if o.config == DP2TP4.name)
    assert not held.measured and held.score < dp8  # its lower bound alone would have switched
  assert 'faster than dp2.tp4' in decision.reason and '(lower bound)' not in decision.reason


def test_where_nothing_is_measured_the_current_layout_and_the_best_are_weighed_alike():
  """At a bucket with no measured cell the layouts rank by the model's figures, and the current
  one is weighed against the best at those figures too, not the best at its lower bound: dp2.tp4,
  30% faster by the model at 256, replaces dp8 there."""
  cfg = ModelConfig.preset('small-kv')

  def modelled(config, tgs):
    cell = _timed_cell(config, 256, tgs, uncertainty=0.3, prior=f'{config.name}@128')
    return dataclasses.replace(cell, measured=False, times_ms=())

  cells = {
    (Stage.ROLLOUT, 128, 16, DP8.name): _timed_cell(DP8, 128, 300.0),
    (Stage.ROLLOUT, 128, 16, DP2TP4.name): _timed_cell(DP2TP4, 128, 290.0),
    (Stage.ROLLOUT, 256, 16, DP8.name): modelled(DP8, 100.0),
    (Stage.ROLLOUT, 256, 16, DP2TP4.name): modelled(DP2TP4, 130.0),
  }
  sel = Selector(
    SelectorConfig(profile=ProfileSettings(stages=('rollout',), lazy=True), switch_threshold=0.03),
    buckets=BucketConfig(lengths=(128, 256)),
    rows=16,
    profile=Profile(key=_TWO_LAYOUTS, cells=cells),
    model=cfg,
  )
  assert sel.decide(Stage.ROLLOUT, _stats(100)).config == DP8
  d, _ = sel.propose(Stage.ROLLOUT, _stats(200))
  assert not any(o.measured for o in d.options)
  assert d.config == DP2TP4, d.reason
  assert 'dp2.tp4 is 30% faster than dp8.tp1 (130.0 vs 100.0 tok/s/dev)' in d.reason


def test_a_layout_measured_at_one_bucket_is_wanted_at_a_second():
  """`wanted(second=True)`: a layout measured at one bucket only is wanted at the shortest
  bucket the stage has decided at; one measured at two, or at that bucket, is not."""
  cfg = ModelConfig.preset('small-kv')
  cells = {
    (Stage.ROLLOUT, 256, 16, DP8.name): _timed_cell(DP8, 256, 100.0),
    (Stage.ROLLOUT, 128, 16, DP8.name): _timed_cell(DP8, 128, 150.0),
    (Stage.ROLLOUT, 256, 16, DP2TP4.name): _timed_cell(DP2TP4, 256, 90.0),
  }
  settings = ProfileSettings(stages=('rollout',), lazy=True)
  sel = Selector(
    SelectorConfig(profile=settings),
    buckets=BucketConfig(lengths=(128, 256)),
    rows=16,
    profile=Profile(key=_TWO_LAYOUTS, cells=cells),
    model=cfg,
  )
  assert sel.wanted(Stage.ROLLOUT, None, second=True) == []  # nothing decided yet
  sel.decide(Stage.ROLLOUT, _stats(200))
  assert sel.wanted(Stage.ROLLOUT, _stats(200), second=True) == []  # 256 is all it decided at
  sel.decide(Stage.ROLLOUT, _stats(100))
  sel.decide(Stage.ROLLOUT, _stats(100))  # the bucket moves down after 2 lower readings
  assert sel.wanted(Stage.ROLLOUT, _stats(100), second=True) == [(128, 16, DP2TP4.name)]
  measured = {**cells, (Stage.ROLLOUT, 128, 16, DP2TP4.name): _timed_cell(DP2TP4, 128, 120.0)}
  sel.use_profile(Profile(key=_TWO_LAYOUTS, cells=measured))
  assert sel.wanted(Stage.ROLLOUT, _stats(100), second=True) == []


def test_no_switch_to_a_layout_the_model_alone_rates_within_its_uncertainty():
  """Held on dp2.tp4 (measured: 100), the model rates dp8, measured nowhere, at 120 +-50%: its
  lower bound (120 / e) does not beat 100, so the selector keeps dp2.tp4; measured at 150, dp8
  wins and the selector switches. With `confidence` 0 the model's figure alone would switch."""
  table, key, cell = BucketConfig(lengths=(128, 256)), _TWO_LAYOUTS, _timed_cell

  def profile(dp8: Cell) -> Profile:
    cells = {}
    for b in table.lengths:
      cells[(Stage.ROLLOUT, b, 16, DP2TP4.name)] = cell(DP2TP4, b, 100.0, uncertainty=0.05)
      cells[(Stage.ROLLOUT, b, 16, DP8.name)] = dataclasses.replace(dp8, bucket=b)
    return Profile(key=key, cells=cells)

  modelled = cell(DP8, 128, 120.0, measured=False, prior='stage', uncertainty=0.5)
  for confidence, switches in ((2.0, False), (0.0, True)):
    settings = ProfileSettings(stages=('rollout',), lazy=True, confidence=confidence)
    sel = Selector(
      SelectorConfig(profile=settings, patience=1, initial_context=100),
      buckets=table,
      rows=16,
      profile=profile(cell(DP8, 128, 90.0)),  # dp8 measured slower at first: dp2.tp4 is chosen
    )
    assert sel.decide(Stage.ROLLOUT, _stats(100)).config == DP2TP4
    sel.use_profile(profile(modelled))  # say the measurement was withdrawn as cold
    d = sel.decide(Stage.ROLLOUT, _stats(100))
    assert d.switched == switches, d.reason
    if not switches:
      assert d.config == DP2TP4 and 'kept dp2.tp4 (fastest feasible)' in d.reason
      assert next(o for o in d.options if o.config == DP8.name).score == pytest.approx(120 / np.e)
      sel.use_profile(profile(cell(DP8, 128, 150.0)))
      d = sel.decide(Stage.ROLLOUT, _stats(100))
      assert d.config == DP8 and d.switched and d.measured


@pytest.mark.parametrize('stage', [Stage.EXPERIENCE, Stage.TRAIN])
def test_context_parallelism_is_chosen_exactly_where_nothing_else_fits(stage):
  """One group of 4 responses on 8 devices: no layout without CP splits a row, so past some
  bucket every one of them is over budget; a CP layout (each row over a ring of devices) fits
  there and is chosen, and below it a layout without CP is. Without CP candidates the same
  decision is refused, naming the smallest need. (The rollout's K/V cache splits over tp as
  well as over cp up to the model's 4 KV heads, so there CP adds a layout only past them:
  `candidates_test`.)"""
  cfg, table, rows = ModelConfig.preset('tiny-game'), BucketConfig(lengths=(1024, 8192)), 4
  lay = {
    cp: [
      c
      for c in mesh_lib.factorizations(8, with_fsdp=False, with_cp=True)
      if (c.cp > 1) == cp and rows % c.batch_shards == 0 and cfg.num_kv_heads % c.tp == 0
    ]
    for cp in (False, True)
  }
  need = lambda c, t: analytic.estimate(stage, cfg, c, t, rows, chunk=16).total  # noqa: E731
  flat, ring = (min(need(c, 8192) for c in lay[cp]) for cp in (False, True))
  assert ring < flat and max(need(c, 1024) for c in lay[False]) < (ring + flat) / 2
  config = SelectorConfig(
    profile=ProfileSettings(stages=()),
    budget_mib=(ring + flat) / 2 / MiB,
    safety_margin=0.0,
    with_fsdp=False,
  )
  sel = Selector(config, model=cfg, buckets=table, rows=rows, spec=StageSpec(chunk=16))
  short = sel.decide(stage, _stats(900, n=rows))
  assert short.config.cp == 1 and short.bucket == 1024
  long = sel.decide(stage, _stats(8000, n=rows))
  assert long.config.cp > 1 and long.bucket == 8192 and need(long.config, 8192) <= ring * 1.5
  refused = long.reason.split('infeasible: ')[1].split(', ')
  assert {c.name for c in lay[False]} <= set(refused) and long.config.name not in refused
  without = Selector(
    dataclasses.replace(config, with_cp=False),
    model=cfg,
    buckets=table,
    rows=rows,
    spec=StageSpec(chunk=16),
  )
  without.decide(stage, _stats(900, n=rows))
  with pytest.raises(memory.InfeasibleError, match='8192'):
    without.decide(stage, _stats(8000, n=rows))


def test_a_current_layout_the_model_knows_only_from_the_others_is_weighed_at_its_figure():
  """Held on dp2.tp4, whose figure at 128 is then the model's from the other layouts alone
  (prior 'stage', 120 +-50%): dp8 measured at 110 beats its lower bound (120 / e) but not its
  figure, so dp2.tp4 is kept (a layout is not left because another was measured first there);
  dp8 measured at 150 replaces it."""
  table, key, cell = BucketConfig(lengths=(128, 256)), _TWO_LAYOUTS, _timed_cell
  first = {
    (Stage.ROLLOUT, 128, 16, DP2TP4.name): cell(DP2TP4, 128, 100.0),
    (Stage.ROLLOUT, 128, 16, DP8.name): cell(DP8, 128, 90.0),
  }
  settings = ProfileSettings(stages=('rollout',), lazy=True, confidence=2.0)
  for dp8, switches in ((110.0, False), (150.0, True)):
    sel = Selector(
      SelectorConfig(profile=settings, patience=1, initial_context=100),
      buckets=table,
      rows=16,
      profile=Profile(key=key, cells=first),
    )
    assert sel.decide(Stage.ROLLOUT, _stats(100)).config == DP2TP4
    modelled = cell(DP2TP4, 128, 120.0, measured=False, prior='stage', uncertainty=0.5)
    cells = {
      (Stage.ROLLOUT, 128, 16, DP2TP4.name): modelled,  # say its measurement was withdrawn
      (Stage.ROLLOUT, 128, 16, DP8.name): cell(DP8, 128, dp8),
    }
    sel.use_profile(Profile(key=key, cells=cells))
    d = sel.decide(Stage.ROLLOUT, _stats(100))
    assert d.switched == switches, d.reason
    held = next(o for o in d.options if o.config == DP2TP4.name)
    assert held.score == pytest.approx(120 / np.e) and held.score < dp8
    if not switches:
      assert 'kept dp2.tp4 (within' in d.reason and '120.0' in d.reason, d.reason


def test_a_current_layout_the_model_barely_knows_is_kept_until_it_is_measured():
  """Held on dp2.tp4, known at 128 only from the other layouts' cells and beyond a factor e
  (prior 'stage', 120 +-200%): dp8, measured at 150 there, is not weighed against a guess; the
  layout is kept, the reason says so, and once it is measured (at 100) dp8 replaces it."""
  table, key, cell = BucketConfig(lengths=(128, 256)), _TWO_LAYOUTS, _timed_cell
  settings = ProfileSettings(stages=('rollout',), lazy=True, confidence=2.0)
  sel = Selector(
    SelectorConfig(profile=settings, patience=1, initial_context=100),
    buckets=table,
    rows=16,
    profile=Profile(
      key=key,
      cells={
        (Stage.ROLLOUT, 128, 16, DP2TP4.name): cell(DP2TP4, 128, 100.0),
        (Stage.ROLLOUT, 128, 16, DP8.name): cell(DP8, 128, 90.0),
      },
    ),
  )
  assert sel.decide(Stage.ROLLOUT, _stats(100)).config == DP2TP4
  unknown = cell(DP2TP4, 128, 120.0, measured=False, prior='stage', uncertainty=2.0)
  cells = {
    (Stage.ROLLOUT, 128, 16, DP2TP4.name): unknown,  # say its measurement was withdrawn
    (Stage.ROLLOUT, 128, 16, DP8.name): cell(DP8, 128, 150.0),
  }
  sel.use_profile(Profile(key=key, cells=cells))
  d = sel.decide(Stage.ROLLOUT, _stats(100))
  assert d.config == DP2TP4 and not d.switched
  assert 'kept dp2.tp4: measured nowhere near here (the model: 120.0+-200%, stage)' in d.reason
  assert 'dp8.tp1 is weighed against it once it is' in d.reason
  cells[(Stage.ROLLOUT, 128, 16, DP2TP4.name)] = cell(DP2TP4, 128, 100.0)
  sel.use_profile(Profile(key=key, cells=cells))
  d = sel.decide(Stage.ROLLOUT, _stats(100))
  assert d.config == DP8 and d.switched, d.reason


def test_lookahead_leaves_out_a_neighbours_best_the_model_knows_only_from_the_others(monkeypatch):
  """At 256, the neighbour of a decision at 128 (near its top), the fastest by the model is a
  layout measured nowhere (tp8, by the stage's curve: a guess): not precompiled; once measured
  there, it is."""
  cfg = ModelConfig.preset('small-kv')
  table = BucketConfig(lengths=(128, 256, 512))
  key = {
    'stages': ['rollout'],
    'candidates': {'rollout': [DP8.name, TP8.name]},
    'buckets': list(table.lengths),
    'rows': [16],
  }

  def cell(config, bucket, tgs):
    return Cell(stage=Stage.ROLLOUT, config=config.name, bucket=bucket, rows=16, peak_bytes=MiB,
                oom=False, throughput=tgs, times_ms=(1.0, 1.0, 1.0))  # fmt: skip

  settings = ProfileSettings(stages=('rollout',), lazy=True, confidence=2.0)
  measured = {(Stage.ROLLOUT, 128, 16, DP8.name): cell(DP8, 128, 200.0)}
  profile = Profile(key=key, cells=measured)
  sel = Selector(
    SelectorConfig(profile=settings), buckets=table, rows=16, profile=profile, model=cfg
  )
  d = sel.decide(Stage.ROLLOUT, _stats(120))
  assert d.config == DP8 and d.run_bucket == 128
  monkeypatch.setattr(sel, 'best_for', lambda stage, bucket, rows: TP8)
  assert sel.profile(Stage.ROLLOUT).cell(Stage.ROLLOUT, 256, 16, TP8.name).prior == 'stage'
  assert sel.lookahead(d) == [(Stage.ROLLOUT, DP8, 128, 16), (Stage.ROLLOUT, DP8, 256, 16)]
  measured[(Stage.ROLLOUT, 256, 16, TP8.name)] = cell(TP8, 256, 400.0)
  sel.use_profile(Profile(key=key, cells=measured))
  assert sel.lookahead(d) == [
    (Stage.ROLLOUT, DP8, 128, 16),
    (Stage.ROLLOUT, TP8, 256, 16),
    (Stage.ROLLOUT, DP8, 256, 16),
  ]
