"""What a run is built from, each part from what the one before returned (the trainer's
composition root; nothing here runs a step).

  model, tok = load_model(config)                          # the shapes and the tokenizer
  spec = stage_spec(config, tok, model)                    # the stages' static settings
  executables = Executables(model, spec=spec)              # one program per (stage, layout, ...)
  profile = RunProfile.start(config, model=model, spec=spec, executables=executables)
  selector = make_selector(config, model, spec, profile.profile, num_devices, switch_cost)
  train_engine, eval_engine = make_engines(config, model, tok, executables)
"""

import dataclasses
import time
from collections.abc import Sequence
from concurrent import futures

import jax
from absl import logging

from earl_jax import distributed
from earl_jax.config import ModelConfig
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import hf_import, tokenizer
from earl_jax.programs import Executables, StageSpec, profiling
from earl_jax.rollout import engine
from earl_jax.selector import prior as prior_lib
from earl_jax.selector import selector as selector_lib
from earl_jax.selector.profile import CellKey, Profile
from earl_jax.stage import Stage


def load_model(config: ExperimentConfig) -> tuple[ModelConfig, tokenizer.Tokenizer]:
  """The model's shapes and the tokenizer: from a HF directory, or a preset."""
  if config.model_dir:
    model = hf_import.load_config(
      config.model_dir, param_dtype=config.param_dtype, dtype=config.param_dtype
    )
    return model, tokenizer.load_tokenizer(config.model_dir)
  model = ModelConfig.preset(config.model).replace(
    param_dtype=config.param_dtype, dtype=config.param_dtype
  )
  return model, tokenizer.load_tokenizer(config.tokenizer)


def stage_spec(config: ExperimentConfig, tok: tokenizer.Tokenizer, model: ModelConfig) -> StageSpec:
  """The static settings every stage program of the run is compiled with."""
  return StageSpec.for_rollout(
    config.rollout,
    tok,
    model.vocab_size,
    micro_batches=config.micro_batches,
    optim=config.optim,
    loss=config.loss,
    packed=config.pack,
  )


def load_rows(config: ExperimentConfig) -> tuple[int, ...]:
  """The selector's load bins: the episodes of a step (experience and train run them all at
  once) and, when fewer, the rollout's slots (its program runs that many rows)."""
  return selector_lib.load_bins((config.rollout.slots, config.rollout.num_episodes))


def rollout_rows(config: ExperimentConfig) -> dict[Stage, int]:
  """The rollout's rows, its slots, where they are not the step's episodes."""
  slots = config.rollout.slots
  return {Stage.ROLLOUT: slots} if slots != config.rollout.num_episodes else {}


def make_selector(
  config: ExperimentConfig,
  model: ModelConfig,
  spec: StageSpec,
  profile: Profile | None,
  num_devices: int,
  switch_cost: selector_lib.SwitchCost,
) -> selector_lib.Selector:
  """The selector on the measured profile (its stages) and the analytic model (the others);
  `switch_cost` is consulted from the second decision on."""
  return selector_lib.Selector(
    config.selector,
    buckets=config.buckets,
    rows=load_rows(config),
    stage_rows=rollout_rows(config),
    model=model,
    num_devices=num_devices,
    profile=profile,
    spec=spec,
    switch_cost=switch_cost,
  )


def make_engines(
  config: ExperimentConfig,
  model: ModelConfig,
  tok: tokenizer.Tokenizer,
  executables: Executables,
) -> tuple[engine.RolloutEngine, engine.RolloutEngine]:
  """The training engine, and the evaluation engine (fixed seeds, greedy, its own episodes)."""
  train = engine.RolloutEngine(
    model, tok, config.env, config.rollout, config.buckets, programs=executables
  )
  eval_rollout = dataclasses.replace(
    config.rollout,
    num_episodes=config.eval_episodes,
    group_size=1,
    sampling=dataclasses.replace(config.rollout.sampling, greedy=True),
  )
  evaluation = engine.RolloutEngine(
    model, tok, config.eval_env, eval_rollout, config.buckets, programs=executables
  )
  return train, evaluation


class _Share:
  """Process 0's account of measuring between steps: a group of cells is timed when the time
  spent measuring, with the group's estimate, stays within `max_share` of the run's time so
  far. The estimate is the group's calls at their prior figures, times how much longer than
  that the groups timed so far took (inputs, moves, warm-up: the overhead)."""

  def __init__(self, max_share: float):
    self.max_share = max_share
    self.start = time.perf_counter()
    self.spent = 0.0
    self.overhead = 1.0
    self._group: tuple[float, float] | None = None  # (started, calls' estimate) of the last

  def allows(self, calls_s: float) -> bool:
    now = time.perf_counter()
    self.done(now)
    ok = self.spent + self.overhead * calls_s <= self.max_share * (now - self.start)
    self._group = (now, calls_s) if ok else None
    return ok

  def done(self, now: float | None = None) -> None:
    """The last group allowed is over (by `now`): its time is spent, its overhead learnt."""
    if self._group is None:
      return
    now = time.perf_counter() if now is None else now
    started, calls_s = self._group
    self.spent += now - started
    if calls_s > 0:
      self.overhead = max(1.0, (now - started) / calls_s)
    self._group = None


class RunProfile:
  """The measured profile the selector ranks its profiled stages by, and how it is completed
  (`selector.profile`):

  - not `lazy`: every bucket measured at start-up;
  - `lazy` without `prior`: a decision waits while the buckets it needs are measured whole;
  - `lazy` with `prior` (the default): no decision waits. The selector decides on the prior
    where a cell is not measured yet. The cells its coming decisions would rank by, and those
    of the next bucket up, are compiled in the background as soon as they are wanted
    (`measure_missing`, before each decision; at most `IN_FLIGHT` at a time, the most wanted
    first), and timed at the start of a later step, while the devices are idle, once compiled
    on every process (`between_steps`), within `max_share` of the run's time. What is wanted,
    timed and when is decided from what every process holds alike (the selector's state, the
    measured cells, which programs every process has compiled, process 0's clock), and the
    figures are process 0's.
  """

  IN_FLIGHT = 2  # background profile compiles at a time (a run's exit waits for these only)

  def __init__(
    self,
    profiler: profiling.RunProfiler | None,
    profile: Profile | None,
    *,
    settings: selector_lib.ProfileSettings,
  ):
    """Use `RunProfile.start`."""
    self._profiler = profiler
    self._settings = settings
    self.profile = profile  # None: the selector decides on the analytic model only
    self._queue: dict[CellKey, None] = {}  # wanted, most wanted first
    self._compiling: dict[CellKey, futures.Future] = {}
    self._failed: set[CellKey] = set()  # whose compile raised: never timed
    self._share = _Share(settings.max_share)
    self.spent_s = 0.0  # spent timing cells between steps

  @classmethod
  def start(
    cls,
    config: ExperimentConfig,
    *,
    model: ModelConfig,
    spec: StageSpec,
    executables: Executables,
    base: Profile | None = None,
    given: Profile | None = None,
  ) -> 'RunProfile':
    """The start-up profile of `config.selector.profile.stages`: `given` when passed, else
    every candidate program of those stages compiled and timed at every bucket (with `lazy`:
    none yet), or what the cache holds when it was made for exactly this setup. `base`: cells
    measured before (the checkpoint a resume continues from), preferred to the cache's."""
    settings = config.selector.profile
    if not settings.stages:
      return cls(None, given, settings=settings)
    profiler = profiling.RunProfiler.for_selector(
      config.selector,
      model=model,
      buckets=config.buckets,
      rows=load_rows(config),
      spec=spec,
      executables=executables,
      base=base,
      stage_rows=rollout_rows(config),
    )
    profile = given if given is not None else profiler.start(measure=not settings.lazy)
    return cls(profiler, profile, settings=settings)

  @property
  def _background(self) -> bool:
    return self._profiler is not None and self._settings.lazy and self._settings.prior

  def measure_missing(
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
    compiled, or whose compile failed is skipped: its prior stays)."""
    busy = sum(not f.done() for f in self._compiling.values())
    for cell in self._queue:
      if busy >= self.IN_FLIGHT:
        return
      running = self._compiling.get(cell)
      if running is not None and not running.done():
        continue
      if running is not None and running.exception() is not None:
        if cell not in self._failed:
          self._failed.add(cell)
          logging.warning('profile: %s is left to its prior: %s', cell, running.exception())
        continue
      if self._profiler.compiled_here(cell):
        continue
      self._compiling[cell] = self._profiler.compile(cell)
      busy += 1

  def between_steps(
    self, selector: selector_lib.Selector, stats: selector_lib.StepStats | None
  ) -> float:
    """At the start of a step (`stats`: the previous one's; None: the first step, which never
    waits): times the cells `selector` wants that every process has compiled, needed ones
    first, then the next bucket's, while within `max_share` of the run's time (`_Share`), and
    hands them to `selector`. Returns the seconds spent."""
    if not self._background or stats is None:
      return 0.0
    wanted = [
      (stage, *cell)
      for ahead in (False, True)
      for stage in selector.config.profile.stages
      for cell in selector.wanted(stage, stats, ahead=ahead)
    ]
    self._queue = dict.fromkeys(wanted)  # what is no longer wanted is not compiled
    if not wanted:
      return 0.0
    held = self._profiler.agreed([self._ready_here(c) for c in wanted])
    ready = [c for c, ok in zip(wanted, held) if ok]
    if not ready:
      return 0.0
    t0 = time.perf_counter()

    def proceed(stage: Stage, bucket: int, rows: int, names: Sequence[str]) -> bool:
      ok = None
      if jax.process_index() == 0:  # process 0's clock decides, for every process
        ok = self._share.allows(self._calls_s(selector.profile(stage), stage, bucket, rows, names))
      return bool(distributed.broadcast_json(ok))

    measured = self._profiler.measure_cells(self.profile, ready, proceed=proceed)
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
        'profile: %d cells timed between steps in %.1f s (%.1f s in all)',
        new,
        seconds,
        self.spent_s,
      )
    self._pump()
    return seconds

  def _calls_s(self, profile: Profile, stage: Stage, bucket: int, rows: int, names) -> float:
    """The seconds of the calls timing `names` at (stage, bucket, rows) makes, by their prior
    figures (0 where those are the analytic model's nominal ones)."""
    measure = self._profiler.config.measure
    calls = measure.rounds * (measure.warmup + measure.repeats)
    decode = self._profiler.config.spec.decode_tokens
    total = 0.0
    for name in names:
      cell = profile.cell(stage, bucket, rows, name)
      if cell.prior != prior_lib.ANALYTIC and cell.throughput:
        total += calls * prior_lib.seconds_per_call(cell, decode)
    return total

  def compile_ms(self, stage: Stage, bucket: int, rows: int, layout: str) -> float:
    """The profiled compile time of a program (0 when not profiled)."""
    cell = None if self.profile is None else self.profile.cells.get((stage, bucket, rows, layout))
    return cell.compile_ms if cell is not None and cell.compile_ms else 0.0
