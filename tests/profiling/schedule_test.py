"""A run's profile schedule (`schedule.ProfileScheduler`) with the cost model: no decision waits,
the wanted cells are compiled in the background and timed between steps, a cell at a time, the
stages taking turns, within the share; the reasons say which figures were measured."""

import dataclasses
import statistics
import time
import types
from typing import ClassVar

import pytest

from earl_jax.config import ParallelConfig
from earl_jax.profiling import profiler, schedule
from earl_jax.profiling.table import MeasureConfig, Profile, load_cached
from earl_jax.programs import Executables
from earl_jax.selector.selector import ProfileSettings, StepStats
from earl_jax.stage import Stage
from earl_jax.testing import multiprocess
from earl_jax.testing.configs import smoke_experiment
from earl_jax.testing.typecheck import unchecked
from earl_jax.train import assembly


def _run_parts(tmp_path, rollout=None, stages=('rollout',), candidates=None, **settings):
  base = smoke_experiment()
  base = base if rollout is None else dataclasses.replace(base, rollout=rollout)
  if candidates is not None:
    base = dataclasses.replace(
      base, selector=dataclasses.replace(base.selector, candidates=candidates)
    )
  profile = ProfileSettings(
    stages=stages,
    cache=str(tmp_path / 'profile.json'),
    lazy=True,
    measure=MeasureConfig(repeats=3, rounds=1),
    **settings,
  )
  config = dataclasses.replace(base, selector=dataclasses.replace(base.selector, profile=profile))
  model, tok = assembly.load_model(config)
  spec = assembly.stage_spec(config, tok, model)
  exe = Executables(model, spec=spec)
  run_profile = assembly.start_profile(config, model=model, spec=spec, executables=exe)
  selector = assembly.make_selector(config, model, spec, run_profile.profile, 8, lambda *_: 0.0)
  return config, exe, run_profile, selector


def test_decisions_never_wait_and_measurements_replace_the_prior(tmp_path):
  config, exe, run_profile, sel = _run_parts(tmp_path, max_share=1.0, compile_share=1.0)
  with exe:
    # Before the first step: nothing measured, nothing waited for; the wanted cells queued.
    assert run_profile.before_decision(sel, Stage.ROLLOUT, None) == 0.0
    assert run_profile.between_steps(sel, None) == 0.0  # the first step never waits
    first = sel.decide(Stage.ROLLOUT, None)
    assert 'measured: none' in first.reason and '+-500%, analytic)' in first.reason
    wanted = sel.wanted(Stage.ROLLOUT, None)
    assert [c[2] for c in wanted] == ['dp8.tp1', 'dp4.tp2']  # every candidate at bucket 64
    # Between steps, once compiled: the wanted cells are timed and replace the model's figures,
    # but not while the run's own precompile is under way (it would take a core from them).
    run_profile.wait_compiles()
    stats = StepStats(episode_lengths=(40, 50), num_responses=config.rollout.num_episodes)
    exe.precompile(exe.key(Stage.TRAIN, ParallelConfig(dp=8), 64, 8))
    assert exe.busy()
    assert run_profile.between_steps(sel, stats) == 0.0
    assert not any(c.measured for c in sel.profile(Stage.ROLLOUT).cells.values())
    assert run_profile.holding  # the run's queued precompiles wait for a quiet boundary
    exe.wait()
    assert not exe.busy()
    assert run_profile.between_steps(sel, stats) > 0
    assert run_profile.holding == run_profile._compiling_here()  # the next cell's compile
    # One profile compile at a time: the second cell compiles once the first is timed (and the
    # run's time allows the compile: `compile_share` of it).
    cells = sel.profile(Stage.ROLLOUT).cells
    assert cells[(Stage.ROLLOUT, 64, 8, 'dp8.tp1')].measured
    for _ in range(40):
      if cells[(Stage.ROLLOUT, 64, 8, 'dp4.tp2')].measured:
        break
      time.sleep(0.25)  # the run's time passes: the compile budget accrues
      run_profile.wait_compiles()
      run_profile.between_steps(sel, stats)
      cells = sel.profile(Stage.ROLLOUT).cells
    assert all(cells[(Stage.ROLLOUT, 64, 8, n)].measured for _, _, n in wanted)
    d = sel.decide(Stage.ROLLOUT, stats)
    assert d.measured and 'measured: dp8.tp1, dp4.tp2' in d.reason
    assert sel.wanted(Stage.ROLLOUT, stats) == []
    # The measurements went to the cache file, without the model's figures.
    cached = load_cached(config.selector.profile.cache, run_profile.profile.key)
    assert {k for k, c in cached.cells.items()} == {(Stage.ROLLOUT, 64, 8, n) for _, _, n in wanted}


def test_the_runs_precompiles_wait_while_the_profile_compiles(tmp_path, monkeypatch):
  """While the profile compiles a cell, the run's queued precompiles do not start (one started
  beside it would still take a core when the cell is ready, and the cell would wait for a quiet
  boundary behind it); once the profile's compile is done they go on."""
  from concurrent import futures

  config, exe, run_profile, sel = _run_parts(tmp_path, max_share=1.0, compile_share=1.0)
  compiling = futures.Future()  # the profile's compile, under way until set
  started = []

  def compile_cell(profiler, cell):
    started.append(cell)
    return compiling

  monkeypatch.setattr(type(run_profile._profiler), 'compile', compile_cell)
  stats = StepStats(episode_lengths=(40, 50), num_responses=config.rollout.num_episodes)
  key = exe.key(Stage.TRAIN, ParallelConfig(dp=8), 64, 8)
  with exe:
    run_profile.before_decision(sel, Stage.ROLLOUT, None)
    assert started == [(Stage.ROLLOUT, 64, 8, 'dp8.tp1')]
    run_profile.between_steps(sel, stats)
    assert run_profile.holding
    exe.precompile(key)
    time.sleep(0.5)
    assert not exe.busy() and key not in exe  # held in the queue
    compiling.set_result(1.0)
    run_profile.between_steps(sel, stats)
    assert not run_profile.holding
    exe.wait()
    assert key in exe


def test_the_rollout_is_profiled_and_decided_on_its_slots(tmp_path):
  """With fewer slots than episodes, the rollout's cells are measured at the slots' rows, the
  rows its program runs (so the profile's compile is the run's), and the other stages decide on
  the step's episodes."""
  base = smoke_experiment()
  rollout = dataclasses.replace(base.rollout, num_episodes=16, num_slots=8)
  config, exe, run_profile, sel = _run_parts(tmp_path, max_share=1.0, rollout=rollout)
  assert sel.rows == (8, 16) and assembly.rollout_rows(config) == {Stage.ROLLOUT: 8}
  with exe:
    run_profile.before_decision(sel, Stage.ROLLOUT, None)
    assert {rows for _, rows, _ in sel.wanted(Stage.ROLLOUT, None)} == {8}
    run_profile.wait_compiles()
    stats = StepStats(
      episode_lengths=(40, 50), num_responses=16, stage_rows=assembly.rollout_rows(config)
    )
    assert run_profile.between_steps(sel, stats) > 0
    measured = {
      (s, b, r) for (s, b, r, _), c in sel.profile(Stage.ROLLOUT).cells.items() if c.measured
    }
    assert measured == {(Stage.ROLLOUT, 64, 8)}
    d = sel.decide(Stage.ROLLOUT, stats)
    assert d.rows == 8 and d.measured and '8 responses -> load 8' in d.reason
    compiles = exe.compiles
    exe.get(exe.key(Stage.ROLLOUT, d.config, d.run_bucket, d.rows))  # the program the rollout runs
    assert exe.compiles == compiles  # compiled once, for the profile
    assert sel.decide(Stage.EXPERIENCE, stats).rows == 16
  with pytest.raises(ValueError, match='rows of rollout must be positive'):
    StepStats(episode_lengths=(4,), num_responses=16, stage_rows={'rollout': 0})


def test_the_runs_own_calls_measure_the_layout_it_runs(tmp_path):
  """The calls the run's steps make of a stage program are timed as samples of its cell: the
  first is a warm-up, one made while a background compile runs is not kept, and 3 make a
  measured cell ('run'), added to the profile between steps; the profile's calls then go to the
  other layouts at that bucket, whatever the load."""
  config, exe, run_profile, sel = _run_parts(
    tmp_path, stages=('rollout', 'experience'), max_share=1.0
  )
  stats = StepStats(episode_lengths=(40, 50), num_responses=config.rollout.num_episodes)
  with exe:
    dp8 = ParallelConfig(dp=8)
    program = exe.get(exe.key(Stage.EXPERIENCE, dp8, 64, 16))  # 16 packed rows
    rollout = exe.get(exe.key(Stage.ROLLOUT, dp8, 64, 8))
    cell = (Stage.EXPERIENCE, 64, 16, 'dp8.tp1')

    def call(seconds, program=program):
      with run_profile.observing(program):
        time.sleep(seconds)

    call(0.2)  # the warm-up: not a sample
    call(0.02)
    exe.precompile(exe.key(Stage.TRAIN, dp8, 64, 8))  # a compile beside a call: not a sample
    call(0.5)
    exe.wait()
    call(0.03)
    call(0.5, program=rollout)  # the rollout is measured by the profile only
    assert cell not in sel.profile(Stage.EXPERIENCE).cells  # 2 samples so far
    # Before the stage is measured anywhere, a cell's calls are priced at the run's latest call
    # of the stage (process 0's, as of the step boundary), scaled to the cell's tokens.
    run_profile.between_steps(sel, stats)
    run_profile.wait_compiles()  # the profile's own compiles it started
    tokens, seconds = run_profile._latest[Stage.EXPERIENCE]
    assert tokens == program.program.tokens and 0.03 <= seconds < 0.1
    measure = config.selector.profile.measure
    call_s = seconds * (64 * 8) / tokens  # the cell at the step's load, 8 rows of 64
    expected = measure.rounds * (
      measure.warmup * call_s + max(measure.repeats * call_s, measure.min_seconds)
    )
    priced = run_profile._calls_s(
      sel.profile(Stage.EXPERIENCE), Stage.EXPERIENCE, 64, 8, ['dp4.tp2']
    )
    assert priced == pytest.approx(expected)
    call(0.04)
    run_profile.between_steps(sel, stats)
    measured = sel.profile(Stage.EXPERIENCE).cells[cell]
    assert measured.measured and measured.timed_by == 'run'
    assert len(measured.times_ms) == 3 and 20 <= min(measured.times_ms) < 60
    assert measured.throughput == pytest.approx(
      program.program.tokens / (statistics.median(measured.times_ms) / 1e3) / 8
    )
    by_run = [k for k, c in sel.profile(Stage.ROLLOUT).cells.items() if c.timed_by == 'run']
    assert by_run == [cell]
    # At bucket 64 the profile wants every experience layout at the step's load, the one the
    # run timed at its packed rows included (its speed per token moves with the rows).
    wanted = {(b, r, n) for b, r, n in sel.wanted(Stage.EXPERIENCE, stats) if b == 64}
    assert 'dp8.tp1' in {n for _, _, n in wanted}
    assert {r for _, r, _ in wanted} == {8}
    # A measured cell is not sampled again.
    call(0.3)
    assert sel.profile(Stage.EXPERIENCE).cells[cell] == measured
    run_profile.between_steps(sel, stats)
    assert sel.profile(Stage.EXPERIENCE).cells[cell] == measured
    # The cache file keeps it.
    cached = load_cached(config.selector.profile.cache, run_profile.profile.key)
    assert cached.cells[cell].timed_by == 'run'


def test_the_runs_calls_at_changing_packed_rows_make_one_cell_per_token(tmp_path):
  """The run's calls of a layout at a bucket run at the packed rows of each step: after each
  program's first call (a warm-up), a call is a sample per token, and three make one cell at the
  latest call's rows; the layout is not sampled at that bucket again."""
  _, exe, run_profile, sel = _run_parts(tmp_path, stages=('experience',), max_share=1.0)
  stats = StepStats(episode_lengths=(40, 50), num_responses=8)
  dp8 = ParallelConfig(dp=8)
  with exe:
    rows16, rows8 = (exe.get(exe.key(Stage.EXPERIENCE, dp8, 64, r)) for r in (16, 8))
    assert rows16.program.tokens == 2 * rows8.program.tokens

    def call(program, seconds):
      with run_profile.observing(program):
        time.sleep(seconds)

    call(rows16, 0.3)  # warm-ups, one per program
    call(rows8, 0.3)
    run_profile.wait_compiles()
    call(rows16, 0.08)
    call(rows8, 0.04)  # the same time per token
    call(rows16, 0.08)
    run_profile.between_steps(sel, stats)
    cells = run_profile.profile.cells
    cell = cells[(Stage.EXPERIENCE, 64, 16, 'dp8.tp1')]
    assert cell.timed_by == 'run' and len(cell.times_ms) == 3
    assert all(80 <= t < 130 for t in cell.times_ms), cell.times_ms  # at 16 rows' tokens
    at8 = (Stage.EXPERIENCE, 64, 8, 'dp8.tp1')  # the load's: the profile's to time, not the run's
    assert at8 not in cells or cells[at8].timed_by == 'profile'
    for _ in range(4):
      call(rows8, 0.01)
    run_profile.between_steps(sel, stats)
    cells = run_profile.profile.cells
    assert at8 not in cells or cells[at8].timed_by == 'profile'


def test_the_profile_times_the_program_a_stage_runs_where_the_model_barely_knows_its_layout(
  tmp_path,
):
  """Experience runs dp8 at bucket 64, its load 8 rows, its latest call at 16 packed rows; the
  model knows dp8 from nothing measured (+-500%): the profile first times the program the run
  runs (16 rows, compiled already: measured at once, no compile of its own), then, as for the
  other layout, dp8 at the load's 8 rows, where the ranking compares them."""
  _, exe, run_profile, sel = _run_parts(
    tmp_path, stages=('experience',), max_share=1.0, compile_share=1.0
  )
  stats = StepStats(episode_lengths=(40, 50), num_responses=8)
  dp8 = ParallelConfig(dp=8)
  with exe:
    decision = sel.decide(Stage.EXPERIENCE, stats)
    assert (decision.config, decision.run_bucket, decision.rows) == (dp8, 64, 8)
    run_profile.before_decision(sel, Stage.EXPERIENCE, stats)  # the next step's
    program = exe.get(exe.key(Stage.EXPERIENCE, dp8, 64, 16))  # the run's, at 16 packed rows
    with run_profile.observing(program):  # its first call: a warm-up, no sample
      time.sleep(0.01)
    run_profile.wait_compiles()
    anchor, load = (Stage.EXPERIENCE, 64, 16, 'dp8.tp1'), (Stage.EXPERIENCE, 64, 8, 'dp8.tp1')
    assert exe.key(Stage.EXPERIENCE, dp8, 64, 8) not in exe  # nothing compiled for dp8 at 8
    run_profile.between_steps(sel, stats)
    cells = run_profile.profile.cells
    assert anchor in cells and cells[anchor].timed_by == 'profile'
    assert len(cells[anchor].times_ms) >= 3 and load not in cells
    assert 'dp8.tp1@64' in sel.profile(Stage.EXPERIENCE).cell(*load).prior  # its own curve
    for _ in range(120):
      run_profile.wait_compiles()
      run_profile.between_steps(sel, stats)
      if load in run_profile.profile.cells:
        break
      time.sleep(0.25)  # the run's time passes: the compile budget accrues
    # At the load's bucket; the next bucket's cells (the lookahead's) may be timed in the
    # same boundary where the compile budget has accrued more (a slower machine).
    timed = {k for k, c in run_profile.profile.cells.items() if c.measured and k[1] == 64}
    assert timed == {anchor, load, (Stage.EXPERIENCE, 64, 8, 'dp4.tp2')}
    assert sel.wanted(Stage.EXPERIENCE, stats) == []


def test_a_layout_within_its_noise_of_the_best_is_timed_again_and_pooled(tmp_path):
  """Experience at bucket 64 and load 8 has two measured layouts within their noise: dp8.tp1
  (which it runs) and dp4.tp2, 5% slower. Between steps the profile times dp4.tp2 again and the
  run's own calls time dp8.tp1 again, each pooled with its first session (6 calls, 2
  sessions); then neither is wanted again (`retimes` 1)."""
  _, exe, run_profile, sel = _run_parts(
    tmp_path, stages=('experience',), max_share=1.0, compile_share=1.0
  )
  stats = StepStats(episode_lengths=(40, 50), num_responses=8)
  dp8, dp4tp2 = ParallelConfig(dp=8), ParallelConfig(dp=4, tp=2)
  runs, other = (Stage.EXPERIENCE, 64, 8, 'dp8.tp1'), (Stage.EXPERIENCE, 64, 8, 'dp4.tp2')
  with exe:
    program = exe.get(exe.key(Stage.EXPERIENCE, dp8, 64, 8))
    exe.get(exe.key(Stage.EXPERIENCE, dp4tp2, 64, 8))
    # A first session each: dp8.tp1 by the run's calls at 30 ms, dp4.tp2 by the profile's.
    first = {
      runs: profiler.timed_cell(program, (30.0, 30.0, 31.0)),
      other: profiler.timed_cell(exe.get(exe.key(Stage.EXPERIENCE, dp4tp2, 64, 8)), (31.5,) * 3),
    }
    first[runs] = dataclasses.replace(first[runs], timed_by='run')
    run_profile.profile = run_profile.profile.merged(
      Profile(key=run_profile.profile.key, cells=first)
    )
    sel.use_profile(run_profile.profile)
    assert sel.decide(Stage.EXPERIENCE, stats).config == dp8
    with run_profile.observing(program):  # the run's latest call ran at the cell it ranks by
      pass
    assert sel.wanted(Stage.EXPERIENCE, stats, again=True) == [
      (64, 8, 'dp8.tp1'),
      (64, 8, 'dp4.tp2'),
    ]
    run_profile.between_steps(sel, stats)
    assert run_profile._again == {runs}  # the cell it runs: its own calls time it again
    run_profile.wait_compiles()  # a sample is kept only with no compile beside it
    for _ in range(4):  # a warm-up, then 3 samples
      with run_profile.observing(program):
        time.sleep(0.04)
    for _ in range(40):
      run_profile.wait_compiles()
      run_profile.between_steps(sel, stats)
      cells = run_profile.profile.cells
      if cells[runs].sessions == 2 and cells[other].sessions == 2:
        break
      time.sleep(0.25)
    assert cells[runs].sessions == 2 and cells[other].sessions == 2
    assert cells[runs].timed_by == 'run' and cells[runs].times_ms[:3] == (30.0, 30.0, 31.0)
    assert len(cells[runs].times_ms) == 6 and min(cells[runs].times_ms[3:]) >= 40
    assert cells[runs].throughput == pytest.approx(
      program.program.tokens / (statistics.median(cells[runs].times_ms) / 1e3) / 8
    )
    assert cells[other].times_ms[:3] == (31.5,) * 3 and len(cells[other].times_ms) > 3
    handed = sel.profile(Stage.EXPERIENCE).cells[other]  # handed to the selector
    assert (handed.times_ms, handed.sessions) == (cells[other].times_ms, 2)
    assert sel.wanted(Stage.EXPERIENCE, stats, again=True) == []


def test_a_stage_times_again_while_another_stage_waits_to_be_measured(tmp_path):
  """Experience at bucket 64 has both its layouts measured, within their noise of each other;
  train has nothing measured (its programs still to compile). Experience's re-time of dp4.tp2
  (compiled already) does not wait for train's first cells: a stage's re-times wait only for
  its own cells that could beat its best."""
  _, exe, run_profile, sel = _run_parts(
    tmp_path, stages=('experience', 'train'), max_share=1.0, compile_share=1.0
  )
  stats = StepStats(episode_lengths=(40, 50), num_responses=8)
  dp8, dp4tp2 = ParallelConfig(dp=8), ParallelConfig(dp=4, tp=2)
  runs, other = (Stage.EXPERIENCE, 64, 8, 'dp8.tp1'), (Stage.EXPERIENCE, 64, 8, 'dp4.tp2')
  with exe:
    program = exe.get(exe.key(Stage.EXPERIENCE, dp8, 64, 8))
    first = {
      runs: profiler.timed_cell(program, (30.0, 30.0, 31.0)),
      other: profiler.timed_cell(exe.get(exe.key(Stage.EXPERIENCE, dp4tp2, 64, 8)), (31.5,) * 3),
    }
    run_profile.profile = run_profile.profile.merged(
      Profile(key=run_profile.profile.key, cells=first)
    )
    sel.use_profile(run_profile.profile)
    assert sel.decide(Stage.EXPERIENCE, stats).config == dp8
    assert sel.wanted(Stage.TRAIN, stats)  # train's first cells: not measured yet
    assert (64, 8, 'dp4.tp2') in sel.wanted(Stage.EXPERIENCE, stats, again=True)
    for _ in range(40):  # quiet boundaries (the profile compiles train's cells one at a time)
      run_profile.wait_compiles()
      run_profile.between_steps(sel, stats)
      if run_profile.profile.cells[other].sessions == 2:
        break
      time.sleep(0.25)
    assert run_profile.profile.cells[other].sessions == 2
    assert len(run_profile.profile.cells[other].times_ms) > 3
    assert sel.wanted(Stage.TRAIN, stats)  # timed again before train's cells were all measured


def test_re_times_waiting_for_a_contender_do_not_hold_back_its_compile(tmp_path):
  """Experience at bucket 64 has dp8.tp1 and dp4.tp2 measured within their noise (both compiled:
  their re-times are ready and fit the share) and dp2.tp4 measured nowhere, not compiled yet.
  The re-times wait for dp2.tp4; they used to hold back its compile as well (a compiled cell
  that fits the share drains the compiles), so that neither was ever timed: the default's
  rollout at 1024 from step 19 of 60 at `9a59f79`. Now dp2.tp4 is compiled and measured, then
  the two are timed again."""
  _, exe, run_profile, sel = _run_parts(
    tmp_path,
    stages=('experience',),
    candidates=('dp8', 'dp4.tp2', 'dp2.tp4'),
    max_share=1.0,
    compile_share=1.0,
  )
  stats = StepStats(episode_lengths=(40, 50), num_responses=8)
  dp8, dp4tp2 = ParallelConfig(dp=8), ParallelConfig(dp=4, tp=2)
  best, other = (Stage.EXPERIENCE, 64, 8, 'dp8.tp1'), (Stage.EXPERIENCE, 64, 8, 'dp4.tp2')
  contender = (Stage.EXPERIENCE, 64, 8, 'dp2.tp4')
  with exe:
    first = {
      best: profiler.timed_cell(exe.get(exe.key(Stage.EXPERIENCE, dp8, 64, 8)), (30.0,) * 3),
      other: profiler.timed_cell(exe.get(exe.key(Stage.EXPERIENCE, dp4tp2, 64, 8)), (31.5,) * 3),
    }
    run_profile.profile = run_profile.profile.merged(
      Profile(key=run_profile.profile.key, cells=first)
    )
    sel.use_profile(run_profile.profile)
    assert sel.decide(Stage.EXPERIENCE, stats).config == dp8
    assert (64, 8, 'dp2.tp4') in sel.wanted(Stage.EXPERIENCE, stats, contenders=True)
    assert set(sel.wanted(Stage.EXPERIENCE, stats, again=True)) == {best[1:], other[1:]}
    assert not run_profile._profiler.compiled_here(contender)
    for _ in range(40):
      run_profile.between_steps(sel, stats)
      run_profile.wait_compiles()
      if getattr(run_profile.profile.cells.get(contender), 'measured', False):
        break
      time.sleep(0.25)
    assert getattr(run_profile.profile.cells.get(contender), 'measured', False)
    for _ in range(40):  # then the re-times, no longer held
      run_profile.between_steps(sel, stats)
      if not sel.wanted(Stage.EXPERIENCE, stats, again=True):
        break
      time.sleep(0.25)
    assert not sel.wanted(Stage.EXPERIENCE, stats, again=True)


def test_the_layout_a_stage_runs_is_left_to_its_own_calls_only_where_the_model_knows_it():
  """Train runs dp8.tp1 at 256 and its latest call ran it there at the load's rows: the profile
  leaves that cell to the run's calls while the model knows dp8 there (fitted to its own cells,
  or within a factor e); while it barely does (+-200%, from the others' cells) the profile
  measures it itself, since the selector holds the layout until it is measured. A latest call
  at other rows (a packed batch's) or at another bucket leaves nothing to the run."""
  from earl_jax.profiling.table import Cell

  sched = schedule.ProfileScheduler(None, None, settings=ProfileSettings(stages=('train',)))
  decision = types.SimpleNamespace(
    stage=Stage.TRAIN, run_bucket=256, rows=64, config=ParallelConfig(dp=8)
  )

  def selector(prior, uncertainty):
    figure = Cell(stage=Stage.TRAIN, config='dp8.tp1', bucket=256, rows=64, peak_bytes=1,
                  oom=False, throughput=1.0, measured=False, prior=prior, uncertainty=uncertainty)  # fmt: skip
    profile = types.SimpleNamespace(cell=lambda *key: figure)
    return types.SimpleNamespace(history=[decision], profile=lambda stage: profile)

  cell = (Stage.TRAIN, 256, 64, 'dp8.tp1')
  sched._ran = {Stage.TRAIN: (Stage.TRAIN, 256, 64, 'dp8.tp1')}
  assert sched._run_timed(selector('dp8.tp1@128', 0.3)) == {cell}
  assert sched._run_timed(selector('stage', 0.5)) == {cell}
  assert sched._run_timed(selector('stage', 2.0)) == set()
  sched._ran = {Stage.TRAIN: (Stage.TRAIN, 256, 24, 'dp8.tp1')}  # at other rows: a cell there
  assert sched._run_timed(selector('dp8.tp1@128', 0.3)) == set()
  sched._ran = {Stage.TRAIN: (Stage.TRAIN, 512, 64, 'dp8.tp1')}
  assert sched._run_timed(selector('dp8.tp1@128', 0.3)) == set()


def test_the_profile_measures_a_cell_the_runs_calls_have_not_timed_within_its_patience():
  """The cell a stage runs is left to the run's own calls for `PATIENCE` step boundaries while
  it is wanted (a boundary where it is not wanted does not count); then the profile measures it:
  the run's calls, kept only with no compile beside them, may never time it."""
  from earl_jax.profiling.table import Cell

  sched = schedule.ProfileScheduler(None, None, settings=ProfileSettings(stages=('train',)))
  decision = types.SimpleNamespace(
    stage=Stage.TRAIN, run_bucket=256, rows=64, config=ParallelConfig(dp=8)
  )
  figure = Cell(stage=Stage.TRAIN, config='dp8.tp1', bucket=256, rows=64, peak_bytes=1,
                oom=False, throughput=1.0, measured=False, prior='dp8.tp1@128', uncertainty=0.3)  # fmt: skip
  wanted = [(256, 64, 'dp8.tp1')]
  sel = types.SimpleNamespace(
    history=[decision],
    profile=lambda stage: types.SimpleNamespace(cell=lambda *key: figure),
    wanted=lambda stage, stats, again=False: [] if again else list(wanted),
  )
  cell = (Stage.TRAIN, 256, 64, 'dp8.tp1')
  sched._ran = {Stage.TRAIN: (Stage.TRAIN, 256, 64, 'dp8.tp1')}
  for _ in range(schedule.ProfileScheduler.PATIENCE):
    sched._count_left(sel, None)
    assert sched._run_timed(sel) == {cell}
  wanted.clear()  # not wanted: not counted
  sched._count_left(sel, None)
  assert sched._run_timed(sel) == {cell}
  wanted.append((256, 64, 'dp8.tp1'))
  sched._count_left(sel, None)
  assert sched._run_timed(sel) == set()


def test_measuring_between_steps_keeps_within_its_share(monkeypatch):
  """A cell is timed while the time spent measuring, with the cell's estimate (its calls at the
  model's figures, plus the median time the cells timed so far took beyond their calls), stays
  within the share of the run's time; after a cell that ran over, nothing is timed until the run
  catches up. The overhead is per cell: a cheap cell's does not price an expensive one out."""
  now = [100.0]
  monkeypatch.setattr(schedule.time, 'perf_counter', lambda: now[0])
  share = schedule._Share(0.1)
  now[0] = 200.0  # 100 s into the run: 10 s to spend
  assert share.allows(0.0)  # nothing known of its cost yet (the first measurement): timed
  now[0] = 206.0
  assert share.allows(1.0)  # 6 s spent (no calls to learn an overhead from): 1 s more fits
  now[0] = 209.0  # that cell took 3 s for 1 s of calls: 2 s a cell beyond its calls
  assert not share.allows(1.0)  # 9 + 1 + 2 > 10.9
  assert share.spent == 9.0 and share.overhead_s == 2.0
  now[0] = 240.0  # 14 s to spend by now
  assert share.allows(1.0)
  share.done()
  assert share.spent == 9.0  # no time passed in it
  # An expensive cell is priced at its calls plus the median overhead, not a multiple of it.
  assert share.overhead_s == 1.0  # the median of 2 and 0
  now[0] = 400.0  # 30 s to spend, 9 spent: an 18 s cell fits (9 + 18 + 1 <= 30), 21 s does not
  assert not share.allows(21.0)
  assert share.allows(18.0)


class _Wanting:
  """A selector as `ProfileScheduler.order_wanted` reads it: what each stage wants, ahead, its
  profile (experience has 1 layout measured at 256 by the run's own calls at another load,
  rollout and train none), and its decisions (train runs dp8.tp1 at 256)."""

  config = dataclasses.make_dataclass('C', ['profile'])(
    dataclasses.make_dataclass('P', ['stages'])((Stage.ROLLOUT, Stage.EXPERIENCE, Stage.TRAIN))
  )
  MEASURED: ClassVar = {
    Stage.ROLLOUT: (),
    Stage.EXPERIENCE: (('dp1.fsdp8.tp1', 40),),
    Stage.TRAIN: (),
  }
  history = (
    types.SimpleNamespace(
      stage=Stage.ROLLOUT, run_bucket=256, rows=64, config=ParallelConfig(dp=8)
    ),
    types.SimpleNamespace(stage=Stage.TRAIN, run_bucket=256, rows=64, config=ParallelConfig(dp=8)),
  )

  def wanted(self, stage, stats, *, ahead=False, second=False, again=False):
    if again:  # measured cells within their noise of the best, to time again
      return {Stage.ROLLOUT: [(256, 64, 'dp2.tp4')], Stage.TRAIN: [(256, 64, 'dp8.tp1')]}.get(
        stage, []
      )
    if ahead:
      return [(512, 64, 'dp8.tp1')] if stage == Stage.TRAIN else []
    if second:
      return [(128, 64, 'dp4.tp2')] if stage == Stage.TRAIN else []
    per_stage = {
      Stage.ROLLOUT: ['dp8.tp1', 'fsdp8', 'dp1.tp8'],
      Stage.EXPERIENCE: ['dp2.tp4', 'dp8.tp1'],
      Stage.TRAIN: ['fsdp8', 'dp8.tp1', 'dp4.tp2'],
    }
    return [(256, 64, n) for n in per_stage[stage]]

  def profile(self, stage):
    from earl_jax.profiling.table import Cell, Profile

    names = ('dp8.tp1', 'dp4.tp2', 'dp2.tp4', 'dp1.fsdp8.tp1')
    key = {'stages': [str(stage)], 'candidates': {str(stage): list(names)}, 'buckets': [256],
           'rows': [64]}  # fmt: skip
    cells = {
      (stage, 256, rows, n): Cell(
        stage=stage, config=n, bucket=256, rows=rows, peak_bytes=1, oom=False, throughput=1.0
      )
      for n, rows in self.MEASURED[stage]
    }
    return Profile(key=key, cells=cells)


def test_the_cheapest_cells_first_the_rollout_leading_until_measured():
  """The rollout, measured nowhere yet, leads with its cheapest cell (train, measured nowhere
  too, is measured by its own calls, and its layout running at 256 is not wanted); train, with
  no layout measured at 256, where its latest decision ran, leads with its most promising cell
  there; then every cell by the cost of its compile and calls, whichever the stage; the next
  bucket up after them, then the second buckets, and the measured cells to time again last
  (but the cell a stage runs: its own calls time it). Once two train layouts are measured at 256
  (one by the run's own calls, at its packed rows), train leads no more."""
  cost = {
    (Stage.ROLLOUT, 256, 64, 'dp8.tp1'): 15.0,
    (Stage.ROLLOUT, 256, 64, 'fsdp8'): 20.0,
    (Stage.ROLLOUT, 256, 64, 'dp1.tp8'): 25.0,
    (Stage.EXPERIENCE, 256, 64, 'dp2.tp4'): 1.0,
    (Stage.EXPERIENCE, 256, 64, 'dp8.tp1'): 2.0,
    (Stage.TRAIN, 256, 64, 'fsdp8'): 20.0,
    (Stage.TRAIN, 256, 64, 'dp4.tp2'): 10.0,
    (Stage.TRAIN, 512, 64, 'dp8.tp1'): 0.0,
    (Stage.TRAIN, 128, 64, 'dp4.tp2'): 0.0,
    (Stage.ROLLOUT, 256, 64, 'dp2.tp4'): 0.0,
  }
  # With no stage leading but the rollout (measured nowhere), the cheapest first:
  cheapest_first = [
    (Stage.ROLLOUT, 256, 64, 'dp8.tp1'),
    (Stage.EXPERIENCE, 256, 64, 'dp2.tp4'),
    (Stage.EXPERIENCE, 256, 64, 'dp8.tp1'),
    (Stage.TRAIN, 256, 64, 'dp4.tp2'),
    (Stage.ROLLOUT, 256, 64, 'fsdp8'),
    (Stage.TRAIN, 256, 64, 'fsdp8'),
    (Stage.ROLLOUT, 256, 64, 'dp1.tp8'),
    (Stage.TRAIN, 512, 64, 'dp8.tp1'),
    (Stage.TRAIN, 128, 64, 'dp4.tp2'),  # a second bucket
    # Last, a cell to time again (train's runs: the run's own calls time it again).
    (Stage.ROLLOUT, 256, 64, 'dp2.tp4'),
  ]
  train_lead = (Stage.TRAIN, 256, 64, 'fsdp8')  # its most promising at 256 (`wanted`'s first)
  running = {(Stage.TRAIN, 256, 64, 'dp8.tp1')}  # the run's calls time it (at its load's rows)
  order = schedule.ProfileScheduler.order_wanted(
    _Wanting(), None, cost=cost.__getitem__, running=running
  )
  assert order == cheapest_first[:1] + [train_lead] + [
    c for c in cheapest_first[1:] if c != train_lead
  ]

  class TwoTrainLayouts(_Wanting):
    MEASURED: ClassVar = {**_Wanting.MEASURED, Stage.TRAIN: (('dp8.tp1', 32), ('dp2.tp4', 64))}

  order = schedule.ProfileScheduler.order_wanted(
    TwoTrainLayouts(), None, cost=cost.__getitem__, running=running
  )
  assert order == cheapest_first


def measured_run(workdir: str, steps: int) -> dict:
  """The smoke preset with a measured, lazily completed rollout profile (every process runs
  this): the decisions and the measured cells it ended with (a multi-process body)."""
  import jax

  from earl_jax.train import trainer

  base = smoke_experiment(steps=steps, eval_every=0, checkpoint_every=0)
  profile = ProfileSettings(
    stages=('rollout', 'experience'),
    lazy=True,
    max_share=1.0,
    measure=MeasureConfig(repeats=3, rounds=1),
  )
  config = dataclasses.replace(base, selector=dataclasses.replace(base.selector, profile=profile))
  t = trainer.Trainer(config, workdir=workdir, log_fn=lambda _: None)
  for _ in range(steps):
    # Between steps, every background compile (the run's and the profile's) is let finish, as
    # a quiet machine would: a loaded one (CI) may otherwise keep one going through every step,
    # and then nothing is timed, by design.
    t.step()
    t.executables.wait()
    t.scheduler.wait_compiles()
  summary = t.run(progress=False)  # no step left: closes the run
  cells = t.selector.profile(Stage.ROLLOUT).measured_only().to_json()['cells']
  return {
    'process': jax.process_index(),
    'decisions': [
      (d['stage'], d['config'], d['bucket'], d['reason']) for d in summary['decisions']
    ],
    'cells': sorted((c['stage'], c['bucket'], c['config'], c['throughput']) for c in cells),
  }


@pytest.mark.multiprocess
def test_two_processes_measure_the_same_cells_and_decide_alike(tmp_path):
  """Each process compiles in the background at its own pace; only cells compiled on both are
  timed, the figures are process 0's, and every decision is the same on both."""
  one, two = multiprocess.run(
    'tests.profiling.schedule_test:measured_run',
    num_processes=2,
    devices_per_process=4,
    kwargs={'workdir': str(tmp_path / 'run'), 'steps': 8},
    timeout=600,
  )
  assert one['decisions'] == two['decisions'] and one['cells'] == two['cells']
  assert one['cells'], 'nothing was measured in 8 steps'
  assert 'measured: none' in one['decisions'][0][3]


class _Compiler:
  """A profiler as `ProfileScheduler._pump` reads it: every compile done at once, in 5 s."""

  def __init__(self):
    self.started = []

  def compile(self, cell):
    from concurrent import futures

    self.started.append(cell)
    done = futures.Future()
    done.set_result(5.0)
    return done

  def compiled_here(self, cell):
    return cell in self.started


def test_background_compiles_keep_within_the_share(monkeypatch):
  """The profile's compiles take at most `compile_share` of the run's time, each counted at the
  median of those done so far: 60 s into a run at 10%, one 5 s compile, and a second would take
  10 s of the 6 s."""
  now = [0.0]
  monkeypatch.setattr(schedule.time, 'perf_counter', lambda: now[0])
  compiler = _Compiler()
  settings = ProfileSettings(stages=('rollout',), lazy=True, compile_share=0.1)
  with unchecked():  # a stand-in for the Profiler
    scheduler = schedule.ProfileScheduler(compiler, None, settings=settings)
  cells = [(Stage.ROLLOUT, 128, 16, n) for n in ('dp8.tp1', 'dp4.tp2', 'dp2.tp4')]
  scheduler._queue = dict.fromkeys(cells, 0.0)
  now[0] = 60.0
  scheduler._pump()  # nothing known of a compile's cost yet: IN_FLIGHT (1) of them start
  assert compiler.started == cells[:1]
  scheduler._pump()  # done, 5 s spent of the 6 s allowed: a second would make 10
  assert compiler.started == cells[:1]
  now[0] = 100.0  # 10 s allowed: 5 + 5 fits (the first timed meanwhile)
  scheduler._queue = dict.fromkeys(cells[1:], 0.0)
  scheduler._pump()
  assert compiler.started == cells[:2]
  scheduler._pump()  # 10 s spent: a third waits for 150 s
  assert compiler.started == cells[:2]
  now[0] = 150.0
  scheduler._queue = dict.fromkeys(cells[2:], 0.0)  # the second timed meanwhile
  scheduler._pump()
  assert compiler.started == cells


def test_a_compile_over_the_budget_is_passed_by_a_cheaper_stages_behind_it(monkeypatch):
  """Each compile is counted at its stage's median: with a train compile done in 20 s and an
  experience one in 2 s, 250 s into a run at 10% (25 s), a second train compile (20 more) waits
  and the experience cell behind it starts (2 more; done in 5); the train cell starts once 47 s
  are allowed."""
  from concurrent import futures

  now = [0.0]
  monkeypatch.setattr(schedule.time, 'perf_counter', lambda: now[0])
  compiler = _Compiler()
  settings = ProfileSettings(stages=('experience', 'train'), lazy=True, compile_share=0.1)
  with unchecked():  # a stand-in for the Profiler
    scheduler = schedule.ProfileScheduler(compiler, None, settings=settings)
  for cell, seconds in (((Stage.TRAIN, 128, 16, 'dp8.tp1'), 20.0), ((Stage.EXPERIENCE, 128, 16, 'dp8.tp1'), 2.0)):  # fmt: skip
    scheduler._compiling[cell] = futures.Future()
    scheduler._compiling[cell].set_result(seconds)
  train, experience = (Stage.TRAIN, 256, 16, 'dp4.tp2'), (Stage.EXPERIENCE, 256, 16, 'dp4.tp2')
  scheduler._queue = {train: 0.0, experience: 0.0}
  now[0] = 250.0
  scheduler._pump()
  assert compiler.started == [experience]
  scheduler._queue = {train: 0.0}  # the experience cell compiled (in 5 s) and timed
  now[0] = 460.0  # 46 s allowed: 27 + 20 does not fit
  scheduler._pump()
  assert compiler.started == [experience]
  now[0] = 470.0
  scheduler._pump()
  assert compiler.started == [experience, train]


def test_a_compiled_cell_holds_compiles_back_only_while_it_fits_the_share(monkeypatch):
  """While a compiled cell waits to be timed and fits the share, the compiles drain (so that the
  next step boundary is quiet); one the share does not allow yet holds nothing back."""
  now = [0.0]
  monkeypatch.setattr(schedule.time, 'perf_counter', lambda: now[0])
  compiler = _Compiler()
  settings = ProfileSettings(stages=('rollout',), lazy=True, compile_share=1.0, max_share=0.1)
  with unchecked():  # a stand-in for the Profiler
    scheduler = schedule.ProfileScheduler(compiler, None, settings=settings)
  ready, *others = [(Stage.ROLLOUT, 128, 16, n) for n in ('dp8.tp1', 'dp4.tp2', 'dp2.tp4')]
  compiler.started.append(ready)  # compiled
  now[0] = 100.0  # 10 s of the share to spend
  scheduler._queue = {ready: 30.0, others[0]: 0.0}  # 30 s of calls: not yet
  scheduler._pump()
  assert compiler.started == [ready, others[0]]
  scheduler._queue = {ready: 5.0, others[1]: 0.0}  # 5 s: timed at the next boundary
  scheduler._pump()
  assert compiler.started == [ready, others[0]]


def test_the_boundary_line_names_the_share_and_each_wanted_cells_state(monkeypatch):
  """`describe` (logged at --verbosity=1 after each step boundary): the share spent and allowed,
  the background compiles' seconds (done as they took, under way at the median of their stage's)
  and what `compile_share` allows, and the wanted cells in order, each compiled ('ready'),
  compiling or queued."""
  from concurrent import futures

  now = [0.0]
  monkeypatch.setattr(schedule.time, 'perf_counter', lambda: now[0])
  compiler = _Compiler()
  compiler.busy = lambda: False
  settings = ProfileSettings(stages=('rollout',), lazy=True, max_share=0.1, compile_share=0.3)
  with unchecked():  # a stand-in for the Profiler
    scheduler = schedule.ProfileScheduler(compiler, None, settings=settings)
  ready, running, waiting = [(Stage.ROLLOUT, 128, 16, n) for n in ('dp8.tp1', 'dp4.tp2', 'dp2.tp4')]
  compiler.started.append(ready)
  scheduler._compiling[ready] = futures.Future()
  scheduler._compiling[ready].set_result(2.5)  # took 2.5 s
  scheduler._compiling[running] = futures.Future()  # not done: 2.5 s, as the done one took
  scheduler._queue = {ready: 0.25, running: 0.5, waiting: 1.0}
  now[0] = 40.0
  line = scheduler.describe(1.5, held=True)
  assert line.startswith(
    'timed 1.5 s; spent 0.0 of 4.0 s; compiles 5.0 of 12.0 s; quiet False; held True; wanted 3: '
  )
  assert line.endswith(
    'rollout@128/16:dp8.tp1 0.2s ready, rollout@128/16:dp4.tp2 0.5s compiling, '
    'rollout@128/16:dp2.tp4 1.0s queued'
  )
