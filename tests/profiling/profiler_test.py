"""Measuring the profile: measured cells, OOM cells, the JSON cache and its key, and the selector
on top."""

import dataclasses
import json

import pytest
from absl import logging

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.profiling import profiler
from earl_jax.profiling.table import Cell, MeasureConfig, Profile, load_cached
from earl_jax.programs import builders, memory
from earl_jax.programs.executables import Executables
from earl_jax.rollout.sampler import SamplingConfig
from earl_jax.selector.candidates import stage_candidates
from earl_jax.selector.selector import Selector, SelectorConfig, StepStats
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage

CFG = ModelConfig.preset('tiny')
SPEC = builders.StageSpec(sampling=SamplingConfig(max_new_tokens=4))
TABLE = BucketConfig(lengths=(32, 2048))  # K/V dominates the memory at 2048
DP8, DP2TP4 = ParallelConfig(dp=8), ParallelConfig(dp=2, tp=4)
DP2CP4 = ParallelConfig(dp=2, cp=4)
MiB = memory.MiB


def _read(path):
  with open(path) as f:
    return json.load(f)


def _write(path, text):
  with open(path, 'w') as f:
    f.write(text)


def _config(budget: int, **kw) -> profiler.ProfileGrid:
  return profiler.ProfileGrid(
    stages=(Stage.ROLLOUT,),
    buckets=TABLE,
    rows=(8,),
    budget_bytes=budget,
    candidates=(DP8, DP2TP4),
    measure=MeasureConfig(warmup=1, repeats=3, rounds=1),
    spec=SPEC,
    **kw,
  )


@pytest.fixture(scope='module')
def exe():
  with Executables(CFG, spec=SPEC) as e:
    yield e


@pytest.fixture(scope='module')
def budget(exe):
  """Between dp2.tp4's and dp8's peak at the longest bucket: dp8 is OOM there, nothing else."""
  need = {c: exe.get(exe.key(Stage.ROLLOUT, c, 2048, 8)).memory.peak for c in (DP8, DP2TP4)}
  assert need[DP2TP4] < need[DP8]
  assert exe.get(exe.key(Stage.ROLLOUT, DP8, 32, 8)).memory.peak < need[DP2TP4]
  exe.get(exe.key(Stage.ROLLOUT, DP2TP4, 32, 8))
  return (need[DP8] + need[DP2TP4]) // 2


def test_profile_measures_feasible_cells_and_marks_oom(exe, budget, tmp_path):
  path = str(tmp_path / 'profile.json')
  compiles = exe.compiles
  prof = profiler.run(CFG, _config(budget), executables=exe, cache_path=path)
  assert exe.compiles == compiles  # every executable came from the cache
  assert len(prof.cells) == 4
  oom = prof.cell(Stage.ROLLOUT, 2048, 8, DP8)
  assert oom.oom and oom.throughput is None and oom.peak_bytes > budget and not oom.times_ms
  for bucket, c in ((32, DP8), (32, DP2TP4), (2048, DP2TP4)):
    cell = prof.cell(Stage.ROLLOUT, bucket, 8, c)
    assert not cell.oom and cell.throughput > 0 and len(cell.times_ms) == 3
    # Throughput is decoded tokens per device per second from the median call.
    median_s = sorted(cell.times_ms)[1] / 1e3
    assert cell.throughput == pytest.approx(8 * 4 / median_s / 8)
  assert prof.best(Stage.ROLLOUT, 2048, 8).config == 'dp2.tp4'
  saved = _read(path)
  assert saved['key']['hardware']['platform'] == 'cpu'
  assert saved['key']['candidates'] == {'rollout': ['dp8.tp1', 'dp2.tp4']}

  # Same setup: reused as is, nothing measured again.
  again = profiler.run(CFG, _config(budget), executables=exe, cache_path=path)
  assert again.wall_s == prof.wall_s and again.cells == prof.cells

  # The selector on top: the faster one at 32, dp2.tp4 when the longest context needs 2048.
  sel = Selector(
    SelectorConfig(budget_mib=budget / MiB, safety_margin=0.0),
    buckets=TABLE,
    rows=8,
    profile=prof,
    model=CFG,
  )
  short = sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=(20, 30), num_responses=8))
  assert short.config.name == prof.best(Stage.ROLLOUT, 32, 8).config
  long = sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=(20, 1500), num_responses=8))
  assert long.config == DP2TP4 and 'infeasible: dp8.tp1' in long.reason


def test_a_cache_from_another_setup_is_rebuilt(exe, budget, tmp_path, monkeypatch):
  path = str(tmp_path / 'profile.json')
  prof = profiler.run(CFG, _config(budget), executables=exe, cache_path=path)
  warnings = []
  monkeypatch.setattr(logging, 'warning', lambda msg, *a: warnings.append(msg % a))
  # Another machine: the file claims an H100.
  data = _read(path)
  data['key']['hardware']['device_kind'] = 'NVIDIA H100 80GB HBM3'
  data['cells'][0]['throughput'] = 1e9  # a poisoned number that must not be trusted
  _write(path, json.dumps(data))
  rebuilt = profiler.run(CFG, _config(budget), executables=exe, cache_path=path)
  assert rebuilt.wall_s != prof.wall_s
  assert max(c.throughput or 0 for c in rebuilt.cells.values()) < 1e9
  assert 'made for another setup (differs in' in warnings[-1]
  assert 'hardware.{device_kind}' in warnings[-1]
  assert _read(path)['key']['hardware']['device_kind'] == 'cpu'
  # Another model: the key differs in the model's fields, so the file is not loaded.
  other = CFG.replace(name='tiny-wide', intermediate_size=256)
  cands = {Stage.ROLLOUT: stage_candidates(Stage.ROLLOUT, other, num_devices=8, only=(DP8, DP2TP4))}
  key = profiler.profile_key(other, _config(budget), cands)
  assert load_cached(path, key) is None
  assert 'model.{intermediate_size, name}' in warnings[-1]
  # A corrupt file is rebuilt too.
  _write(path, '{not json')
  assert load_cached(path, key) is None
  assert 'unreadable' in warnings[-1]


def test_a_budget_below_every_layout_names_the_smallest_need(exe, budget):
  tiny_budget = exe.get(exe.key(Stage.ROLLOUT, DP2TP4, 32, 8)).memory.peak // 2
  prof = profiler.run(CFG, _config(tiny_budget), executables=exe)
  assert all(c.oom for c in prof.cells.values())
  sel = Selector(
    SelectorConfig(budget_mib=tiny_budget / MiB), buckets=TABLE, rows=8, profile=prof, model=CFG
  )
  need = exe.get(exe.key(Stage.ROLLOUT, DP2TP4, 32, 8)).memory.peak
  with pytest.raises(
    memory.InfeasibleError, match=rf'smallest need is dp2\.tp4 with {need / MiB:.1f} MiB'
  ):
    sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=(30,), num_responses=8))


def test_experience_and_train_are_profiled_in_tokens_per_second(exe):
  """Every layout of the two stages is measured, the context-parallel one (ring attention over
  4 devices) included."""
  config = dataclasses.replace(
    _config(None),
    stages=(Stage.EXPERIENCE, Stage.TRAIN),
    buckets=BucketConfig(lengths=(32,)),
    measure=MeasureConfig(repeats=3, rounds=1),
    candidates=(DP8, DP2TP4, DP2CP4),
    with_cp=True,
  )
  prof = profiler.run(CFG, config, executables=exe)
  assert len(prof.cells) == 6
  for stage in (Stage.EXPERIENCE, Stage.TRAIN):
    for c in (DP8, DP2TP4, DP2CP4):
      cell = prof.cell(stage, 32, 8, c)
      assert not cell.oom and cell.measured and cell.peak_bytes > 0
      # Every one of the rows x bucket tokens counts, per device and second.
      median_s = sorted(cell.times_ms)[1] / 1e3
      assert cell.throughput == pytest.approx(8 * 32 / median_s / 8)
  # The train step holds the AdamW moments: more memory than the log-prob forward.
  train, experience = (prof.cell(s, 32, 8, DP8) for s in (Stage.TRAIN, Stage.EXPERIENCE))
  assert train.peak_bytes > experience.peak_bytes


class _FakeProgram:
  """A program whose calls advance a fake clock: `slow` calls (the first ones) take 100x longer."""

  key = type('Key', (), {'stage': Stage.EXPERIENCE})

  def __init__(self, clock: list[float], slow: int):
    self.clock, self.slow, self.calls = clock, slow, 0

  def __call__(self, *args):
    self.clock[0] += 10.0 if self.calls < self.slow else 0.1
    self.calls += 1
    return args


@pytest.mark.parametrize('cold', [1, 2])
def test_a_cold_call_cannot_decide_a_figure(monkeypatch, cold):
  """A figure is the median of at least 3 timed calls after a warm-up: one cold call (the
  warm-up) or two (the warm-up and the first timed one) leave it at the warm time, 100 ms."""
  clock = [0.0]
  monkeypatch.setattr(profiler.time, 'perf_counter', lambda: clock[0])
  program = _FakeProgram(clock, slow=cold)
  settings = MeasureConfig()  # the default: 1 warm-up, 3 timed calls
  times, _ = profiler.measure(program, (0,), warmup=settings.warmup, repeats=settings.repeats)
  assert program.calls == 4 and len(times) == 3
  assert sorted(times)[1] == pytest.approx(100.0)  # ms: the warm call, not the cold one
  with pytest.raises(ValueError, match='median of at least 3 timed calls'):
    MeasureConfig(repeats=1, rounds=2)


def test_profile_config_validation():
  with pytest.raises(ValueError, match='rows must be strictly increasing'):
    _config(MiB).__class__(buckets=TABLE, rows=(16, 8), budget_bytes=MiB)
  with pytest.raises(ValueError, match='warmup must be >= 1'):
    MeasureConfig(warmup=0)
  with pytest.raises(ValueError, match="Unknown stage 'decode'"):
    dataclasses.replace(_config(MiB), stages=('decode',))
  with pytest.raises(mesh_lib.ShardingError, match='num_kv_heads'):
    profiler.default_candidates(
      CFG, dataclasses.replace(_config(MiB), candidates=(ParallelConfig(tp=8),))
    )


def test_the_cache_key_holds_only_what_shapes_the_programs():
  """A rate or a coefficient's value leaves the measured programs as they are, so it keeps the
  cached profile; turning a KL term on adds the reference log-probs, so it does not."""
  from earl_jax.rl import losses
  from earl_jax.rl import train_step as train_lib

  cands = {Stage.ROLLOUT: stage_candidates(Stage.ROLLOUT, CFG, num_devices=8, only=(DP8, DP2TP4))}

  def key(**spec):
    config = dataclasses.replace(_config(1 << 30), spec=dataclasses.replace(SPEC, **spec))
    return profiler.profile_key(CFG, config, cands)

  base = key()
  assert key(optim=train_lib.OptimConfig(learning_rate=0.123, weight_decay=0.1)) == base
  assert key(loss=losses.LossConfig(kl_coef=0.01)) == key(loss=losses.LossConfig(kl_coef=0.5))
  assert key(loss=losses.LossConfig(kl_coef=0.01)) != base
  assert key(micro_batches=2) != base


def test_a_table_timed_more_carefully_serves_a_run_that_times_less(exe, budget, tmp_path):
  """The shareable table: how it was timed is not part of its key."""
  path = str(tmp_path / 'table.json')
  careful = dataclasses.replace(_config(budget), measure=MeasureConfig(repeats=3, rounds=2))
  table = profiler.run(CFG, careful, executables=exe, cache_path=path)
  assert all(len(c.times_ms) == 6 for c in table.cells.values() if not c.oom)
  cands = profiler.default_candidates(CFG, careful)
  assert profiler.profile_key(CFG, careful, cands) == profiler.profile_key(
    CFG, _config(budget), cands
  )
  reused = profiler.run(CFG, _config(budget), executables=exe, cache_path=path)
  assert reused.cells == table.cells and reused.wall_s == table.wall_s  # nothing timed again


def _fabricated(path, config, tgs: dict[str, float], buckets=(32,)):
  """A cache of `config`'s setup holding rollout cells at `buckets` with the given speeds."""
  cands = profiler.default_candidates(CFG, config)
  key = profiler.profile_key(CFG, config, cands)
  cells = {
    (Stage.ROLLOUT, bucket, 8, name): Cell(
      stage=Stage.ROLLOUT,
      config=name,
      bucket=bucket,
      rows=8,
      peak_bytes=MiB,
      oom=False,
      throughput=v,
      times_ms=(1.0,),
    )
    for name, v in tgs.items()
    for bucket in buckets
  }
  Profile(key=key, cells=cells).save(path)


def test_the_model_rules_a_far_slower_layout_out_of_a_cheaper_profile(exe, budget, tmp_path):
  """Measured at 32 and 64, dp8 is 10x slower than dp2.tp4: at 48, between them, only dp2.tp4
  is timed (dp8's upper bound stays below dp2.tp4's lower bound), and dp8 keeps no cell there;
  without pruning both are timed. Measured at 32 alone, nothing is pruned at 2048: one bucket
  cannot tell a layout's fixed cost from its growth."""
  config = dataclasses.replace(_config(None), buckets=BucketConfig(lengths=(32, 48, 64)))
  path = str(tmp_path / 'profile.json')
  speeds = {'dp8.tp1': 1.0, 'dp2.tp4': 10.0}
  _fabricated(path, config, speeds, buckets=(32, 64))
  cheap = profiler.run(CFG, config, executables=exe, cache_path=path, confidence=2.0)
  assert cheap.cell(Stage.ROLLOUT, 48, 8, DP2TP4).measured
  assert (Stage.ROLLOUT, 48, 8, 'dp8.tp1') not in cheap.cells
  _fabricated(path, config, speeds, buckets=(32, 64))
  full = profiler.run(CFG, config, executables=exe, cache_path=path)
  assert full.covers(Stage.ROLLOUT, 48, 8)

  far = _config(None)
  _fabricated(path, far, speeds)
  assert profiler.run(CFG, far, executables=exe, cache_path=path, confidence=2.0).covers(
    Stage.ROLLOUT, 2048, 8
  )


def test_cells_are_timed_between_steps_only_as_far_as_allowed(exe, budget, tmp_path):
  config = _config(None)
  path = str(tmp_path / 'profile.json')
  measurer = profiler.Profiler(model=CFG, config=config, executables=exe, cache_path=path)
  empty = measurer.start(measure=False)
  assert not empty.cells
  cells = [
    (Stage.ROLLOUT, 32, 8, 'dp8.tp1'),
    (Stage.ROLLOUT, 2048, 8, 'dp2.tp4'),
    (Stage.ROLLOUT, 32, 8, 'dp2.tp4'),
  ]
  assert all(measurer.compiled_here(c) for c in cells)  # the fixtures compiled them
  assert measurer.agreed([True, False, True]) == [True, False, True]  # one process: its own
  asked = []

  def proceed(stage, bucket, rows, names):
    asked.append((bucket, names))
    return bucket == 32

  profile, params = measurer.measure_cells(empty, cells, proceed=proceed)
  # A cell at a time, in order; one not allowed is passed over, and the next one asked.
  assert asked == [(32, ['dp8.tp1']), (2048, ['dp2.tp4']), (32, ['dp2.tp4'])]
  allowed = {cells[0], cells[2]}
  assert set(profile.cells) == allowed and all(c.measured for c in profile.cells.values())
  assert all(len(c.times_ms) == 3 for c in profile.cells.values())  # the median of 3 calls
  assert all(c.timed_by == 'profile' for c in profile.cells.values())
  assert set(load_cached(path, profile.key).cells) == allowed
  # The weights are handed back, and the next call reuses them (no new random weights).
  assert params is not None
  again, kept = measurer.measure_cells(profile, [cells[1]], proceed=lambda *a: True, params=params)
  assert kept is not None and again.cell(Stage.ROLLOUT, 2048, 8, 'dp2.tp4').measured
  unknown = (Stage.ROLLOUT, 2048, 16, 'dp8.tp1')
  assert not measurer.compiled_here(unknown)
  measurer.compiler.shutdown()
