"""The profile table: per (stage, context bucket, rows, layout), a throughput and peak memory,
measured or (for a cell not measured yet) the cost model's (`profiling.cost_model`).

Pure data with a JSON round trip (`to_json` / `from_json`, `save` / `load_cached`): what the
selector ranks layouts by, what a checkpoint keeps and what a cache file holds. It is measured by
`profiling.profiler` (which compiles and times the programs); nothing here compiles. A cell that
is not measured yet may hold the cost model's figure (`Cell.prior` says what it rests on,
`Cell.uncertainty` how uncertain it is; `cost_model.complete`); a cache file and a checkpoint
keep only the measured cells (`measured_only`). `ProfileSettings` says what a run measures.

The cache file is the profile of one setup, shareable between runs and machines of that setup:
its key names everything the figures depend on (device kind and count, software, model,
candidates, grid, budget, program shapes), and `load_cached` refuses a file whose key differs,
in one line naming the fields. How carefully it was timed (`MeasureConfig`) is not part of the
key: a table measured offline with more repeats serves a run that would time fewer.

  profile = Profile.from_json(json.load(open('runs/profile.json')))
  profile.cell(Stage.ROLLOUT, 1024, 16, ParallelConfig(tp=8)).throughput
  profile.covers(Stage.ROLLOUT, 2048, 16)      # every candidate measured there?
"""

import dataclasses
import json
import os
import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

from earl_jax.config import ParallelConfig, check_float32
from earl_jax.errors import ConfigError
from earl_jax.stage import Stage

FORMAT_VERSION = (
  4  # 4: cells carry `uncertainty`; 3: `prior`, and no measurement settings in the key
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasureConfig:
  """How one cell is timed: its figure is the median of at least `MIN_CALLS` timed calls, each
  visit after a warm-up call, so that no single (cold) call decides.

  Attributes:
    warmup: untimed calls before timing, per visit (the first call after a switch is slower).
    repeats: timed calls per visit (at least).
    min_seconds: keep timing a visit until its calls add up to this (short calls are noisier).
    rounds: visits per candidate and cell, in a rotating order (samples >= rounds x repeats).
    seed: seed of the random weights and inputs.
  """

  MIN_CALLS = 3

  warmup: int = 1
  repeats: int = 3
  min_seconds: float = 0.0
  rounds: int = 1
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
    if self.repeats * self.rounds < self.MIN_CALLS:
      raise ConfigError(
        f'MeasureConfig.repeats x rounds is {self.repeats} x {self.rounds}: a figure is the median '
        f'of at least {self.MIN_CALLS} timed calls; raise repeats or rounds.'
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
  """Which stages a run's profile measures, where it is cached, and how and when it measures
  (the `SelectorConfig.profile` of a run; `profiler.ProfileGrid` is the grid it resolves to).

  Attributes:
    stages: stages ranked by a measured profile (the paper profiles rollout decode); the others
      are ranked by the analytic model and the fewest-splits preference.
    cache: JSON file of the profile (reused when it matches the setup).
    measure: how each cell is timed.
    lazy: measure a bucket when the run reaches it (a run pays only for the buckets it
      reaches); False: every bucket at start-up, before the first step.
    prior: with `lazy`, decide on the cost model (`profiling.cost_model`) where a cell is not
      measured yet, and measure between steps, never holding a decision up: the cells the next
      decisions would rank by and those of the next bucket up (`Selector.wanted`), compiled in
      the background and timed at the start of a step (`schedule.ProfileScheduler`); False: a
      decision waits until its buckets are measured whole (`Selector.missing`).
    confidence: the model's bounds are its figure x exp(+-confidence x its relative standard
      deviation); a candidate is left unmeasured at a bucket only while its upper bound is below
      the best candidate's lower bound, and a layout not measured there ranks by its lower bound
      (0: measure every candidate that fits, and rank on the model's figure alone).
    retimes: how many times a measured cell is timed again while its bounds (its noise) overlap
      the best measured layout's at a bucket a decision ranks or runs at (the best's too, while
      another overlaps it): one session's calls understate the noise between sessions
      (docs/results/main-job.md, issue 40: 7.5% median between two profiles of one machine, a
      cell's own spread 1-3%), so a ranking within it is checked by a second session whose
      calls are pooled with the first's (`pooled`). 0: a measured cell stands.
    settle: at the longest bucket a stage has reached, once it has decided there this many
      times in a row (a bucket it stays in, not one it passes through), every layout that fits
      is wanted there, pruned or not: crossovers happen at long contexts.
    max_share: between steps, measuring stops once it would take the time spent measuring
      past this share of the run's time so far (process 0's clock); what is left waits for a
      later step, the model standing in.
    compile_share: the profile's background compiles (programs only the profile runs) start
      only while their seconds stay within this share of the run's time (each counted at its
      stage's median so far; one that does not fit yet is passed by a cheaper one behind it): a
      compile takes a core from the steps. Why 0.3: on the default (2 cores), no limit took the
      demo from 5:23 to 8:48, and 0.1 left 4 cells measured in 60 steps
      (docs/results/tried.md).
    ahead: the next bucket's cells are wanted (compiled ahead) once the longest context has
      come this share of the way from the bucket below the run bucket to the run bucket (0: as
      soon as the run is in a bucket; 1: only at its top). Why 0.75: the default's 60 steps
      stay below 900 tokens of their 1024 bucket; compiling the 1536 bucket's candidates there
      would take CPU from the steps, on 2 cores, for a bucket the run never reaches.
  """

  stages: tuple[Stage | str, ...] = (Stage.ROLLOUT,)
  cache: str | None = None
  measure: MeasureConfig = dataclasses.field(default_factory=MeasureConfig)
  lazy: bool = False
  prior: bool = True
  confidence: float = 2.0
  retimes: int = 1
  settle: int = 5
  max_share: float = 0.1
  compile_share: float = 0.3
  ahead: float = 0.75

  def __post_init__(self):
    object.__setattr__(self, 'stages', tuple(Stage.parse(s) for s in self.stages))
    check_float32(self, 'confidence', 'max_share', 'compile_share', 'ahead')
    if not 0 <= self.ahead <= 1:
      raise ConfigError(f'ProfileSettings.ahead must be in [0, 1], got {self.ahead}.')
    if not 0 <= self.confidence <= 10:
      raise ConfigError(
        f'ProfileSettings.confidence must be in [0, 10] standard deviations, got {self.confidence}.'
      )
    if not 0 < self.max_share <= 1:
      raise ConfigError(f'ProfileSettings.max_share must be in (0, 1], got {self.max_share}.')
    if not 0 < self.compile_share <= 1:
      raise ConfigError(
        f'ProfileSettings.compile_share must be in (0, 1], got {self.compile_share}.'
      )
    if not isinstance(self.retimes, int) or self.retimes < 0:
      raise ConfigError(f'ProfileSettings.retimes must be an int >= 0, got {self.retimes!r}.')
    if not isinstance(self.settle, int) or self.settle < 0:
      raise ConfigError(f'ProfileSettings.settle must be an int >= 0, got {self.settle!r}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cell:
  """One (stage, bucket, rows, config) measurement.

  Attributes:
    peak_bytes: XLA's per-device peak of the program.
    oom: over the budget: not run.
    throughput: median tokens per device per second (None when OOM).
    times_ms: every timed call.
    compile_ms: lower + compile time of the executable.
    measured: a measurement (False: an analytic estimate and a preference score, or the cost
      model's figure).
    prior: where an unmeasured figure comes from (`cost_model`): '<layout>@<buckets>' (the
      layout's own curve, fitted to its measured cells at those buckets), 'stage' (the stage's
      pooled curve: the layout is not measured anywhere), 'device' (the analytic time model,
      scaled by the other stages' cells) or 'analytic' (the analytic time model in nominal
      units); '' for a measurement and for an unprofiled stage's preference.
    uncertainty: the relative standard deviation of the throughput (a measurement's noise, or
      the cost model's uncertainty; `cost_model.complete` fills it).
    timed_by: whose calls a measurement times: 'profile' (the profile's own, between steps or
      offline) or 'run' (the calls the run's steps made of the program it ran: no extra calls).
    sessions: how many separate timings `times_ms` pools: a profile's rounds (`MeasureConfig`:
      each a visit of its own), and one more each time a cell near the best is timed again
      (`ProfileSettings.retimes`, `pooled`).
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
  prior: str = ''
  uncertainty: float = 0.0
  timed_by: str = 'profile'
  sessions: int = 1

  def as_dict(self) -> dict[str, Any]:
    """JSON-able (`from_dict` reads it back)."""
    return {**dataclasses.asdict(self), 'stage': str(self.stage)}

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> 'Cell':
    return cls(**{**data, 'stage': Stage.parse(data['stage']), 'times_ms': tuple(data['times_ms'])})

  @property
  def spread(self) -> float | None:
    """(p75 - p25) / median of the timed calls: the within-run noise of this cell."""
    if len(self.times_ms) < 2:
      return None
    q25, q50, q75 = np.percentile(self.times_ms, [25, 50, 75])
    return float((q75 - q25) / q50)


CellKey = tuple[Stage, int, int, str]


def poolable(first: Cell | None, again: Cell) -> bool:
  """Whether `again` can be pooled with `first` (`pooled`): both timed, with their calls."""
  return first is not None and all(
    c.measured and c.throughput and c.times_ms for c in (first, again)
  )


def pooled(first: Cell, again: Cell) -> Cell:
  """A measured cell timed again: the two sessions' calls pooled, its figure the pooled median
  (the throughput scales as 1 / the median call), its sessions counted; whose calls it times
  and its compile time stay the first's."""
  if not poolable(first, again):
    raise ValueError(f'only two timings of a cell pool, got {first} and {again}')
  times = first.times_ms + again.times_ms
  scale = statistics.median(first.times_ms) / statistics.median(times)
  return dataclasses.replace(
    again,
    throughput=first.throughput * scale,
    times_ms=times,
    compile_ms=first.compile_ms or again.compile_ms,
    timed_by=first.timed_by,
    sessions=first.sessions + again.sessions,
  )


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

  def rows_for(self, stage: Stage) -> tuple[int, ...]:
    """The row counts profiled for `stage`: its one count where the key fixes it (the rollout
    on its slots), else every load bin."""
    fixed = self.key.get('stage_rows', {}).get(str(Stage.parse(stage)))
    return (fixed,) if fixed is not None else self.rows

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

  def measured_only(self) -> 'Profile':
    """This profile without its prior cells: what a cache file and a checkpoint keep."""
    cells = {k: c for k, c in self.cells.items() if c.measured}
    return Profile(key=self.key, cells=cells, wall_s=self.wall_s)

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
    """The fastest cell with a figure at (stage, bucket, rows) (None: none has one)."""
    stage = Stage.parse(stage)
    cells = [self.cells.get((stage, bucket, rows, c.name)) for c in self.candidates(stage)]
    cells = [c for c in cells if c is not None and c.throughput is not None]
    return max(cells, key=lambda c: c.throughput) if cells else None

  def to_json(self) -> dict[str, Any]:
    return {
      'format': FORMAT_VERSION,
      'key': self.key,
      'wall_s': self.wall_s,
      'cells': [c.as_dict() for c in self.cells.values()],
    }

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> 'Profile':
    cells = {}
    for c in data['cells']:
      cell = Cell.from_dict(c)
      cells[(cell.stage, cell.bucket, cell.rows, cell.config)] = cell
    return cls(key=data['key'], cells=cells, wall_s=data.get('wall_s', 0.0))

  def save(self, path: str) -> bool:
    """Writes the measured cells to `path` (atomically); False, logged, when it cannot be
    written (a shared read-only table: the run goes on without caching)."""
    tmp = f'{path}.{os.getpid()}.tmp'  # two processes saving at once each replace it whole
    try:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      with open(tmp, 'w') as f:
        json.dump(self.measured_only().to_json(), f, indent=1)
      os.replace(tmp, path)
    except OSError as e:
      logging.warning('Profile %s was not written (%s); the run goes on without it.', path, e)
      return False
    return True


def report(profile: Profile) -> str:
  """What a profile says, in lines: the fastest layout of every stage and bucket at each load the
  stage is profiled at (`rows_for`), and the median and p90 spread of the cells' timed calls."""
  lines = []
  for stage in profile.stages:
    for rows in profile.rows_for(stage):
      best = [profile.best(stage, b, rows) for b in profile.buckets]
      row = ', '.join(
        f'{b}: {c.config if c else "none fits"}' for b, c in zip(profile.buckets, best)
      )
      lines.append(f'{stage} ({rows} responses): {row}')
  spreads = [c.spread for c in profile.cells.values() if c.spread is not None]
  if spreads:
    lines.append(
      f'within-cell spread of the timed calls, (p75 - p25) / median: median '
      f'{np.median(spreads):.1%}, p90 {np.percentile(spreads, 90):.1%}'
    )
  return '\n'.join(lines)


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


def refusal(path: str, expected: dict[str, Any], found: dict[str, Any]) -> str | None:
  """The one-line reason a profile file made for `found` is not used for `expected` (None: it
  is the same setup)."""
  diff = key_mismatch(expected, found)
  if not diff:
    return None
  return f'Profile {path} was made for another setup (differs in {", ".join(diff)}); not used.'


def load_cached(path: str, key: dict[str, Any]) -> Profile | None:
  """The profile at `path` if it was made for exactly `key`; None when it was not (the one-line
  reason is logged as a warning: `refusal`)."""
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
  reason = refusal(path, key, found)
  if reason is not None:
    logging.warning('%s', reason)
    return None
  return Profile.from_json(data).measured_only()
