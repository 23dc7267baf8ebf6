"""The prior: a figure for every (stage, bucket, rows, layout) before it is measured.

A run decides from its first step on, without waiting for measurements: where the profile has no
cell, `complete` puts a prior one, from the analytic models (`selector.analytic`):

- memory: the analytic per-device peak (`analytic.estimate`);
- speed: the nearest measured cell of the same layout (`prior='dp8.tp1@256'`), its time per
  call scaled by how the stage's whole work grows from there to here (`analytic.call_seconds` of
  the program on one device: the same factor for every layout, so that nearby the layouts keep
  the order they were measured in); for a layout not measured anywhere yet, the median of the
  stage's measured layouts scaled so (`'layouts'`). A stage with no measured cell yet takes the
  analytic model's figure per layout, scaled to this device by the median of measured over
  analytic time of the other stages' cells (`'device'`); before any measurement at all, the
  analytic figure itself (`'analytic'`: nominal speeds, so only their ratios mean anything).

Every figure is a function of the measured cells and the setup alone, so every process of a run
(and a resume, from the checkpoint's cells) computes the same prior.

`to_measure` names the candidates of a (stage, bucket, rows) worth measuring: not measured yet,
not over the budget even by the analytic model's lower bound, and not ruled out by the prior by a
wide margin: a layout whose own measurement at another bucket, scaled here, is below
1 / `factor` of the best figure there is left unmeasured (its prior stays).

  full = prior.complete(measured, model=cfg, shapes=spec)
  full.cell(Stage.ROLLOUT, 512, 64, 'dp8.tp1').prior      # 'dp8.tp1@256'
  prior.to_measure(full, Stage.ROLLOUT, 512, 64, budget=None, margin=0.05, factor=2.0)
"""

import dataclasses
import functools
import math
import statistics
from collections.abc import Sequence

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.selector import analytic
from earl_jax.selector.profile import Cell, Profile
from earl_jax.stage import Stage

ANALYTIC = 'analytic'
LAYOUTS = 'layouts'
DEVICE = 'device'
_ONE = ParallelConfig().name  # the single-device layout: a stage's whole work


def tokens_per_call(stage: Stage, bucket: int, rows: int, decode_tokens: int) -> int:
  """The tokens a call counts in its throughput: rows x N for rollout, rows x bucket otherwise."""
  return rows * (decode_tokens if stage == Stage.ROLLOUT else bucket)


def seconds_per_call(cell: Cell, decode_tokens: int) -> float:
  """The time of one call a measured cell implies (its throughput is per device)."""
  devices = ParallelConfig.parse(cell.config).num_devices
  tokens = tokens_per_call(cell.stage, cell.bucket, cell.rows, decode_tokens)
  return tokens / (cell.throughput * devices)


@dataclasses.dataclass(frozen=True)
class _Analytic:
  """The analytic models of one model and program shapes (hashable: the figures are memoised)."""

  model: ModelConfig
  decode_tokens: int
  chunk: int
  micro_batches: int

  def seconds(self, stage: Stage, config: str, bucket: int, rows: int) -> float:
    return _figures(self, stage, config, bucket, rows)[0]

  def peak(self, stage: Stage, config: str, bucket: int, rows: int) -> int:
    return _figures(self, stage, config, bucket, rows)[1]


@functools.lru_cache(maxsize=8192)  # a few hundred cells per setup
def _figures(models: _Analytic, stage: Stage, config: str, bucket: int, rows: int):
  """(analytic seconds of a call, analytic per-device peak) of one cell."""
  parallel = ParallelConfig.parse(config)
  shapes = {
    'decode_tokens': models.decode_tokens,
    'chunk': models.chunk,
    'micro_batches': models.micro_batches,
  }
  seconds = analytic.call_seconds(stage, models.model, parallel, bucket, rows, **shapes)
  peak = analytic.estimate(stage, models.model, parallel, bucket, rows, **shapes).total
  return seconds, peak


def complete(profile: Profile, *, model: ModelConfig, shapes: analytic.ProgramShapes) -> Profile:
  """`profile` with a prior cell wherever it has none (every stage, bucket, rows and candidate
  of its key); its own cells are kept as they are."""
  models = _Analytic(model, shapes.decode_tokens, shapes.chunk, shapes.micro_batches)
  every = [c for c in profile.cells.values() if _timed(c)]
  scales = [seconds_per_call(c, models.decode_tokens) / models.seconds(*_at(c)) for c in every]
  device = statistics.median(scales) if scales else None
  cells = dict(profile.cells)
  for stage in profile.stages:
    timed = [c for c in every if c.stage == stage]
    for bucket in profile.buckets:
      for rows in profile.rows:
        for config in profile.candidates(stage):
          key = (stage, bucket, rows, config.name)
          if key not in cells:
            cells[key] = _prior_cell(models, timed, device, key)
  return Profile(key=profile.key, cells=cells, wall_s=profile.wall_s)


def _at(cell: Cell) -> tuple[Stage, str, int, int]:
  return cell.stage, cell.config, cell.bucket, cell.rows


def _timed(cell: Cell) -> bool:
  return cell.measured and not cell.oom and bool(cell.throughput)


def _prior_cell(models: _Analytic, timed: Sequence[Cell], device: float | None, key) -> Cell:
  """The prior cell at `key` from the stage's `timed` cells, or the `device` scale."""
  stage, bucket, rows, config = key
  own = [c for c in timed if c.config == config]
  if own:
    near = _nearest(own, bucket, rows)
    seconds = _scaled(models, near, bucket, rows)
    basis = f'{near.config}@{near.bucket}' + (f'x{near.rows}' if near.rows != rows else '')
  elif timed:
    layouts = sorted({c.config for c in timed})
    nearest = [_nearest([c for c in timed if c.config == n], bucket, rows) for n in layouts]
    seconds = statistics.median(_scaled(models, c, bucket, rows) for c in nearest)
    basis = LAYOUTS
  else:
    seconds = models.seconds(stage, config, bucket, rows) * (device or 1.0)
    basis = ANALYTIC if device is None else DEVICE
  devices = ParallelConfig.parse(config).num_devices
  return Cell(
    stage=stage,
    config=config,
    bucket=bucket,
    rows=rows,
    peak_bytes=models.peak(stage, config, bucket, rows),
    oom=False,
    throughput=tokens_per_call(stage, bucket, rows, models.decode_tokens) / (seconds * devices),
    measured=False,
    prior=basis,
  )


def _nearest(cells: Sequence[Cell], bucket: int, rows: int) -> Cell:
  """The measured cell closest in (log bucket, log rows); the larger bucket on a tie."""
  return min(
    cells,
    key=lambda c: (abs(math.log(c.bucket / bucket)) + abs(math.log(c.rows / rows)), -c.bucket),
  )


def _scaled(models: _Analytic, cell: Cell, bucket: int, rows: int) -> float:
  """The seconds of a call at (bucket, rows) on the layout of a measured `cell`: its measured
  time, scaled by how the stage's whole work grows from there (the analytic seconds of the
  program on one device). The same scaling for every layout: the prior keeps the layouts in
  the order they were measured in, nearby."""
  work = models.seconds(cell.stage, _ONE, bucket, rows)
  at_cell = models.seconds(cell.stage, _ONE, cell.bucket, cell.rows)
  return seconds_per_call(cell, models.decode_tokens) * work / at_cell


def lower_need(need: int) -> float:
  """The least XLA's peak can be when the analytic model says `need`, within its stated error
  (|analytic - xla| <= max(rel x xla, abs))."""
  return max(0.0, min(need / (1 + analytic.ANALYTIC_REL_ERROR), need - analytic.ANALYTIC_ABS_ERROR))


def to_measure(
  profile: Profile,
  stage: Stage,
  bucket: int,
  rows: int,
  *,
  budget: int | None,
  margin: float,
  factor: float,
) -> list[str]:
  """The candidates at (stage, bucket, rows) worth measuring, the most promising first.

  Left out: the measured ones (timed, or over the budget by XLA's peak); those over the budget
  even at the analytic model's lower bound (`lower_need`) x (1 + margin); and, with `factor`
  > 0, those whose prior comes from their own measurement elsewhere and is below 1 / `factor`
  of the best figure among the candidates that fit (measured or prior). `profile` must have a
  cell for every candidate (`complete`).
  """
  cells = [profile.cell(stage, bucket, rows, c) for c in profile.candidates(stage)]

  def fits(cell: Cell) -> bool:
    need = cell.peak_bytes if cell.measured else lower_need(cell.peak_bytes)
    return budget is None or need * (1 + margin) <= budget

  fitting = [c for c in cells if fits(c) and not c.oom and c.throughput]
  best = max((c.throughput for c in fitting), default=0.0)
  out = []
  for cell in fitting:
    if cell.measured:
      continue
    own = cell.prior.startswith(f'{cell.config}@')
    if factor > 0 and own and cell.throughput * factor < best:
      continue
    out.append(cell)
  return [c.config for c in sorted(out, key=lambda c: -c.throughput)]
