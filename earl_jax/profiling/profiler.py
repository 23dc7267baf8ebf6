"""Measuring the profile: every candidate program compiled, and timed where it fits.

For each stage, bucket and number of responses (rows), every candidate layout is compiled
ahead of time; a layout whose XLA per-device peak exceeds the budget is recorded as OOM and
never run. The others are measured: decode tokens per device per second (TGS) for rollout,
tokens per device per second for experience and train. Every measurement is warmed up and
repeated; the median is kept. To keep background load on a shared machine from favouring one
layout, the candidates of a cell are visited in `rounds` passes, in a rotating order.

The result is a `profiling.table.Profile` (pure data, what the selector decides on), cached as
JSON keyed by hardware, software, model, candidate set, grid, budget and program shapes: a later
run on the same setup reuses it (or a table `experiments/profile.py` wrote once, on another
machine of the same kind), and a file made for another model or machine is refused in one line,
never trusted. This module is the one bridge from the programs to the profile table: the
selector never imports it, nor `earl_jax.programs`.

Cheaper profiles: `run(..., confidence=2.0)` visits the buckets shortest first and measures, at
each, only the candidates the cost model (`cost_model.to_measure`, fitted to the cells measured
so far) cannot rule out. A run measures between steps instead (`schedule.ProfileScheduler`,
which times the cells `Selector.wanted` names with `Profiler.measure_cells`, their programs
compiled in the background first by `Profiler.compile`).

  grid = profiler.grid_for(sel_cfg, buckets=table, rows=64, spec=spec, budget_bytes=b)
  profile = profiler.run(cfg, grid, executables=exe, cache_path='runs/profile.json')
  profile.cell(Stage.ROLLOUT, 1024, 16, ParallelConfig(tp=8)).throughput

The programs measured are the ones that run: `executables.get(...)` of every candidate key, so
a profiled rollout cell times the engine's own generate program (a prompt chunk of
`spec.chunk` tokens, then `spec.decode_tokens` decoded tokens, with end-of-turn disabled).
"""

import dataclasses
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
from absl import logging
from flax import nnx

from earl_jax import distributed
from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.errors import ConfigError
from earl_jax.models import qwen2
from earl_jax.profiling import cost_model
from earl_jax.profiling.table import (
  Cell,
  CellKey,
  MeasureConfig,
  Profile,
  load_cached,
  poolable,
  pooled,
)
from earl_jax.programs import builders
from earl_jax.programs import memory as memory_lib
from earl_jax.programs.executables import Executables, background_pool
from earl_jax.selector import selector as selector_lib
from earl_jax.selector.candidates import candidates_for, named_stages
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileGrid:
  """What to profile.

  Attributes:
    stages: stages to profile.
    buckets: the context-length table (every bucket is profiled).
    rows: numbers of responses (the load bins), strictly increasing.
    stage_rows: the one row count profiled for a stage whose program runs at a fixed count (the
      rollout on its slots, `RolloutConfig.num_slots`); one of `rows`. Other stages: every bin.
    budget_bytes: per-device memory budget; cells over it are OOM and not run (None: unlimited).
    candidates: restrict the layouts (default: every valid factorisation of the devices).
    with_fsdp: the stages whose candidates include fsdp > 1 layouts (True: all, False: none);
      an fsdp layout in `candidates` is dropped for the other stages.
    with_cp: the stages whose candidates include context-parallel (cp > 1) layouts (True: all,
      False: none); a cp layout in `candidates` is dropped for the other stages.
    measure: how each cell is timed.
    spec: static stage settings (sampling, prompt chunk, micro-batches, optimizer).
  """

  stages: tuple[Stage | str, ...] = (Stage.ROLLOUT,)
  buckets: BucketConfig
  rows: tuple[int, ...]
  budget_bytes: int | None
  stage_rows: Mapping[Stage, int] = dataclasses.field(default_factory=dict)
  candidates: tuple[ParallelConfig, ...] | None = None
  with_fsdp: bool | tuple[Stage | str, ...] = True
  with_cp: bool | tuple[Stage | str, ...] = False
  measure: MeasureConfig = dataclasses.field(default_factory=MeasureConfig)
  spec: builders.StageSpec = dataclasses.field(default_factory=builders.StageSpec)

  def __post_init__(self):
    if not self.stages:
      raise ConfigError('ProfileGrid.stages is empty.')
    object.__setattr__(self, 'stages', tuple(Stage.parse(s) for s in self.stages))
    object.__setattr__(self, 'with_fsdp', named_stages(self.with_fsdp))
    object.__setattr__(self, 'with_cp', named_stages(self.with_cp))
    rows = tuple(self.rows)
    if not rows or any(not isinstance(r, int) or r <= 0 for r in rows):
      raise ConfigError(f'ProfileGrid.rows must be positive ints, got {rows}.')
    if list(rows) != sorted(set(rows)):
      raise ConfigError(f'ProfileGrid.rows must be strictly increasing, got {rows}.')
    object.__setattr__(self, 'rows', rows)
    stage_rows = {Stage.parse(k): v for k, v in dict(self.stage_rows).items()}
    if any(v not in rows for v in stage_rows.values()):
      raise ConfigError(f'ProfileGrid.stage_rows must be among rows {rows}, got {stage_rows}.')
    object.__setattr__(self, 'stage_rows', stage_rows)
    if self.budget_bytes is not None and (
      not isinstance(self.budget_bytes, int) or self.budget_bytes <= 0
    ):
      raise ConfigError(
        f'ProfileGrid.budget_bytes must be a positive int, got {self.budget_bytes!r}.'
      )

  def rows_for(self, stage: Stage) -> tuple[int, ...]:
    """The row counts profiled for `stage`."""
    return (self.stage_rows[stage],) if stage in self.stage_rows else self.rows


def grid_for(
  config: selector_lib.SelectorConfig,
  *,
  buckets: BucketConfig,
  rows: int | Sequence[int],
  spec: builders.StageSpec,
  budget_bytes: int | None,
  stage_rows: Mapping[Stage, int] | None = None,
) -> ProfileGrid:
  """The start-up profile a selector with `config` ranks its profiled stages by."""
  return ProfileGrid(
    stages=config.profile.stages,
    buckets=buckets,
    rows=selector_lib.load_bins(rows),
    stage_rows=stage_rows or {},
    budget_bytes=budget_bytes,
    candidates=config.layouts,
    with_fsdp=config.with_fsdp,
    with_cp=config.with_cp,
    measure=config.profile.measure,
    spec=spec,
  )


def hardware() -> dict[str, Any]:
  """What the measurements depend on: platform, device kind and count, software, host."""
  devices = jax.devices()
  info = {
    'platform': devices[0].platform,
    'device_kind': devices[0].device_kind,
    'num_devices': len(devices),
    'num_processes': jax.process_count(),
    'jax': jax.__version__,
    'machine': platform.machine(),
  }
  if devices[0].platform == 'cpu':
    info['host_cpus'] = os.cpu_count()
    info['cpu_model'] = _cpu_model()
  return info


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or 'unknown'


def profile_key(
  model: ModelConfig, config: ProfileGrid, candidates: dict[Stage, list[ParallelConfig]]
) -> dict[str, Any]:
  """The JSON-able identity of a profile: a cached file is reused only when this matches. What
  the figures depend on, and nothing else: how carefully they were timed (`config.measure`) is
  not in it, so that a table measured offline with more repeats serves a run that times fewer."""
  spec = config.spec
  return {
    'hardware': hardware(),
    'model': dataclasses.asdict(model),
    'stages': [str(s) for s in config.stages],
    'candidates': {str(s): [c.name for c in cands] for s, cands in candidates.items()},
    'buckets': list(config.buckets.lengths),
    'rows': list(config.rows),
    # Only where set, so that a profile of a run without slots keeps its key.
    **(
      {'stage_rows': {str(k): v for k, v in config.stage_rows.items()}} if config.stage_rows else {}
    ),
    'budget_bytes': config.budget_bytes,
    'spec': {
      'sampling': dataclasses.asdict(spec.sampling),
      'chunk': spec.chunk,
      'token_ids': None if spec.token_ids is None else list(spec.token_ids),
      'micro_batches': spec.micro_batches,
      # What shapes the train program; the rates, clip ranges and coefficients' values do not.
      'loss': {
        'kl': spec.loss.kl_coef > 0,
        'entropy': spec.loss.uses_entropy,
        'aggregation': spec.loss.aggregation,
      },
      'optim_schedule': spec.optim.decay_steps > 0 or spec.optim.warmup_steps > 0,
    },
  }


def _carry(stage: Stage, args: tuple[Any, ...], out: Any) -> tuple[Any, ...]:
  """The next call's arguments: donated inputs are replaced by the outputs that alias them."""
  if stage == Stage.ROLLOUT:
    # Later calls write past the capacity (dropped); the cost per token is the same.
    return (args[0], out[1], *args[2:])
  if stage == Stage.TRAIN:
    return (out[0], args[1])
  return args


def measure(
  executable: Any, args: tuple[Any, ...], *, warmup: int, repeats: int, min_seconds: float = 0.0
) -> tuple[list[float], tuple[Any, ...]]:
  """Times calls after `warmup` untimed ones: at least `repeats`, and until `min_seconds` of calls.

  Returns (ms per call, the carried arguments).
  """
  stage = executable.key.stage
  for _ in range(warmup):
    out = jax.block_until_ready(executable(*args))
    args = _carry(stage, args, out)
  times: list[float] = []
  while len(times) < repeats or (sum(times) < 1e3 * min_seconds and len(times) < 64):
    t0 = time.perf_counter()
    out = jax.block_until_ready(executable(*args))
    times.append(1e3 * (time.perf_counter() - t0))
    args = _carry(stage, args, out)
  return times, args


def default_candidates(
  model: ModelConfig, config: ProfileGrid, num_devices: int | None = None
) -> dict[Stage, list[ParallelConfig]]:
  n = num_devices or len(mesh_lib.canonical_devices())
  return {
    s: candidates_for(
      s,
      model,
      num_devices=n,
      rows=config.rows,
      lengths=config.buckets.lengths,
      with_fsdp=config.with_fsdp,
      with_cp=config.with_cp,
      only=config.candidates,
    )
    for s in config.stages
  }


def run(
  model: ModelConfig,
  config: ProfileGrid,
  *,
  executables: Executables | None = None,
  params: nnx.State | None = None,
  cache_path: str | None = None,
  progress: Callable[[Cell], None] | None = None,
  buckets: Sequence[int] | None = None,
  measure: bool = True,
  base: Profile | None = None,
  confidence: float = 0.0,
) -> Profile:
  """Profiles every (stage, bucket, rows, candidate), or loads a matching cached profile.

  Several processes of one program run it together (every process calls it): the programs are
  SPMD, and process 0's cache and measurements are broadcast (after every bucket of a stage, so
  that what the cost model rules out is the same everywhere), so that every process holds the same
  profile and takes the same decisions.

  Args:
    model: the model (random weights unless `params` is given).
    config: the grid, budget and measurement settings.
    executables: the compile cache to use (and fill); its spec must equal `config.spec`.
    params: weights on any layout of the canonical devices (consumed: they are moved between
      candidate layouts); default: random weights.
    cache_path: JSON file to reuse when it matches this setup, and to write otherwise. It may
      hold only some buckets (see `buckets`): those are reused, the others measured and added.
    progress: called with every finished cell.
    buckets: measure only these buckets of `config.buckets` (default: all of them).
    measure: False: return what the cache holds (possibly no cell), measuring nothing.
    base: cells measured before, e.g. kept in a checkpoint; used when made for this setup, and
      preferred to the cache's.
    confidence: > 0: the buckets shortest first, each measuring only the candidates that the
      cost model fitted to the cells measured so far cannot rule out at this many standard
      deviations, nor puts over the budget (`cost_model.to_measure`); the others keep no cell
      (0: every candidate).

  Returns:
    The profile. Every cell over budget is OOM; every other cell has a median throughput.
  """
  candidates = default_candidates(model, config)
  key = profile_key(model, config, candidates)
  have = _start(key, cache_path, base)
  select = functools.partial(_to_measure, model, config, candidates, confidence)
  wanted = sorted(config.buckets.lengths if buckets is None else buckets)
  grid = [(s, r) for s in config.stages for r in config.rows_for(s)]
  missing = [b for b in wanted if any(select(have, s, b, r) for s, r in grid)]
  if have.cells and not missing:
    logging.info('Reusing the profile in %s (%d cells).', cache_path, len(have.cells))
  if not missing or not measure:
    return have
  own = executables is None
  exe = executables if executables is not None else Executables(model, spec=config.spec)
  if exe.spec != config.spec:
    raise ValueError(f'Executables spec {exe.spec} differs from the profile spec {config.spec}.')
  t_start = time.perf_counter()
  if params is None:
    _, params = qwen2.init_model(
      model, exe.mesh(candidates[config.stages[0]][0]), seed=config.measure.seed
    )
  try:
    for stage in config.stages:
      for bucket in missing:
        for rows in config.rows_for(stage):
          chosen = select(have, stage, bucket, rows)
          if chosen:
            cells: dict[CellKey, Cell] = {}
            params = _profile_cell(
              exe, stage, bucket, rows, chosen, config, params, cells, progress
            )
            have = have.merged(_agreed(key, cells))
  finally:
    if own:
      exe.close()
  have.wall_s += time.perf_counter() - t_start
  if cache_path and jax.process_index() == 0:
    have.save(cache_path)
  return have


def _start(key: dict[str, Any], cache_path: str | None, base: Profile | None) -> Profile:
  """What is measured already: process 0's cache file (when made for `key`), and `base`'s
  measured cells over it (when made for `key`)."""
  cached = None
  if cache_path:
    found = load_cached(cache_path, key) if jax.process_index() == 0 else None
    data = distributed.broadcast_json(None if found is None else found.to_json())
    cached = None if data is None else Profile.from_json(data)
  have = cached or Profile(key=key, cells={})
  if base is not None and base.key == key:
    have = have.merged(base.measured_only())
  return have


def _agreed(key: dict[str, Any], cells: dict[CellKey, Cell]) -> Profile:
  """Process 0's cells, on every process."""
  return Profile.from_json(distributed.broadcast_json(Profile(key=key, cells=cells).to_json()))


def _to_measure(
  model: ModelConfig,
  config: ProfileGrid,
  candidates: dict[Stage, list[ParallelConfig]],
  confidence: float,
  have: Profile,
  stage: Stage,
  bucket: int,
  rows: int,
) -> list[ParallelConfig]:
  """The candidates of (stage, bucket, rows) to measure: every one without a cell, or (with
  `confidence`) those `cost_model.to_measure` names on `have` completed by the cost model."""
  if not confidence:
    return [c for c in candidates[stage] if (stage, bucket, rows, c.name) not in have.cells]
  full = cost_model.complete(have, model=model, shapes=config.spec)
  names = cost_model.to_measure(
    full, stage, bucket, rows, budget=config.budget_bytes, margin=0.0, confidence=confidence
  )
  return [ParallelConfig.parse(n) for n in names]


def _cell(stage, bucket, rows, parallel: ParallelConfig, entry, **measured) -> Cell:
  """The profile cell of a compiled `entry`: its peak and compile time, plus what `measured`."""
  return Cell(
    stage=stage,
    config=parallel.name,
    bucket=bucket,
    rows=rows,
    peak_bytes=entry.memory.peak,
    compile_ms=entry.lower_ms + entry.compile_ms,
    **measured,
  )


def timed_cell(entry, times_ms: Sequence[float]) -> Cell:
  """The measured cell of a compiled `entry` (an `Executable`) from the times of its calls, in
  ms: the median call's tokens per device per second."""
  key = entry.key
  median_s = statistics.median(times_ms) / 1e3
  return _cell(
    key.stage,
    key.bucket,
    key.rows,
    key.config,
    entry,
    oom=False,
    throughput=entry.program.tokens / median_s / key.config.num_devices,
    times_ms=tuple(times_ms),
  )


def _profile_cell(exe, stage, bucket, rows, candidates, config, params, cells, progress):
  entries, feasible = {}, []
  for c in candidates:
    entry = exe.get(exe.key(stage, c, bucket, rows))
    entries[c] = entry
    if config.budget_bytes is None or memory_lib.fits(entry.memory.peak, config.budget_bytes):
      feasible.append(c)
    else:
      cell = _cell(stage, bucket, rows, c, entry, oom=True, throughput=None)
      cells[(stage, bucket, rows, c.name)] = cell
      if progress:
        progress(cell)
  times: dict[ParallelConfig, list[float]] = {c: [] for c in feasible}
  settings = config.measure
  for round_index in range(settings.rounds):
    order = (
      feasible[round_index % len(feasible) :] + feasible[: round_index % len(feasible)]
      if feasible
      else []
    )
    for c in order:
      entry = entries[c]
      params = exe.resharder(params, entry.program.param_shardings)
      args = builders.make_inputs(entry.program, params, seed=settings.seed)
      ts, _ = measure(
        entry,
        args,
        warmup=settings.warmup,
        repeats=settings.repeats,
        min_seconds=settings.min_seconds,
      )
      times[c].extend(ts)
      del args
  for c in feasible:  # each round a separate visit: a session (`Cell.sessions`)
    cell = dataclasses.replace(timed_cell(entries[c], times[c]), sessions=settings.rounds)
    cells[(stage, bucket, rows, c.name)] = cell
    if progress:
      progress(cell)
  return params


@dataclasses.dataclass(frozen=True, kw_only=True)
class Profiler:
  """How one run measures its profile: the setup, its cache file, and the cells a resumed
  checkpoint brought (preferred to the cache's, so that a resume decides on the same numbers).

  Two ways: a whole bucket before the decision that needs it (`measure_missing`, blocking), or
  chosen cells between steps: `compile` them in the background, then `measure_cells` those
  compiled on every process (`agreed`).

  Attributes:
    model: the model.
    config: the profile's grid, budget and measurement settings (`grid_for`).
    executables: the run's compile cache (the measured programs are the ones that run).
    cache_path: the JSON cache to reuse and fill (None: none).
    base: cells measured before, e.g. kept in the checkpoint a run resumes.
    compiler: the background thread of `compile`.
  """

  model: ModelConfig
  config: ProfileGrid
  executables: Executables
  cache_path: str | None = None
  base: Profile | None = None
  compiler: futures.ThreadPoolExecutor = dataclasses.field(
    default_factory=lambda: background_pool(1, 'earl-profile'),
    repr=False,
    compare=False,
  )

  @classmethod
  def for_selector(
    cls,
    config: selector_lib.SelectorConfig,
    *,
    model: ModelConfig,
    buckets: BucketConfig,
    rows: int | Sequence[int],
    spec: builders.StageSpec,
    executables: Executables,
    base: Profile | None = None,
    stage_rows: Mapping[Stage, int] | None = None,
  ) -> 'Profiler':
    """The profiler of a selector with `config` (which profiles some stage): its stages,
    candidates, measurement settings and cache file, on this device budget."""
    pconfig = grid_for(
      config,
      buckets=buckets,
      rows=rows,
      spec=spec,
      budget_bytes=memory_lib.resolve_budget(config.budget_bytes),
      stage_rows=stage_rows,
    )
    return cls(
      model=model,
      config=pconfig,
      executables=executables,
      cache_path=config.profile.cache,
      base=base,
    )

  def start(self, *, measure: bool) -> Profile:
    """The start-up profile: every bucket measured (or loaded from the cache / base); with
    `measure=False`, only what the cache and base hold."""
    return run(
      self.model,
      self.config,
      executables=self.executables,
      cache_path=self.cache_path,
      measure=measure,
      base=self.base,
    )

  def measure_bucket(self, bucket: int) -> tuple[Profile, float]:
    """The profile with `bucket` measured for every profiled stage, and the seconds it took."""
    t0 = time.perf_counter()
    profile = run(
      self.model,
      self.config,
      executables=self.executables,
      cache_path=self.cache_path,
      buckets=(bucket,),
      base=self.base,
    )
    return profile, time.perf_counter() - t0

  def measure_missing(
    self, selector: selector_lib.Selector, stage: Stage, stats: selector_lib.StepStats | None
  ) -> tuple[Profile | None, float]:
    """Measures the buckets `selector` reports missing for deciding `stage` on `stats`, one at a
    time, handing each profile to it; returns the last profile (None: nothing was missing) and
    the seconds spent."""
    profile, seconds, measured = None, 0.0, set()
    while buckets := selector.missing(stage, stats):
      if buckets[0] in measured:
        raise RuntimeError(f'{stage}: bucket {buckets[0]} is still missing after measuring it.')
      measured.add(buckets[0])
      profile, spent = self.measure_bucket(buckets[0])
      selector.use_profile(profile)
      seconds += spent
    return profile, seconds

  def compile(self, cell: CellKey) -> futures.Future:
    """Starts compiling the program of `cell` on the profile's own background thread (not the
    run's precompile thread, whose next-bucket programs must not queue behind it)."""
    return self.compiler.submit(self._prepare, cell)

  def _prepare(self, cell: CellKey) -> float:
    """Compiles the program of `cell`; on one process of CPU devices (host memory, no
    collective a background thread could interleave with the run's), also runs once what
    timing it will need (random weights, the program's inputs) so that their own compiles are
    done before the step boundary that times it. Returns the seconds it took."""
    t0 = time.perf_counter()
    stage, bucket, rows, name = cell
    config = ParallelConfig.parse(name)
    entry = self.executables.get(self.executables.key(stage, config, bucket, rows))
    if jax.process_count() == 1 and jax.default_backend() == 'cpu':
      seed = self.config.measure.seed
      _, params = qwen2.init_model(self.model, self.executables.mesh(config), seed=seed)
      builders.make_inputs(entry.program, params, seed=seed)
    return time.perf_counter() - t0

  def busy(self) -> bool:
    """Whether the run's own background compiles (`Executables.precompile`) are under way here."""
    return self.executables.busy()

  def compiled_here(self, cell: CellKey) -> bool:
    """Whether this process holds the compiled program of `cell`."""
    stage, bucket, rows, name = cell
    return self.executables.key(stage, ParallelConfig.parse(name), bucket, rows) in self.executables

  def agreed(self, held: Sequence[bool]) -> list[bool]:
    """Flags every process holds for the same cells (e.g. 'compiled here'), true where they
    are true on every process: a collective, so that every process times the same cells."""
    missing = distributed.process_max([0 if h else 1 for h in held])
    return [m == 0 for m in missing]

  def measure_cells(
    self,
    profile: Profile,
    cells: Sequence[CellKey],
    *,
    proceed: Callable[[Stage, int, int, list[str]], bool],
    params: nnx.State | None = None,
  ) -> tuple[Profile, nnx.State | None]:
    """`profile` with `cells` measured one at a time in their order, each where
    `proceed(stage, bucket, rows, [layout])` agrees (a cell it declines is passed over, and the
    next asked: it must answer alike on every process, since every process times the same
    programs together); a program not compiled yet is compiled first. A cell `profile` has
    measured already is timed again: its calls pooled with the earlier ones (`pooled`). Process
    0's figures on every process; process 0's cache file updated.

    `params`: the random weights of an earlier call (on any layout), reused; returns them, on
    the last layout measured, for the next call (None when nothing was measured)."""
    t0, measured_any = time.perf_counter(), False
    for stage, bucket, rows, name in cells:
      if not proceed(stage, bucket, rows, [name]):
        continue
      config = ParallelConfig.parse(name)
      if params is None:
        mesh = self.executables.mesh(config)
        _, params = qwen2.init_model(self.model, mesh, seed=self.config.measure.seed)
      measured: dict[CellKey, Cell] = {}
      params = _profile_cell(
        self.executables, stage, bucket, rows, [config], self.config, params, measured, None
      )
      agreed = _agreed(profile.key, measured)
      for key, cell in agreed.cells.items():
        earlier = profile.cells.get(key)
        if poolable(earlier, cell):
          agreed.cells[key] = pooled(earlier, cell)
      profile = profile.merged(agreed)
      measured_any = True
    if not measured_any:
      return profile, params
    profile.wall_s += time.perf_counter() - t0
    self.save(profile)
    return profile, params

  def save(self, profile: Profile) -> None:
    """Process 0 writes `profile`'s measured cells to the cache file (when there is one)."""
    if self.cache_path and jax.process_index() == 0:
      profile.save(self.cache_path)
