"""The profile: per (stage, context bucket, rows, layout), a measured throughput and peak memory.

Pure data with a JSON round trip (`to_json` / `from_json`, `save` / `load_cached`): what the
selector ranks layouts by, what a checkpoint keeps and what a cache file holds. It is measured by
`earl_jax.programs.profiling.run` (which compiles and times the programs); nothing here compiles.
A cell that is not measured yet may hold a prior figure (`Cell.prior`, filled by
`selector.prior.complete`); a cache file and a checkpoint keep only the measured cells
(`measured_only`).

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
from typing import Any

import numpy as np
from absl import logging

from earl_jax.config import ParallelConfig
from earl_jax.errors import ConfigError
from earl_jax.stage import Stage

FORMAT_VERSION = 3  # 3: cells carry `prior`; the key leaves out the measurement settings


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
class Cell:
  """One (stage, bucket, rows, config) measurement.

  Attributes:
    peak_bytes: XLA's per-device peak of the program.
    oom: over the budget: not run.
    throughput: median tokens per device per second (None when OOM).
    times_ms: every timed call.
    compile_ms: lower + compile time of the executable.
    measured: a measurement (False: an analytic estimate and a preference score, or a prior).
    prior: where an unmeasured figure comes from (`selector.prior`): '<layout>@<bucket>' (that
      measured cell of the same layout, scaled by the analytic model), 'layouts' (the stage's
      measured layouts, scaled so), 'device' (the analytic time model, scaled by the other
      stages' cells) or 'analytic' (the analytic time model in nominal units); '' for a
      measurement and for an unprofiled stage's preference.
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
