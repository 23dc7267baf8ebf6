"""A run's profile measurements: which cells are timed, when, and within what share of the run.

`ProfileScheduler` holds the measured profile the selector ranks its profiled stages by, and
completes it as the run goes (`ProfileSettings`):

- not `lazy`: every bucket measured at start-up (`Profiler.start`);
- `lazy` without `prior`: a decision waits while the buckets it needs are measured whole;
- `lazy` with `prior` (the default): no decision waits. The selector decides on the cost model
  (`cost_model`) where a cell is not measured yet. The cells its coming decisions would rank by
  (`Selector.wanted`: those the model cannot rule out, and every layout at the longest bucket
  reached), those of the next bucket up, and a second bucket for each layout measured at one
  only (the shortest the stage has decided at) are compiled in the background as soon as they are
  wanted (`before_decision`; at most `IN_FLIGHT` at a time, the most wanted first that fits the
  compile budget, `compile_share`), and timed at the start of a later step, while the devices
  are idle, once compiled on every process (`between_steps`), within `max_share` of the run's
  time. The needed buckets come before the next one up, and that before the second buckets;
  within each, a cell per stage leads: a stage measured nowhere yet with its cheapest cell (so
  that every stage, train included, is measured before its decisions rest on the analytic prior
  alone), and a stage with fewer than two layouts measured where its latest decision ran with
  the layout it runs there where that is wanted
  (the selector keeps a layout it barely knows until it is measured), else its most promising
  cell there (so that a new bucket's ranking rests on measurements soon, whichever stage is
  cheapest to measure); then the cheapest cells go first, their compile and calls counted,
  whatever their stage (`order_wanted`): as many cells as the share allows, and a cell over
  what it allows yet is passed by those behind it that fit (the share it needs accrues
  meanwhile). While the profile compiles a cell, and while a compiled cell that fits waits for a
  step boundary with no compile under way, the run's own speculative precompiles that have not
  started yet wait (`Executables.hold`, agreed by every process), so that the next boundary is
  quiet: one started beside the profile's compile (5-20 s on a loaded 2-core host) would keep
  the cell waiting step after step. Last, once no cell of its stage and bucket that could beat
  the best waits to be measured (`Selector.wanted(contenders=True)`: not another stage's, nor a
  layout the bounds rank below, wanted only because the longest bucket measures every layout),
  a measured cell within its noise of the best measured one where a decision ranks and runs
  (and that best) is timed again, its calls pooled with the first session's
  (`ProfileSettings.retimes`, `Selector.wanted(again=True)`): one session's calls understate
  the noise between sessions (10-20% mid-run on a loaded 2-core host).

The run's own calls are measurements too (`observing`): the experience and train programs the
run's steps call are timed where nothing compiled beside them. A step's call runs at its packed
batch's rows, which change from step to step, so a call after its program's first is a sample
per token of its layout at its bucket, and `SAMPLES` of them make a measured cell at the latest
call's rows (`Cell.timed_by` 'run'). Where the run's latest call of a stage ran the layout of its
latest decision at that bucket, and the model knows that layout there (`_run_timed`), the
profile leaves it to the run's calls (its curve through their cell carries it to the load's
rows), and its calls go to the layouts the run is not on; where the cell it runs is wanted
again, the run's calls time it again. They get `PATIENCE` step boundaries to do so: then the
profile measures the cell (the run's precompiles can deny them a quiet call for many steps).
Where the model barely knows the layout a stage runs (measured nowhere near: the selector holds
it until it is), the profile first times the program the run runs, at its latest call's rows:
compiled already, so that every stage, train included, is measured as soon as a boundary is
quiet, with no compile of the profile's (`_placer`).

What is wanted, timed and when is decided from what every process holds alike (the selector's
state, the measured cells, which programs every process has compiled, process 0's clock), and
the figures are process 0's.

  scheduler = ProfileScheduler.start(sel_cfg, model=cfg, buckets=table, rows=(16, 64),
                                     stage_rows={Stage.ROLLOUT: 16}, spec=spec,
                                     executables=exe)
  selector = Selector(sel_cfg, ..., profile=scheduler.profile)
  scheduler.between_steps(selector, prev_stats)     # at the start of a step: time what is ready
  scheduler.before_decision(selector, stage, stats)  # queue (or, without the prior, measure)
  with scheduler.observing(program):                 # a call the run makes: a sample
    program(*args)
"""

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures

import jax
from absl import logging

from earl_jax import distributed
from earl_jax.config import BucketConfig, ModelConfig
from earl_jax.profiling import cost_model, profiler
from earl_jax.profiling.table import Cell, CellKey, Profile, ProfileSettings, poolable, pooled
from earl_jax.programs import Executable, Executables, ProgramKey, StageSpec
from earl_jax.selector import selector as selector_lib
from earl_jax.stage import Stage

# What `Selector.wanted` is asked for, most wanted first: the cells the coming decisions rank and
# run at, the next bucket up's, a second bucket for each layout measured at one only, and the
# measured cells within their noise of the best, to time again.
_TO_MEASURE = ({}, {'ahead': True}, {'second': True})
_KINDS = (*_TO_MEASURE, {'again': True})

# The stages the run's own calls measure (`ProfileScheduler.observing`): a call each per step, or a
# few; the rollout engine makes many a step, between the environment's turns.
OBSERVED = (Stage.EXPERIENCE, Stage.TRAIN)


class _Share:
  """A process's account of measuring between steps (process 0's decides): a cell is timed when
  the time spent measuring, with the cell's estimate, stays within `max_share` of the run's time
  so far. The
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

  def fits(self, calls_s: float, now: float | None = None) -> bool:
    """Whether a cell of `calls_s` seconds of calls fits the share now (nothing recorded)."""
    now = time.perf_counter() if now is None else now
    return self.spent + calls_s + self.overhead_s <= self.max_share * (now - self.start)

  def allows(self, calls_s: float) -> bool:
    """`fits`, and if so the cell starts now (its time is spent at `done`)."""
    now = time.perf_counter()
    self.done(now)
    ok = self.fits(calls_s, now)
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

  # Background profile compiles at a time (a run's exit waits for these only): one, so that a
  # compiled cell is timed at the next boundary with no other compile of the profile's beside it.
  IN_FLIGHT = 1
  SAMPLES = 3  # the run's own calls a cell is the median of (after its first, a warm-up)
  # The step boundaries the run's own calls get to time a cell a stage runs (`_run_timed`) while
  # it is wanted, before the profile measures it: a call is kept only with nothing compiling
  # beside it, and the run's own precompiles (a program per packed row count and neighbouring
  # bucket) can keep every call of a stage company for dozens of steps.
  PATIENCE = 3

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
    self._queue: dict[CellKey, float] = {}  # wanted, most wanted first: their calls' seconds
    self._compiling: dict[CellKey, futures.Future] = {}
    self._failed: set[CellKey] = set()  # whose compile raised: never timed
    self._share = _Share(settings.max_share)
    self.spent_s = 0.0  # spent timing cells between steps
    self._params = None  # the random weights cells are timed with, kept between steps
    # The run's own calls' ms per token, after each program's first, per (stage, bucket, layout).
    self._calls: dict[tuple[Stage, int, str], list[float]] = {}
    self._warm: set[ProgramKey] = set()  # the programs the run has called
    self._observed: dict[CellKey, Cell] = {}  # complete, not yet in the profile
    # Per OBSERVED stage, the latest call the run made: (tokens, seconds), process 0's as of the
    # latest step boundary (what a cell's calls are priced at before the model knows the stage).
    self._latest: dict[Stage, tuple[int, float]] = {}
    self._latest_here: dict[Stage, tuple[int, float]] = {}
    # Per OBSERVED stage, the cell of the run's latest call (process 0's, as of the latest step
    # boundary, and this process's since).
    self._ran: dict[Stage, CellKey] = {}
    self._ran_here: dict[Stage, CellKey] = {}
    # The measured cells the stages run now that are wanted again (`Selector.wanted(again=True)`):
    # the run's own calls time them again (`observing`).
    self._again: set[CellKey] = set()
    # The step boundaries each cell has been left to the run's own calls while wanted.
    self._left: dict[CellKey, int] = {}
    # Whether the run's speculative precompiles are held (`Executables.hold`; the same on every
    # process): while a compiled cell that fits the share waits for a step boundary with no
    # compile under way.
    self.holding = False

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
    `selector` wants measured for compiling (not the re-times: their programs are compiled,
    and the queue of the latest boundary holds those not held, `_held_retimes`). Returns the
    seconds the decision waited."""
    if self._background:
      place = self._placer(selector)
      for kind in _TO_MEASURE:
        for cell in _cells(stage, selector.wanted(stage, stats, **kind)):
          if (timed := place(cell)) is not None:
            self._queue.setdefault(timed, self._cell_s(selector, timed))
      self._pump()
      return 0.0
    if self._profiler is None or not self._settings.lazy:
      return 0.0
    profile, seconds = self._profiler.measure_missing(selector, stage, stats)
    self.profile = profile or self.profile
    return seconds

  def quiet(self) -> bool:
    """Nothing compiles in the background here, the profile's programs or the run's own."""
    return not self._compiling_here() and not (self._profiler is not None and self._profiler.busy())

  @contextlib.contextmanager
  def observing(self, program: Executable):
    """Times the call of `program` (a stage program the run's step calls) made inside, blocked
    on, as a sample of its layout at its bucket: kept when nothing compiled in the background as
    it began and ended, and after the program's first call (a warm-up). The rows a call runs at
    are its packed batch's, which change from step to step: a sample is kept per token, and
    `SAMPLES` of them make a measured cell at the latest call's rows (`Cell.timed_by` 'run'),
    which `between_steps` adds to the profile (pooled with the cell's earlier calls where it is
    measured and wanted again). Only the `OBSERVED` stages' programs; a layout the run's calls
    have timed at a bucket is not sampled there again unless wanted again."""
    key = program.key
    cell = (key.stage, key.bucket, key.rows, key.config.name)
    if key.stage in OBSERVED:
      self._ran_here[key.stage] = cell
    if (
      not self._background
      or key.stage not in OBSERVED
      or key.stage not in self._settings.stages
      or cell in self._observed
      or (self._run_measured(cell) and cell not in self._again)
    ):
      yield
      return
    quiet = self.quiet()
    t0 = time.perf_counter()
    yield
    ms = 1e3 * (time.perf_counter() - t0)
    tokens = program.program.tokens
    self._latest_here[key.stage] = (tokens, ms / 1e3)
    if key not in self._warm:
      self._warm.add(key)  # the first call of a program warms it up
    elif quiet and self.quiet():
      layout = (key.stage, key.bucket, key.config.name)
      per_token = self._calls.setdefault(layout, [])
      per_token.append(ms / tokens)
      if len(per_token) >= self.SAMPLES:
        times = [t * tokens for t in self._calls.pop(layout)]
        self._observed[cell] = dataclasses.replace(
          profiler.timed_cell(program, times), timed_by='run'
        )

  def _run_measured(self, cell: CellKey) -> bool:
    """`cell` is measured, or the run's own calls timed its layout at its bucket (any rows)."""
    stage, bucket, _, name = cell
    if self._measured(cell):
      return True
    cells = () if self.profile is None else self.profile.cells.values()
    return any(
      c.stage == stage and c.bucket == bucket and c.config == name and c.timed_by == 'run'
      for c in cells
      if c.measured and c.throughput
    )

  def _measured(self, cell: CellKey) -> bool:
    got = None if self.profile is None else self.profile.cells.get(cell)
    return got is not None and got.measured

  def _add_observed(self, selector: selector_lib.Selector) -> None:
    """Adds the cells the run's own calls completed (`observing`) to the profile: process 0's,
    on every process; a cell measured already is pooled with them while it has been timed in at
    most `retimes` sessions."""
    mine = {
      'cells': [c.as_dict() for c in self._observed.values()],
      'latest': {str(s): list(v) for s, v in self._latest_here.items()},
      'ran': {str(s): [str(c[0]), *c[1:]] for s, c in self._ran_here.items()},
    }
    new = distributed.broadcast_json(mine if jax.process_index() == 0 else None)
    self._observed.clear()
    self._latest = {Stage.parse(s): (int(t), float(x)) for s, (t, x) in new['latest'].items()}
    self._ran = {
      Stage.parse(s): (Stage.parse(c[0]), int(c[1]), int(c[2]), str(c[3]))
      for s, c in new['ran'].items()
    }
    cells = {}
    for data in new['cells']:
      cell = Cell.from_dict(data)
      key = (cell.stage, cell.bucket, cell.rows, cell.config)
      if not self._measured(key):
        cells[key] = cell
      elif (
        poolable(earlier := self.profile.cells[key], cell)
        and earlier.sessions <= self._settings.retimes
      ):
        cells[key] = pooled(earlier, cell)
    if not cells:
      return
    self.profile = self.profile.merged(Profile(key=self.profile.key, cells=cells))
    selector.use_profile(self.profile)
    self._profiler.save(self.profile)
    logging.info("profile: %d cells timed from the run's own calls", len(cells))

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
    compiled, or whose compile failed is skipped: the model's figure stays), except while a
    wanted cell is compiled and fits the share now (then the compiles under way drain, so that
    `between_steps` times it with no compile beside it), and within the compile budget:
    the profile's background compiles take at most `compile_share` of the run's time, a compile
    counted at the median of its stage's done so far (of any stage's before one), and one that
    does not fit yet passed by those behind it that do (a train program takes 5-10 times an
    experience program's compile; a compile takes a core from the steps)."""
    live = [c for c in self._queue if c not in self._failed]
    if any(self._ready_here(c) and self._share.fits(self._queue[c]) for c in live):
      return
    committed, allowed, each, busy = self._compile_budget()
    for cell in self._queue:
      if len(busy) >= self.IN_FLIGHT:
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
      if committed + each(cell) > allowed:
        continue  # passed by a cheaper compile behind it, while the budget accrues
      self._compiling[cell] = self._profiler.compile(cell)
      busy.append(cell)
      committed += each(cell)

  def _compile_budget(self) -> tuple[float, float, Callable[[CellKey], float], list[CellKey]]:
    """The profile's background compiles against `compile_share`: (the seconds committed,
    those done as they took and those under way at `each`'s estimate; the seconds allowed by
    now; `each`, a cell's compile at the median of its stage's done ones, or of any stage's
    before one; the cells compiling)."""
    busy = [c for c, f in self._compiling.items() if not f.done()]
    done = {c: f.result() for c, f in self._compiling.items() if f.done() and not f.exception()}
    by_stage: dict[Stage, list[float]] = {}
    for cell, seconds in done.items():
      by_stage.setdefault(cell[0], []).append(seconds)

    def each(cell: CellKey) -> float:
      took = by_stage.get(cell[0]) or list(done.values())
      return statistics.median(took) if took else 0.0

    committed = sum(done.values()) + sum(each(c) for c in busy)
    allowed = self._settings.compile_share * (time.perf_counter() - self._share.start)
    return committed, allowed, each, busy

  def between_steps(
    self, selector: selector_lib.Selector, stats: selector_lib.StepStats | None
  ) -> float:
    """At the start of a step (`stats`: the previous one's; None: the first step, which never
    waits): times the cells `selector` wants, one at a time in the order of `_wanted`, as far as
    every process has compiled them and while within `max_share` of the run's time (`_Share`),
    and hands them to `selector`, with the cells the run's own calls completed (`observing`).
    While a compiled cell that fits waits for a quiet boundary, the run's queued precompiles are
    held until the next one (`Executables.hold`). Returns the seconds spent."""
    if not self._background or stats is None:
      return 0.0
    self._add_observed(selector)
    self._count_left(selector, stats)
    self._again = {
      cell
      for cell in self._run_timed(selector)
      if cell[1:] in selector.wanted(cell[0], stats, again=True)
    }
    seconds, held = self._measure_ready(selector, stats)
    self._pump()
    # While the profile compiles a cell, the run's speculative precompiles wait too: each takes
    # a core for 5-20 s, and one started beside the cell's compile would still run when the cell
    # is ready, so that it would wait for a quiet boundary step after step.
    held = bool(distributed.process_max([int(held or self._compiling_here())])[0])
    self.holding = held
    self._profiler.executables.hold(held)
    if logging.vlog_is_on(1):
      logging.vlog(1, 'profile: %s', self.describe(seconds, held))
    return seconds

  def _compiling_here(self) -> bool:
    """A profile compile is under way on this process."""
    return any(not f.done() for f in self._compiling.values())

  def describe(self, seconds: float = 0.0, held: bool = False) -> str:
    """One line on where the profile stands at a step boundary (`--verbosity=1` logs it after
    each): the share spent and allowed, the background compiles' seconds and what
    `compile_share` allows, what compiles, and the wanted cells in order, each with
    its calls' seconds and whether it is compiled here ('ready'), compiling, or failed."""
    now = time.perf_counter()
    allowed = self._share.max_share * (now - self._share.start)
    compiles, compiles_allowed, *_ = self._compile_budget()

    def state(cell: CellKey) -> str:
      if cell in self._failed:
        return 'failed'
      running = self._compiling.get(cell)
      if running is not None and not running.done():
        return 'compiling'
      return 'ready' if self._profiler.compiled_here(cell) else 'queued'

    cells = ', '.join(
      f'{s}@{b}/{r}:{name} {calls:.1f}s {state((s, b, r, name))}'
      for (s, b, r, name), calls in list(self._queue.items())[:8]
    )
    more = len(self._queue) - 8
    return (
      f'timed {seconds:.1f} s; spent {self._share.spent:.1f} of {allowed:.1f} s; compiles '
      f'{compiles:.1f} of {compiles_allowed:.1f} s; quiet '
      f'{self.quiet()}; held {held}; wanted {len(self._queue)}: {cells}'
      + (f' (+{more})' if more > 0 else '')
    )

  def _measure_ready(self, selector, stats) -> tuple[float, bool]:
    """`between_steps`' measurement: (seconds spent, whether to hold the run's precompiles)."""
    self._queue = self._wanted(selector, stats)  # what is no longer wanted is not compiled
    if not self._queue:
      return 0.0, False
    # In the order wanted, the cells compiled on every process (a cell the share does not allow
    # yet is passed by those behind it that fit), and only while no compile runs on any process,
    # the profile's or the run's own precompiles (a compile takes a core: the timings it
    # overlaps are slower, and more so for layouts whose collectives wait on every device).
    wanted = [c for c in self._queue if c not in self._failed]
    quiet, *held = self._profiler.agreed([self.quiet()] + [self._ready_here(c) for c in wanted])
    ready = [c for c, h in zip(wanted, held) if h]
    if not ready:
      return 0.0, False
    if not quiet:
      fits = any(self._share.fits(self._queue[c]) for c in ready)
      return 0.0, bool(distributed.broadcast_json(fits))  # process 0's clock decides
    t0 = time.perf_counter()

    def proceed(stage: Stage, bucket: int, rows: int, names: Sequence[str]) -> bool:
      # Every process keeps its own account; process 0's clock decides, for every process.
      ok = self._share.allows(self._calls_s(selector.profile(stage), stage, bucket, rows, names))
      return bool(distributed.broadcast_json(ok))

    measured, self._params = self._profiler.measure_cells(
      self.profile, ready, proceed=proceed, params=self._params
    )
    seconds = time.perf_counter() - t0
    self._share.done()
    self.spent_s += seconds
    if measured is not self.profile:
      new = sum(measured.cells.get(c) is not self.profile.cells.get(c) for c in ready)
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
    return seconds, False

  def _wanted(self, selector, stats) -> dict[CellKey, float]:
    """`order_wanted`'s cells, each with the seconds of its calls (`_calls_s`), ordered by those
    plus its compile's (its stage's median compile, the same on every process; none for the
    program a stage runs). The layout an `OBSERVED` stage runs, where the profile measures it
    (`_run_timed` does not leave it to the run's calls), is timed at the rows of the run's latest
    call (`_running`): the program the run runs, compiled already."""
    calls: dict[CellKey, float] = {}
    compiles = self._compile_s()
    place = self._placer(selector)

    def cost(cell: CellKey) -> float:
      timed = place(cell) or cell
      calls[cell] = self._cell_s(selector, timed)
      return calls[cell] + (0.0 if timed != cell else compiles.get(cell[0], 0.0))

    left = {  # the wanted cells the profile does not time
      cell
      for stage in selector.config.profile.stages
      for kind in _KINDS
      for cell in _cells(stage, selector.wanted(stage, stats, **kind))
      if place(cell) is None
    }
    ordered = self.order_wanted(selector, stats, cost=cost, running=left)
    queue = {place(c): calls[c] for c in ordered}
    for cell in self._held_retimes(selector, stats, queue):
      del queue[cell]
    return queue

  def _held_retimes(self, selector, stats, queue: Mapping[CellKey, float]) -> set[CellKey]:
    """The re-times in `queue` that wait, left out of it: a stage's re-times wait while that
    stage has a cell in `queue` to measure at their bucket that could beat its best (a re-time's
    program is compiled: it would pass them within the share). A layout the bounds rank below
    the best, wanted only because the longest bucket measures every layout once, and another
    stage's cells do not hold them: one session's calls move 10-20% mid-run, and the layouts a
    decision weighs are those timed again. Left out of the queue, not only of what is timed:
    a compiled re-time that fits the share in the queue would hold back the compiles of the
    very cells it waits for (`_pump`), and neither would ever be timed (the default's rollout at
    1024 from step 19 of 60 at `9a59f79`: docs/results/main-job.md)."""
    stages = selector.config.profile.stages
    place = self._placer(selector)
    first = {
      place(c) for s in stages for c in _cells(s, selector.wanted(s, stats, contenders=True))
    }
    waiting = {c[:2] for c in queue if c in first and c not in self._failed}  # (stage, bucket)
    if not waiting:
      return set()
    again = {place(c) for s in stages for c in _cells(s, selector.wanted(s, stats, again=True))}
    return {c for c in queue if c in again and c[:2] in waiting}

  @staticmethod
  def order_wanted(
    selector, stats, *, cost: Callable[[CellKey], float], running: set[CellKey]
  ) -> list[CellKey]:
    """Every profiled stage's wanted cells but `running` (`_run_timed`: the cells the run's own
    calls time), the needed buckets' before the next one up's, those before the second
    buckets', and those before the measured cells to time again (`Selector.wanted`, `_KINDS`).
    Among each, one cell per stage leads, the cheapest lead first: a stage measured nowhere
    yet leads with its cheapest cell (the rollout: the `OBSERVED` stages are measured by their
    own calls), and a stage with fewer than two layouts measured at the bucket its latest
    decision ran at (its ranking there rests on the model) with the layout it runs, where that
    is wanted there (a switch weighs the best against it), else its most promising cell there.
    Then the cheapest cells (by `cost`, the seconds of their compile and calls: within the
    share, a cell that costs little is not held back by one that costs much, and a stage whose
    programs are slow to compile and call, usually train, is measured as the share accrues).
    `selector`: a `Selector`, or what reads as one (`config.profile.stages`, `wanted`,
    `profile`, `history`)."""
    out: list[CellKey] = []
    latest = {d.stage: d for d in selector.history}
    for kind in _KINDS:
      cells = [
        (stage, *cell)
        for stage in selector.config.profile.stages
        for cell in selector.wanted(stage, stats, **kind)
      ]
      cells = [c for c in cells if c not in running and c not in out]
      by_cost = sorted(cells, key=cost)
      lead = []
      for stage in dict.fromkeys(c[0] for c in by_cost):
        profile = selector.profile(stage)
        if stage not in OBSERVED and not _measured_layouts(profile, stage):
          lead.append(next(c for c in by_cost if c[0] == stage))
          continue
        decision = latest.get(stage) if not kind else None  # the needed buckets only
        bucket = None if decision is None else decision.run_bucket
        unranked = [c for c in cells if c[0] == stage and c[1] == bucket]
        if unranked and len(_measured_layouts(profile, stage, bucket)) < 2:
          runs = [c for c in unranked if c[3] == decision.config.name]
          lead.append((runs or unranked)[0])  # else the most promising (`wanted`'s order)
      lead.sort(key=cost)
      out += lead + [c for c in by_cost if c not in lead]
    return out

  def _run_timed(self, selector) -> set[CellKey]:
    """The cells the run's own calls time: `_runs_known`'s, for at most `PATIENCE` step
    boundaries each while wanted; the profile measures one they have not timed by then."""
    return {c for c in self._runs_known(selector) if self._left.get(c, 0) <= self.PATIENCE}

  def _count_left(self, selector, stats) -> None:
    """Counts a boundary for each cell of `_runs_known` that is wanted (to measure, or to
    time again)."""
    for cell in self._runs_known(selector):
      stage, *key = cell
      if any(tuple(key) in selector.wanted(stage, stats, **kind) for kind in ({}, {'again': True})):
        self._left[cell] = self._left.get(cell, 0) + 1

  def _runs_known(self, selector) -> set[CellKey]:
    """The cells of `_running` whose latest call ran at the load's rows (elsewhere the run's
    calls make a cell at other rows, which stands for the layout there only through the model's
    curve: `cost_model.to_measure`), where the model knows the layout well enough
    (`selector.barely_known`): one it barely knows is held until it is measured, and the run's
    calls, kept only where nothing compiles beside them, may take many steps to time it."""
    return {
      cell
      for cell, ran in self._running(selector).items()
      if ran[2] == cell[2] and not selector_lib.barely_known(selector.profile(cell[0]).cell(*cell))
    }

  def _placer(self, selector) -> Callable[[CellKey], CellKey | None]:
    """Where the profile times a wanted cell: None where it does not. The cell an `OBSERVED`
    stage runs is left to the run's own calls (`_run_timed`), or measured by the profile. While
    the model barely knows its layout there (`selector.barely_known`: the selector holds it
    until it is measured), the profile first times the program the run runs, at the rows of its
    latest call (`_running`: compiled already, so the stage is measured at once, with no
    compile), which anchors the layout's curve at that bucket; the layout is still timed at the
    load, where the other layouts are, once wanted there (a layout's speed per token moves with
    the rows it runs at: experience on this CPU, 5-12% slower at 64 rows than at 16 at 768-1024
    tokens). A cell of the layout a stage runs at a bucket its calls have not reached waits for
    them (they compile that program, at the packed batch's rows)."""
    left = self._run_timed(selector)
    running = self._running(selector)
    layouts = {d.stage: d.config.name for d in selector.history if d.stage in OBSERVED}

    def place(cell: CellKey) -> CellKey | None:
      if cell in left:
        return None
      if self._measured(cell):
        return cell
      if cell in running:
        anchor = running[cell]
        known = not selector_lib.barely_known(selector.profile(cell[0]).cell(*cell))
        return cell if known or self._measured(anchor) else anchor
      return None if layouts.get(cell[0]) == cell[3] else cell

    return place

  def _running(self, selector) -> dict[CellKey, CellKey]:
    """Each `OBSERVED` stage's cell at its latest decision (bucket, load, layout), where the
    run's latest call of the stage ran that layout at that bucket, to the cell of that call (at
    its packed rows: `observing` keeps a sample per token; the program is compiled)."""
    latest = {d.stage: d for d in selector.history if d.stage in OBSERVED}
    out = {}
    for stage, d in latest.items():
      ran = self._ran.get(stage)
      if ran is not None and (ran[1], ran[3]) == (d.run_bucket, d.config.name):
        out[(stage, d.run_bucket, d.rows, d.config.name)] = ran
    return out

  def _cell_s(self, selector, cell: CellKey) -> float:
    stage, bucket, rows, name = cell
    return self._calls_s(selector.profile(stage), stage, bucket, rows, [name])

  def _calls_s(self, profile: Profile, stage: Stage, bucket: int, rows: int, names) -> float:
    """The seconds of the calls timing `names` at (stage, bucket, rows) makes (a round: its
    warm-up, then `repeats` calls and at least `min_seconds` of them), a call at the cost
    model's figure; for a layout the model knows only from the other layouts (measured nowhere
    itself: its figure can be far off), at the median of the layouts measured or fitted to
    their own cells there, or, with none, at the run's latest call of the stage (`observing`)
    scaled to the cell's tokens. 0 where the model has only the analytic model's nominal
    figures."""
    measure = self._profiler.config.measure
    decode = self._profiler.config.spec.decode_tokens
    here = [_figure(profile, stage, bucket, rows, c.name) for c in profile.candidates(stage)]
    known = [
      cost_model.seconds_per_call(c, decode)
      for c in here
      if c.throughput and cost_model.anchored(c)
    ]
    total = 0.0
    latest = None
    if stage in self._latest:  # the run's latest call of the stage, at this cell's tokens
      tokens, seconds = self._latest[stage]
      latest = seconds * cost_model.tokens_per_call(stage, bucket, rows, decode) / tokens
    for name in names:
      cell = _figure(profile, stage, bucket, rows, name)
      if cell.prior == cost_model.ANALYTIC or not cell.throughput:
        continue
      call_s = cost_model.seconds_per_call(cell, decode)
      if not cost_model.anchored(cell) and known:
        call_s = statistics.median(known)
      elif not cost_model.anchored(cell) and latest is not None:
        call_s = latest
      timed = max(measure.repeats * call_s, measure.min_seconds)
      total += measure.rounds * (measure.warmup * call_s + timed)
    return total

  def _compile_s(self) -> dict[Stage, float]:
    """Per stage, what compiling one of its programs takes: the median compile time of its
    profiled programs (none before any; the same on every process, compiled here or not)."""
    times: dict[Stage, list[float]] = {}
    for c in self.profile.cells.values() if self.profile is not None else ():
      if c.compile_ms:
        times.setdefault(c.stage, []).append(c.compile_ms)
    return {stage: statistics.median(ms) / 1e3 for stage, ms in times.items()}

  def compile_ms(self, stage: Stage, bucket: int, rows: int, layout: str) -> float:
    """The profiled compile time of a program (0 when not profiled)."""
    cell = None if self.profile is None else self.profile.cells.get((stage, bucket, rows, layout))
    return cell.compile_ms if cell is not None and cell.compile_ms else 0.0


def _cells(stage: Stage, wanted: Sequence[tuple[int, int, str]]) -> list[CellKey]:
  return [(stage, *cell) for cell in wanted]


def _figure(profile: Profile, stage: Stage, bucket: int, rows: int, name: str) -> Cell:
  """`profile`'s cell, or at rows it does not profile (a packed batch's), its cell at the
  nearest profiled load, at those rows (the same tokens per second a device)."""
  cell = profile.cells.get((stage, bucket, rows, name))
  if cell is not None:
    return cell
  load = min(profile.rows_for(stage), key=lambda r: abs(r - rows))
  return dataclasses.replace(profile.cell(stage, bucket, load, name), rows=rows)


def _measured_layouts(profile: Profile, stage: Stage, bucket: int | None = None) -> set[str]:
  """The layouts of `stage` with a measured cell (by the profile or the run's own calls), at
  `bucket` (None: at any), at any load."""
  return {
    name
    for (s, b, _, name), c in profile.cells.items()
    if s == stage and bucket in (None, b) and c.measured and c.throughput
  }
