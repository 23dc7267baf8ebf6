"""Start-up profiling: throughput of every feasible candidate per (stage, context bucket, rows).

For each stage, bucket and number of responses (rows), every candidate layout is compiled
ahead of time; a layout whose XLA per-device peak exceeds the budget is recorded as OOM and
never run. The others are measured: decode tokens per device per second (TGS) for rollout,
tokens per device per second for experience and train. Every measurement is warmed up and
repeated; the median is kept. To keep background load on a shared machine from favouring one
layout, the candidates of a cell are visited in `rounds` passes, in a rotating order.

The result is a `Profile`, cached as JSON keyed by hardware, model, candidate set, grid, budget
and measurement settings: a later run on the same setup reuses it, and a file made for another
model or machine is detected and rebuilt, never trusted.

  profile = profiler.run(cfg, ProfileConfig(buckets=..., rows=(8, 16), budget_bytes=...),
                         executables=exe, cache_path='runs/profile.json')
  profile.cell(Stage.ROLLOUT, 1024, 16, ParallelConfig(tp=8)).throughput

The programs measured are the ones that run: `executables.get(...)` of every candidate key, so
a profiled rollout cell times the engine's own generate program (a prompt chunk of
`spec.chunk` tokens, then `spec.decode_tokens` decoded tokens, with end-of-turn disabled).
"""

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from earl_jax import distributed
from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.errors import ConfigError
from earl_jax.models import qwen2
from earl_jax.programs import builders
from earl_jax.programs import memory as memory_lib
from earl_jax.programs.executables import Executables
from earl_jax.selector.candidates import stage_candidates
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import STAGES, Stage

FORMAT_VERSION = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasureConfig:
  """How one cell is timed.

  Attributes:
    warmup: untimed calls before timing, per visit (the first call after a switch is slower).
    repeats: timed calls per visit (at least).
    min_seconds: keep timing a visit until its calls add up to this (short calls are noisier).
    rounds: visits per candidate and cell, in a rotating order (samples >= rounds x repeats).
    seed: seed of the random weights and inputs.
  """

  warmup: int = 1
  repeats: int = 2
  min_seconds: float = 0.0
  rounds: int = 2
  seed: int = 0

  def __post_init__(self):
    if self.warmup < 1:
      raise ConfigError(
        f'MeasureConfig.warmup must be >= 1 (compile and first-call costs), got {self.warmup}.'
      )
    for name in ('repeats', 'rounds'):
      if getattr(self, name) < 1:
        raise ConfigError(f'MeasureConfig.{name} must be >= 1, got {getattr(self, name)}.')
    if self.min_seconds < 0:
      raise ConfigError(f'MeasureConfig.min_seconds must be >= 0, got {self.min_seconds}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileConfig:
  """What to profile.

  Attributes:
    stages: stages to profile.
    buckets: the context-length table (every bucket is profiled).
    rows: numbers of responses (the load bins), strictly increasing.
    budget_bytes: per-device memory budget; cells over it are OOM and not run (None: unlimited).
    candidates: restrict the layouts (default: every valid factorisation of the devices).
    with_fsdp: the stages whose candidates include fsdp > 1 layouts (True: all, False: none);
      an fsdp layout in `candidates` is dropped for the other stages.
    measure: how each cell is timed.
    spec: static stage settings (sampling, prompt chunk, micro-batches, optimizer).
  """

  stages: tuple[Stage | str, ...] = (Stage.ROLLOUT,)
  buckets: BucketConfig
  rows: tuple[int, ...]
  budget_bytes: int | None
  candidates: tuple[ParallelConfig, ...] | None = None
  with_fsdp: bool | tuple[Stage | str, ...] = True
  measure: MeasureConfig = dataclasses.field(default_factory=MeasureConfig)
  spec: builders.StageSpec = dataclasses.field(default_factory=builders.StageSpec)

  def __post_init__(self):
    if not self.stages:
      raise ConfigError('ProfileConfig.stages is empty.')
    object.__setattr__(self, 'stages', tuple(Stage.parse(s) for s in self.stages))
    object.__setattr__(self, 'with_fsdp', fsdp_stages(self.with_fsdp))
    rows = tuple(self.rows)
    if not rows or any(not isinstance(r, int) or r <= 0 for r in rows):
      raise ConfigError(f'ProfileConfig.rows must be positive ints, got {rows}.')
    if list(rows) != sorted(set(rows)):
      raise ConfigError(f'ProfileConfig.rows must be strictly increasing, got {rows}.')
    object.__setattr__(self, 'rows', rows)
    if self.budget_bytes is not None and (
      not isinstance(self.budget_bytes, int) or self.budget_bytes <= 0
    ):
      raise ConfigError(
        f'ProfileConfig.budget_bytes must be a positive int, got {self.budget_bytes!r}.'
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cell:
  """One (stage, bucket, rows, config) measurement.

  Attributes:
    peak_bytes: XLA's per-device peak of the program.
    oom: over the budget: not run.
    throughput: median tokens per device per second (None when OOM).
    times_ms: every timed call.
    compile_ms: lower + compile time of the executable.
    measured: a measurement (False: an analytic estimate and a preference score).
  """

  stage: Stage
  config: str
  bucket: int
  rows: int
  peak_bytes: int
  oom: bool
  throughput: float | None
  times_ms: tuple[float, ...] = ()
  compile_ms: float = 0.0
  measured: bool = True

  @property
  def spread(self) -> float | None:
    """(p75 - p25) / median of the timed calls: the within-run noise of this cell."""
    if len(self.times_ms) < 2:
      return None
    q25, q50, q75 = np.percentile(self.times_ms, [25, 50, 75])
    return float((q75 - q25) / q50)


CellKey = tuple[Stage, int, int, str]


@dataclasses.dataclass(kw_only=True)
class Profile:
  """The measured table: cells by (stage, bucket, rows, config name), and what it is valid for."""

  key: dict[str, Any]
  cells: dict[CellKey, Cell]
  wall_s: float = 0.0

  def cell(self, stage: Stage, bucket: int, rows: int, config: ParallelConfig | str) -> Cell:
    name = config if isinstance(config, str) else config.name
    try:
      return self.cells[(Stage.parse(stage), bucket, rows, name)]
    except KeyError:
      raise KeyError(
        f'The profile has no cell ({stage}, bucket {bucket}, rows {rows}, {name}); it covers '
        f'buckets {self.buckets}, rows {self.rows} and configs {self.key["candidates"].get(stage)}.'
      ) from None

  @property
  def stages(self) -> tuple[Stage, ...]:
    return tuple(Stage.parse(s) for s in self.key['stages'])

  @property
  def buckets(self) -> tuple[int, ...]:
    return tuple(self.key['buckets'])

  @property
  def rows(self) -> tuple[int, ...]:
    return tuple(self.key['rows'])

  def candidates(self, stage: Stage) -> list[ParallelConfig]:
    if stage not in self.key['candidates']:
      raise KeyError(f'The profile has no {stage!r} stage; it has {self.stages}.')
    return [ParallelConfig.parse(n) for n in self.key['candidates'][stage]]

  def covers(self, stage: Stage, bucket: int, rows: int) -> bool:
    """Whether every candidate of `stage` has a cell at (bucket, rows)."""
    stage = Stage.parse(stage)
    if str(stage) not in self.key['candidates']:
      return False
    return all((stage, bucket, rows, c.name) in self.cells for c in self.candidates(stage))

  def merged(self, other: 'Profile') -> 'Profile':
    """This profile with `other`'s cells added (same setup; other's cells win)."""
    return Profile(
      key=self.key, cells={**self.cells, **other.cells}, wall_s=self.wall_s + other.wall_s
    )

  def rows_bin(self, num_responses: int) -> int:
    """The smallest profiled row count that holds `num_responses` (the load bin)."""
    for r in self.rows:
      if r >= num_responses:
        return r
    raise ValueError(
      f'{num_responses} responses is more than the largest profiled load {self.rows[-1]} '
      f'(profiled rows: {self.rows}); profile a larger load.'
    )

  def best(self, stage: Stage, bucket: int, rows: int) -> Cell | None:
    cells = [self.cell(stage, bucket, rows, c) for c in self.candidates(stage)]
    cells = [c for c in cells if c.throughput is not None]
    return max(cells, key=lambda c: c.throughput) if cells else None

  def to_json(self) -> dict[str, Any]:
    return {
      'format': FORMAT_VERSION,
      'key': self.key,
      'wall_s': self.wall_s,
      'cells': [{**dataclasses.asdict(c), 'stage': str(c.stage)} for c in self.cells.values()],
    }

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> 'Profile':
    cells = {}
    for c in data['cells']:
      cell = Cell(**{**c, 'stage': Stage.parse(c['stage']), 'times_ms': tuple(c['times_ms'])})
      cells[(cell.stage, cell.bucket, cell.rows, cell.config)] = cell
    return cls(key=data['key'], cells=cells, wall_s=data.get('wall_s', 0.0))

  def save(self, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f'{path}.{os.getpid()}.tmp'  # two processes saving at once each replace it whole
    with open(tmp, 'w') as f:
      json.dump(self.to_json(), f, indent=1)
    os.replace(tmp, path)


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
  model: ModelConfig, config: ProfileConfig, candidates: dict[Stage, list[ParallelConfig]]
) -> dict[str, Any]:
  """The JSON-able identity of a profile: a cached file is reused only when this matches."""
  spec = config.spec
  return {
    'hardware': hardware(),
    'model': dataclasses.asdict(model),
    'stages': [str(s) for s in config.stages],
    'candidates': {str(s): [c.name for c in cands] for s, cands in candidates.items()},
    'buckets': list(config.buckets.lengths),
    'rows': list(config.rows),
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
    'measure': dataclasses.asdict(config.measure),
  }


def key_mismatch(expected: dict[str, Any], found: dict[str, Any]) -> list[str]:
  """The top-level fields (and hardware/model sub-fields) that differ, for the log."""
  out = []
  for k in sorted(set(expected) | set(found)):
    a, b = expected.get(k), found.get(k)
    if a == b:
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      sub = [s for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)]
      out.append(f'{k}.{{{", ".join(sub)}}}')
    else:
      out.append(k)
  return out


def load_cached(path: str, key: dict[str, Any]) -> Profile | None:
  """The profile at `path` if it was made for exactly `key`; None (logged) when it was not."""
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      data = json.load(f)
    if data.get('format') != FORMAT_VERSION:
      raise ValueError(f'format {data.get("format")} != {FORMAT_VERSION}')
    found = data['key']
  except (OSError, ValueError, KeyError, TypeError) as e:
    logging.warning('Profile cache %s is unreadable (%s); rebuilding it.', path, e)
    return None
  diff = key_mismatch(key, found)
  if diff:
    logging.warning(
      'Profile cache %s was made for another setup (differs in %s); rebuilding it.', path, diff
    )
    return None
  return Profile.from_json(data)


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


def fsdp_stages(with_fsdp: bool | Sequence[Stage | str]) -> tuple[Stage, ...]:
  """The stages a `with_fsdp` setting names (True: every stage, False: none)."""
  if isinstance(with_fsdp, bool):
    return tuple(STAGES) if with_fsdp else ()
  return tuple(Stage.parse(s) for s in with_fsdp)


def candidates_for(
  stage: Stage,
  model: ModelConfig,
  *,
  num_devices: int,
  rows: Sequence[int],
  with_fsdp: Sequence[Stage],
  only: Sequence[ParallelConfig] | None,
) -> list[ParallelConfig]:
  """A stage's candidates: `only` (fsdp layouts kept for the `with_fsdp` stages), or every
  valid layout of the devices."""
  fsdp = stage in with_fsdp
  if only is not None:
    only = [c for c in only if fsdp or c.fsdp == 1]
  return stage_candidates(
    stage, model, num_devices=num_devices, rows=rows, with_fsdp=fsdp, only=only
  )


def default_candidates(
  model: ModelConfig, config: ProfileConfig, num_devices: int | None = None
) -> dict[Stage, list[ParallelConfig]]:
  n = num_devices or len(mesh_lib.canonical_devices())
  return {
    s: candidates_for(
      s, model, num_devices=n, rows=config.rows, with_fsdp=config.with_fsdp, only=config.candidates
    )
    for s in config.stages
  }


def run(
  model: ModelConfig,
  config: ProfileConfig,
  *,
  executables: Executables | None = None,
  params: nnx.State | None = None,
  cache_path: str | None = None,
  progress: Callable[[Cell], None] | None = None,
  buckets: Sequence[int] | None = None,
  measure: bool = True,
  base: Profile | None = None,
) -> Profile:
  """Profiles every (stage, bucket, rows, candidate), or loads a matching cached profile.

  Several processes of one program run it together (every process calls it): the programs are
  SPMD, and process 0's cache and measurements are broadcast, so that every process holds the
  same profile and takes the same decisions.

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

  Returns:
    The profile. Every cell over budget is OOM; every other cell has a median throughput.
  """
  candidates = default_candidates(model, config)
  key = profile_key(model, config, candidates)
  cached = None
  if cache_path:
    found = load_cached(cache_path, key) if jax.process_index() == 0 else None
    data = distributed.broadcast_json(None if found is None else found.to_json())
    cached = None if data is None else Profile.from_json(data)
  have = cached or Profile(key=key, cells={})
  if base is not None and base.key == key:
    have = have.merged(base)
  wanted = tuple(config.buckets.lengths if buckets is None else buckets)
  missing = [
    b for b in wanted if not all(have.covers(s, b, r) for s in config.stages for r in config.rows)
  ]
  if cached is not None and not missing:
    logging.info('Reusing the profile in %s (%d cells).', cache_path, len(cached.cells))
  if not missing or not measure:
    return have
  own = executables is None
  exe = executables if executables is not None else Executables(model, spec=config.spec)
  if exe.spec != config.spec:
    raise ValueError(f'Executables spec {exe.spec} differs from the profile spec {config.spec}.')
  t_start = time.perf_counter()
  if params is None:
    first = next(iter(candidates.values()))[0]
    _, params = qwen2.init_model(model, exe.mesh(first), seed=config.measure.seed)
  cells: dict[CellKey, Cell] = {}
  try:
    for stage in config.stages:
      for bucket in missing:
        for rows in config.rows:
          params = _profile_cell(
            exe, stage, bucket, rows, candidates[stage], config, params, cells, progress
          )
  finally:
    if own:
      exe.close()
  measured = Profile(key=key, cells=cells, wall_s=time.perf_counter() - t_start)
  measured = Profile.from_json(distributed.broadcast_json(measured.to_json()))  # process 0's
  profile = have.merged(measured)
  if cache_path and jax.process_index() == 0:
    profile.save(cache_path)
  return profile


def _profile_cell(exe, stage, bucket, rows, candidates, config, params, cells, progress):
  entries, feasible = {}, []
  for c in candidates:
    entry = exe.get(stage, c, bucket, rows)
    entries[c] = entry
    if config.budget_bytes is None or memory_lib.fits(entry.memory.peak, config.budget_bytes):
      feasible.append(c)
    else:
      cell = Cell(
        stage=stage,
        config=c.name,
        bucket=bucket,
        rows=rows,
        peak_bytes=entry.memory.peak,
        oom=True,
        throughput=None,
        compile_ms=entry.lower_ms + entry.compile_ms,
      )
      cells[(stage, bucket, rows, c.name)] = cell
      if progress:
        progress(cell)
  times: dict[ParallelConfig, list[float]] = {c: [] for c in feasible}
  m = config.measure
  for r in range(m.rounds):
    order = feasible[r % len(feasible) :] + feasible[: r % len(feasible)] if feasible else []
    for c in order:
      entry = entries[c]
      params = exe.resharder(params, entry.program.param_shardings)
      args = builders.make_inputs(entry.program, params, seed=m.seed)
      ts, _ = measure(entry, args, warmup=m.warmup, repeats=m.repeats, min_seconds=m.min_seconds)
      times[c].extend(ts)
      del args
  for c in feasible:
    entry = entries[c]
    median_s = statistics.median(times[c]) / 1e3
    cell = Cell(
      stage=stage,
      config=c.name,
      bucket=bucket,
      rows=rows,
      peak_bytes=entry.memory.peak,
      oom=False,
      throughput=entry.program.tokens / median_s / c.num_devices,
      times_ms=tuple(times[c]),
      compile_ms=entry.lower_ms + entry.compile_ms,
    )
    cells[(stage, bucket, rows, c.name)] = cell
    if progress:
      progress(cell)
  return params
