"""A run's profile measurements: which cells are timed, when, and within what share of the run.

`ProfileScheduler` holds the measured profile the selector ranks its profiled stages by, and
completes it as the run goes (`ProfileSettings`):

- not `lazy`: every bucket measured at start-up (`Profiler.start`);
- `lazy` without `prior`: a decision waits while the buckets it needs are measured whole;
- `lazy` with `prior` (the default): no decision waits. The selector decides on the cost model
  (`cost_model`) where a cell is not measured yet. The cells its coming decisions would rank by
  (`Selector.wanted`: those the model cannot rule out, and every layout at the longest bucket
  reached) and those of the next bucket up are compiled in the background as soon as they are
  wanted (`before_decision`; at most `IN_FLIGHT` at a time, the most wanted first), and timed at
  the start of a later step, while the devices are idle, once compiled on every process
  (`between_steps`), within `max_share` of the run's time. The stages take turns, one cell each,
  the needed buckets before the next one up, so that no stage waits for another's cells: every
  stage, train included, is measured at a new bucket before its decisions there rest on the
  model alone.

What is wanted, timed and when is decided from what every process holds alike (the selector's
state, the measured cells, which programs every process has compiled, process 0's clock), and
the figures are process 0's.

  scheduler = ProfileScheduler.start(sel_cfg, model=cfg, buckets=table, rows=(16, 64),
                                     stage_rows={Stage.ROLLOUT: 16}, spec=spec,
                                     executables=exe)
  selector = Selector(sel_cfg, ..., profile=scheduler.profile)
  scheduler.between_steps(selector, prev_stats)     # at the start of a step: time what is ready
  scheduler.before_decision(selector, stage, stats)  # queue (or, without the prior, measure)
"""

import itertools
import statistics
import time
from collections.abc import Mapping, Sequence
from concurrent import futures

import jax
from absl import logging

from earl_jax import distributed
from earl_jax.config import BucketConfig, ModelConfig
from earl_jax.profiling import cost_model, profiler
from earl_jax.profiling.table import CellKey, Profile, ProfileSettings
from earl_jax.programs import Executables, StageSpec
from earl_jax.selector import selector as selector_lib
from earl_jax.stage import Stage


class _Share:
  """Process 0's account of measuring between steps: a cell is timed when the time spent
  measuring, with the cell's estimate, stays within `max_share` of the run's time so far. The
  estimate is the cell's calls at the cost model's figure, plus the median of what the cells
  timed so far took beyond their calls (moving the weights to the layout, making the inputs:
  a cost per cell, not per call, so that a cheap cell's overhead does not price an expensive
  cell out)."""

  def __init__(self, max_share: float):
    self.max_share = max_share
    self.start = time.perf_counter()
    self.spent = 0.0
    self._extra: list[float] = []
    self._cell: tuple[float, float] | None = None  # (started, calls' estimate) of the last

  @property
  def overhead_s(self) -> float:
    return statistics.median(self._extra) if self._extra else 0.0

  def allows(self, calls_s: float) -> bool:
    now = time.perf_counter()
    self.done(now)
    ok = self.spent + calls_s + self.overhead_s <= self.max_share * (now - self.start)
    self._cell = (now, calls_s) if ok else None
    return ok

  def done(self, now: float | None = None) -> None:
    """The last cell allowed is over (by `now`): its time is spent, its overhead learnt."""
    if self._cell is None:
      return
    now = time.perf_counter() if now is None else now
    started, calls_s = self._cell
    self.spent += now - started
    if calls_s > 0:
      self._extra.append(max(0.0, now - started - calls_s))
    self._cell = None


class ProfileScheduler:
  """A run's measured profile and when its cells are measured (see the module docstring)."""

  IN_FLIGHT = 2  # background profile compiles at a time (a run's exit waits for these only)

  def __init__(
    self,
    measurer: profiler.Profiler | None,
    profile: Profile | None,
    *,
    settings: ProfileSettings,
  ):
    """Use `ProfileScheduler.start`."""
    self._profiler = measurer
    self._settings = settings
    self.profile = profile  # None: the selector decides on the analytic model only
    self._queue: dict[CellKey, None] = {}  # wanted, most wanted first
    self._compiling: dict[CellKey, futures.Future] = {}
    self._failed: set[CellKey] = set()  # whose compile raised: never timed
    self._share = _Share(settings.max_share)
    self.spent_s = 0.0  # spent timing cells between steps
    self._params = None  # the random weights cells are timed with, kept between steps

  @classmethod
  def start(
    cls,
    config: selector_lib.SelectorConfig,
    *,
    model: ModelConfig,
    buckets: BucketConfig,
    rows: int | Sequence[int],
    spec: StageSpec,
    executables: Executables,
    stage_rows: Mapping[Stage, int] | None = None,
    base: Profile | None = None,
    given: Profile | None = None,
  ) -> 'ProfileScheduler':
    """The start-up profile of `config.profile.stages`: `given` when passed, else every
    candidate program of those stages compiled and timed at every bucket (with `lazy`: none
    yet), or what the cache holds when it was made for exactly this setup. `rows`: the load
    bins; `stage_rows`: a stage's one row count (the rollout's slots). `base`: cells measured
    before (the checkpoint a resume continues from), preferred to the cache's."""
    settings = config.profile
    if not settings.stages:
      return cls(None, given, settings=settings)
    measurer = profiler.Profiler.for_selector(
      config,
      model=model,
      buckets=buckets,
      rows=rows,
      spec=spec,
      executables=executables,
      base=base,
      stage_rows=stage_rows,
    )
    profile = given if given is not None else measurer.start(measure=not settings.lazy)
    return cls(measurer, profile, settings=settings)

  @property
  def _background(self) -> bool:
    return self._profiler is not None and self._settings.lazy and self._settings.prior

  def before_decision(
    self, selector: selector_lib.Selector, stage: Stage, stats: selector_lib.StepStats | None
  ) -> float:
    """Before a decision of `stage` on `stats`: without the prior, measures the buckets a lazy
    profile lacks for it (handing them to `selector`); with it, only queues the cells
    `selector` wants measured for compiling. Returns the seconds the decision waited."""
    if self._background:
      for ahead in (False, True):
        for cell in selector.wanted(stage, stats, ahead=ahead):
          self._queue.setdefault((stage, *cell))
      self._pump()
      return 0.0
    if self._profiler is None or not self._settings.lazy:
      return 0.0
    profile, seconds = self._profiler.measure_missing(selector, stage, stats)
    self.profile = profile or self.profile
    return seconds

  def wait_compiles(self) -> None:
    """Waits for the background profile compiles under way (a benchmark's or a test's
    synchronisation point; a run never waits for them)."""
    for running in list(self._compiling.values()):
      running.result()

  def _ready_here(self, cell: CellKey) -> bool:
    """This process has compiled the program of `cell` (and, where it does, prepared it)."""
    running = self._compiling.get(cell)
    return (running is None or running.done()) and self._profiler.compiled_here(cell)

  def _pump(self) -> None:
    """Keeps `IN_FLIGHT` compiles of the most wanted cells going (a cell compiled already, being
    compiled, or whose compile failed is skipped: the model's figure stays), except while the
    most wanted cell is compiled and waits to be timed (then the compiles under way drain, so
    that `between_steps` times it with no compile beside it), and within the compile budget:
    the profile's background compiles take at most `compile_share` of the run's time, a compile
    counted at the median of those done so far (a compile takes a core from the steps)."""
    head = next((c for c in self._queue if c not in self._failed), None)
    if head is not None and self._ready_here(head):
      return
    busy = sum(not f.done() for f in self._compiling.values())
    done = [f.result() for f in self._compiling.values() if f.done() and not f.exception()]
    spent = sum(done)
    each = statistics.median(done) if done else 0.0
    allowed = self._settings.compile_share * (time.perf_counter() - self._share.start)
    for cell in self._queue:
      if busy >= self.IN_FLIGHT:
        return
      running = self._compiling.get(cell)
      if running is not None and not running.done():
        continue
      if running is not None and running.exception() is not None:
        if cell not in self._failed:
          self._failed.add(cell)
          logging.warning('profile: %s is left to the model: %s', cell, running.exception())
        continue
      if self._profiler.compiled_here(cell):
        continue
      if spent + (busy + 1) * each > allowed:
        return
      self._compiling[cell] = self._profiler.compile(cell)
      busy += 1

  def between_steps(
    self, selector: selector_lib.Selector, stats: selector_lib.StepStats | None
  ) -> float:
    """At the start of a step (`stats`: the previous one's; None: the first step, which never
    waits): times the cells `selector` wants, one at a time in the order of `_wanted`, as far as
    every process has compiled them and while within `max_share` of the run's time (`_Share`),
    and hands them to `selector`. Returns the seconds spent."""
    if not self._background or stats is None:
      return 0.0
    wanted = self._wanted(selector, stats)
    self._queue = dict.fromkeys(wanted)  # what is no longer wanted is not compiled
    if not wanted:
      return 0.0
    # In the order wanted, up to the first cell not compiled on every process yet (the most
    # wanted cells are timed first, not passed by cheaper ones), and only while no compile runs
    # on any process, the profile's or the run's own precompiles (a compile takes a core: the
    # timings it overlaps are slower, and more so for layouts whose collectives wait on every
    # device).
    wanted = [c for c in wanted if c not in self._failed]
    quiet = all(f.done() for f in self._compiling.values()) and not self._profiler.busy()
    quiet, *held = self._profiler.agreed([quiet] + [self._ready_here(c) for c in wanted])
    ready = list(itertools.takewhile(lambda pair: pair[1], zip(wanted, held)))
    ready = [c for c, _ in ready]
    if not ready or not quiet:
      self._pump()
      return 0.0
    t0 = time.perf_counter()

    def proceed(stage: Stage, bucket: int, rows: int, names: Sequence[str]) -> bool:
      ok = None
      if jax.process_index() == 0:  # process 0's clock decides, for every process
        ok = self._share.allows(self._calls_s(selector.profile(stage), stage, bucket, rows, names))
      return bool(distributed.broadcast_json(ok))

    measured, self._params = self._profiler.measure_cells(
      self.profile, ready, proceed=proceed, params=self._params
    )
    seconds = time.perf_counter() - t0
    self._share.done()
    self.spent_s += seconds
    if measured is not self.profile:
      new = len(measured.cells) - len(self.profile.cells)
      self.profile = measured
      selector.use_profile(measured)
      for cell in measured.cells:
        self._queue.pop(cell, None)
      logging.info(
        'profile: %d cells timed between steps in %.1f s (%.1f s in all, %.2f s a cell beyond '
        'its calls)',
        new,
        seconds,
        self.spent_s,
        self._share.overhead_s,
      )
    self._pump()
    return seconds

  @staticmethod
  def _wanted(selector, stats) -> list[CellKey]:
    """Every profiled stage's wanted cells, the needed buckets' before the next one up, the
    stages taking turns one cell at a time (each stage's most promising first), the stage with
    the fewest measured cells where it wants some first: a stage measured nowhere at a bucket
    is measured there before the others are measured again."""
    out: list[CellKey] = []
    for ahead in (False, True):
      per_stage = [
        [(stage, *cell) for cell in selector.wanted(stage, stats, ahead=ahead)]
        for stage in selector.config.profile.stages
      ]
      per_stage.sort(key=lambda cells: _measured_at(selector, cells[0]) if cells else 0)
      turns = itertools.zip_longest(*per_stage)
      out += [cell for turn in turns for cell in turn if cell is not None and cell not in out]
    return out

  def _calls_s(self, profile: Profile, stage: Stage, bucket: int, rows: int, names) -> float:
    """The seconds of the calls timing `names` at (stage, bucket, rows) makes, by the cost
    model's figures (0 where those are the analytic model's nominal ones)."""
    measure = self._profiler.config.measure
    calls = measure.rounds * (measure.warmup + measure.repeats)
    decode = self._profiler.config.spec.decode_tokens
    total = 0.0
    for name in names:
      cell = profile.cell(stage, bucket, rows, name)
      if cell.prior != cost_model.ANALYTIC and cell.throughput:
        total += calls * cost_model.seconds_per_call(cell, decode)
    return total

  def compile_ms(self, stage: Stage, bucket: int, rows: int, layout: str) -> float:
    """The profiled compile time of a program (0 when not profiled)."""
    cell = None if self.profile is None else self.profile.cells.get((stage, bucket, rows, layout))
    return cell.compile_ms if cell is not None and cell.compile_ms else 0.0


def _measured_at(selector, cell: CellKey) -> int:
  """How many layouts of `cell`'s stage are measured at its bucket and rows (`selector`: a
  `Selector`, or what reads as one: its `profile(stage)`)."""
  stage, bucket, rows, _ = cell
  cells = selector.profile(stage).cells
  return sum(
    1
    for c in selector.profile(stage).candidates(stage)
    if (k := (stage, bucket, rows, c.name)) in cells and cells[k].measured
  )
