"""The cost model: per (stage, layout), the time of one call over (bucket, rows), fitted to that
layout's own measured cells, with how uncertain it is.

Every layout has its own curve, shaped by the analytic time model (`analytic.call_terms`):

  seconds(bucket, rows) = w_matmul x matmul + w_attention x attention + w_memory x memory
                          + w_comm x comm + w_fixed

where `matmul`, `attention` and `memory` are one device's share of the stage's weight FLOPs,
attention-score FLOPs (quadratic in the context) and memory traffic (its work divided by the
layout's width), `comm` its tensor-parallel all-reduces and fsdp gathers (which grow with the
bucket), all in the analytic model's nominal seconds, and `w_fixed` a cost per call, in seconds. The weights are the layout's own, so two layouts' curves can cross: a
layout with a larger fixed cost and a smaller compute weight loses at short contexts and wins at
long ones. Nothing is shared between layouts but the prior.

The weights are fitted in three levels, each the prior of the next (Gaussian, non-negative MAP,
errors relative to the measured time; `_fit`):

1. the device: the scale `s` of measured over analytic time, the median over every timed cell
   of any stage (none yet: 1, and the figures are the analytic model's nominal ones);
2. the stage: every timed cell of the stage, pooled, on the prior (s, s, s, s, 0) with standard
   deviations (s, s, s, s, a typical measured call);
3. the layout: its own timed cells, on the stage's weights, each widened by `LAYOUT_SPREAD`.

The posterior covariance gives every figure a relative standard deviation (`Estimate.rel_std`),
which is large until a layout has been measured at two buckets (one bucket cannot tell its fixed
cost from its compute), and small near its measured cells. Decisions and the measurement policy
use the bounds `figure x exp(+-confidence x rel_std)`: a layout is left unmeasured only while
its upper bound stays below the best layout's lower bound (`to_measure`).

Every figure is a function of the measured cells and the setup alone, so every process of a run
(and a resume, from the checkpoint's cells) computes the same model.

  model = cost_model.CostModel.fit(profile, model=cfg, shapes=spec)
  model.estimate(Stage.TRAIN, 'fsdp8', 1024, 64)      # Estimate(seconds, rel_std, basis)
  full = cost_model.complete(profile, model=cfg, shapes=spec)     # a figure in every cell
  cost_model.to_measure(full, Stage.TRAIN, 1024, 64, budget=None, margin=0.05, confidence=2.0)
"""

import dataclasses
import functools
import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.profiling import analytic
from earl_jax.profiling.table import Cell, Profile
from earl_jax.stage import Stage

# Where an unmeasured figure comes from (`Cell.prior`, `Estimate.basis`); a layout's own fit is
# '<layout>@<bucket>,<bucket>...' (the buckets of its measured cells).
ANALYTIC = 'analytic'  # no measurement at all: the analytic model's nominal units
DEVICE = 'device'  # the stage has no measured cell: the analytic model x the device's scale
STAGE = 'stage'  # the layout has no measured cell: the stage's pooled weights

# Prior standard deviation of the stage's weights, relative to the device's scale: weakly
# informative, since a CPU's speeds stand in other ratios than the nominal ones (fitted over the
# default's offline profile, `docs/results/tried.md`: 1 gave a median error of 73% on experience
# cells from two measured buckets, 30 gave 9%).
DEVICE_SPREAD = 30.0
# Prior standard deviation of a stage's compute weights relative to the other stages' (fitted
# over the default's and think's runs against their offline profiles, docs/results/tried.md:
# 1 gave train 9-10% and think's experience 22%, 2 gave 11-16% and 15%, 10 gave train 54-56%).
STAGE_SPREAD = 2.0
LAYOUT_SPREAD = 1.0  # prior standard deviation of a layout's weights, relative to the stage's
MAX_UNCERTAINTY = 5.0  # beyond a factor e^5 either way a figure is unknown: reported as this
MIN_NOISE = 0.05  # a measured median's least relative error (run-to-run noise on a quiet CPU)
UNTIMED_NOISE = 0.15  # the relative error of a cell without the calls to measure its spread
FEATURES = ('matmul', 'attention', 'memory', 'comm', 'fixed')
MODEL_ERROR = 0.15  # what the curve's shape cannot fit, added to every unmeasured figure


def tokens_per_call(stage: Stage, bucket: int, rows: int, decode_tokens: int) -> int:
  """The tokens a call counts in its throughput: rows x N for rollout, rows x bucket otherwise."""
  return rows * (decode_tokens if stage == Stage.ROLLOUT else bucket)


def seconds_per_call(cell: Cell, decode_tokens: int) -> float:
  """The time of one call a cell's figure implies (its throughput is per device)."""
  devices = ParallelConfig.parse(cell.config).num_devices
  tokens = tokens_per_call(cell.stage, cell.bucket, cell.rows, decode_tokens)
  return tokens / (cell.throughput * devices)


def anchored(cell: Any) -> bool:
  """Whether a figure rests on its layout's own measurements: measured, or fitted to the
  layout's own cells (not the stage's or the device's curve, nor the analytic model's). `cell`:
  a `Cell`, or what has its `measured` and `prior` (a selector's `Option`)."""
  return cell.measured or cell.prior not in (ANALYTIC, DEVICE, STAGE)


def noise(cell: Cell) -> float:
  """The relative error of a measured cell's median: its calls' spread, at least `MIN_NOISE`."""
  spread = cell.spread
  return UNTIMED_NOISE if spread is None else max(spread, MIN_NOISE)


def bounds(cell: Cell, confidence: float) -> tuple[float, float]:
  """(lower, upper) throughput of a cell's figure: x exp(-+confidence x its uncertainty)."""
  spread = math.exp(confidence * cell.uncertainty)
  return cell.throughput / spread, cell.throughput * spread


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The model's time of one call, its relative standard deviation, and what it rests on."""

  seconds: float
  rel_std: float
  basis: str


@dataclasses.dataclass(frozen=True)
class _Terms:
  """The analytic terms of one model and its program shapes (hashable: memoised)."""

  model: ModelConfig
  decode_tokens: int
  chunk: int
  micro_batches: int

  def features(self, stage: Stage, config: str, bucket: int, rows: int) -> np.ndarray:
    """[matmul, attention, memory, comm, 1]: what each weight multiplies."""
    return np.array([*_analytic(self, stage, config, bucket, rows)[0], 1.0])

  def peak(self, stage: Stage, config: str, bucket: int, rows: int) -> int:
    return _analytic(self, stage, config, bucket, rows)[1]


@functools.lru_cache(maxsize=16384)  # a few hundred cells per setup
def _analytic(terms: _Terms, stage: Stage, config: str, bucket: int, rows: int):
  """(the time terms, the per-device peak) of one cell, by the analytic models."""
  args = (stage, terms.model, ParallelConfig.parse(config), bucket, rows)
  shapes = {
    'decode_tokens': terms.decode_tokens,
    'chunk': terms.chunk,
    'micro_batches': terms.micro_batches,
  }
  return analytic.call_terms(*args, **shapes), analytic.estimate(*args, **shapes).total


@dataclasses.dataclass(frozen=True)
class _Posterior:
  """Non-negative weights (MAP) and their covariance (the Gaussian posterior's, at the MAP)."""

  mean: np.ndarray
  cov: np.ndarray

  def predict(self, x: np.ndarray) -> tuple[float, float]:
    """(seconds, relative standard deviation) at features `x`."""
    seconds = float(x @ self.mean)
    std = math.sqrt(max(float(x @ self.cov @ x), 0.0))
    if seconds <= 0:
      return max(std, 1e-9), 1.0  # nothing but the prior's spread: as uncertain as it gets
    return seconds, std / seconds


def _fit(x: np.ndarray, y: np.ndarray, rel: np.ndarray, prior: _Posterior) -> _Posterior:
  """The posterior of weights w >= 0 with y ~ N(x w, (rel y)^2) on `prior` (Gaussian).

  The MAP minimises |(x w - y) / (rel y)|^2 + (w - m)^T P (w - m) over w >= 0: with five
  weights, every active set is tried (2^5 unconstrained solves) and the feasible minimum kept.
  """
  precision = np.linalg.inv(prior.cov)
  a = precision.copy()
  b = precision @ prior.mean
  if len(y):
    weight = 1.0 / (rel * y) ** 2
    a += (x * weight[:, None]).T @ x
    b += (x * weight[:, None]).T @ y

  def objective(w):
    r = (x @ w - y) / (rel * y) if len(y) else np.zeros(0)
    d = w - prior.mean
    return float(r @ r + d @ precision @ d)

  best, best_value = np.zeros_like(prior.mean), None
  n = len(prior.mean)
  for free in itertools.product((True, False), repeat=n):
    idx = np.flatnonzero(free)
    w = np.zeros(n)
    if len(idx):
      w[idx] = np.linalg.solve(a[np.ix_(idx, idx)], b[idx])
    if (w < -1e-15).any():
      continue
    w = np.maximum(w, 0.0)
    value = objective(w)
    if best_value is None or value < best_value:
      best, best_value = w, value
  return _Posterior(best, np.linalg.inv(a))


def _timed(cell: Cell) -> bool:
  return cell.measured and not cell.oom and bool(cell.throughput)


class CostModel:
  """Fitted per-layout curves of one profile (see the module docstring). Use `CostModel.fit`."""

  def __init__(self, terms: _Terms, timed: Sequence[Cell]):
    self._terms = terms
    self._timed = list(timed)
    self._seconds = {id(c): seconds_per_call(c, terms.decode_tokens) for c in self._timed}
    scales = [self._seconds[id(c)] / sum(self._features(c)[:-1]) for c in self._timed]
    self.scale = statistics.median(scales) if scales else None
    typical = statistics.median(self._seconds.values()) if self._timed else None
    self._typical = typical
    self._stages: dict[Stage, _Posterior] = {}
    self._layouts: dict[tuple[Stage, str], _Posterior] = {}

  @classmethod
  def fit(cls, profile: Profile, *, model: ModelConfig, shapes: analytic.ProgramShapes):
    """The model of `profile`'s timed cells, for `model` and the programs' `shapes`."""
    terms = _Terms(model, shapes.decode_tokens, shapes.chunk, shapes.micro_batches)
    return cls(terms, [c for c in profile.cells.values() if _timed(c)])

  def _features(self, cell: Cell) -> np.ndarray:
    return self._terms.features(cell.stage, cell.config, cell.bucket, cell.rows)

  def _data(self, cells: Sequence[Cell]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.array([self._features(c) for c in cells]).reshape(len(cells), len(FEATURES))
    y = np.array([self._seconds[id(c)] for c in cells])
    rel = np.array([noise(c) for c in cells])
    return x, y, rel

  def _others(self, stage: Stage) -> _Posterior | None:
    """Level 1, per stage: the device's compute weights (matmul, attention, memory, comm) fitted
    to the other stages' timed cells, each of those stages with a fixed cost of its own, on
    (s, s, s, s) +- `DEVICE_SPREAD` x s (None: no other stage is timed)."""
    others = sorted({c.stage for c in self._timed if c.stage != stage}, key=str)
    if not others:
      return None
    cells = [c for c in self._timed if c.stage in others]
    x, y, rel = self._data(cells)
    terms = len(FEATURES) - 1
    which = np.array([[float(c.stage == o) for o in others] for c in cells])
    fixed = [statistics.median(self._seconds[id(c)] for c in cells if c.stage == o) for o in others]
    s = self.scale
    prior = _Posterior(
      np.array([s] * terms + [0.0] * len(others)),
      np.diag(np.square([DEVICE_SPREAD * s] * terms + fixed)),
    )
    weights = _fit(np.concatenate([x[:, :terms], which], axis=1), y, rel, prior)
    return _Posterior(weights.mean[:terms], weights.cov[:terms, :terms])

  def _stage(self, stage: Stage) -> _Posterior:
    """Level 2: the stage's pooled weights, on the other stages' compute weights (`_others`)."""
    if stage not in self._stages:
      s = self.scale
      cells = [c for c in self._timed if c.stage == stage]
      fixed = statistics.median(self._seconds[id(c)] for c in cells) if cells else self._typical
      terms = len(FEATURES) - 1
      others = self._others(stage)
      cov = np.zeros((terms + 1, terms + 1))
      cov[terms, terms] = fixed**2
      if others is None:
        mean = np.array([s] * terms + [0.0])
        cov[:terms, :terms] = np.diag(np.square([DEVICE_SPREAD * s] * terms))
      else:
        mean = np.append(others.mean, 0.0)
        spread = STAGE_SPREAD * np.maximum(others.mean, 0.1 * s)
        cov[:terms, :terms] = others.cov + np.diag(np.square(spread))
      self._stages[stage] = _fit(*self._data(cells), _Posterior(mean, cov))
    return self._stages[stage]

  def _layout(self, stage: Stage, config: str) -> _Posterior:
    """Level 3: the layout's own weights, on the stage's."""
    key = (stage, config)
    if key not in self._layouts:
      pooled = self._stage(stage)
      floor = np.array([0.1 * self.scale] * (len(FEATURES) - 1) + [0.1 * self._typical])
      spread = LAYOUT_SPREAD * np.maximum(pooled.mean, floor)
      prior = _Posterior(pooled.mean, pooled.cov + np.diag(np.square(spread)))
      cells = [c for c in self._timed if c.stage == stage and c.config == config]
      self._layouts[key] = _fit(*self._data(cells), prior)
    return self._layouts[key]

  def estimate(self, stage: Stage, config: str, bucket: int, rows: int) -> Estimate:
    """The time of one call of `config`'s program at (bucket, rows), its relative standard
    deviation and its basis."""
    stage = Stage.parse(stage)
    x = self._terms.features(stage, config, bucket, rows)
    if self.scale is None:  # nothing measured: the analytic model's nominal seconds
      return Estimate(float(x[:-1].sum()), MAX_UNCERTAINTY, ANALYTIC)
    own = sorted({c.bucket for c in self._timed if c.stage == stage and c.config == config})
    if own:
      basis = f'{config}@{",".join(map(str, own))}'
    elif any(c.stage == stage for c in self._timed):
      basis = STAGE
    else:
      basis = DEVICE
    seconds, rel = self._layout(stage, config).predict(x)
    return Estimate(seconds, min(math.hypot(rel, MODEL_ERROR), MAX_UNCERTAINTY), basis)

  def cell(self, stage: Stage, bucket: int, rows: int, config: str) -> Cell:
    """The unmeasured cell at (stage, bucket, rows, config): the model's throughput, its
    uncertainty and basis, and the analytic per-device peak."""
    est = self.estimate(stage, config, bucket, rows)
    devices = ParallelConfig.parse(config).num_devices
    tokens = tokens_per_call(stage, bucket, rows, self._terms.decode_tokens)
    return Cell(
      stage=stage,
      config=config,
      bucket=bucket,
      rows=rows,
      peak_bytes=self._terms.peak(stage, config, bucket, rows),
      oom=False,
      throughput=tokens / (est.seconds * devices),
      measured=False,
      prior=est.basis,
      uncertainty=est.rel_std,
    )


def complete(profile: Profile, *, model: ModelConfig, shapes: analytic.ProgramShapes) -> Profile:
  """`profile` with a model cell wherever it has none (every stage, bucket, rows and candidate
  of its key), and every measured cell's uncertainty set from its noise; measured cells keep
  their figures."""
  fitted = CostModel.fit(profile, model=model, shapes=shapes)
  cells = {
    k: dataclasses.replace(c, uncertainty=noise(c)) if _timed(c) else c
    for k, c in profile.cells.items()
  }
  for stage in profile.stages:
    for bucket in profile.buckets:
      for rows in profile.rows:
        for config in profile.candidates(stage):
          key = (stage, bucket, rows, config.name)
          if key not in cells:
            cells[key] = fitted.cell(stage, bucket, rows, config.name)
  return Profile(key=profile.key, cells=cells, wall_s=profile.wall_s)


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
  confidence: float,
  every: bool = False,
) -> list[str]:
  """The candidates at (stage, bucket, rows) worth measuring, the most promising (highest upper
  bound) first.

  Left out: the measured ones (timed, or over the budget by XLA's peak); those over the budget
  even at the analytic model's lower bound (`lower_need`) x (1 + margin); and, with
  `confidence` > 0 and not `every`, those whose upper bound is below the best lower bound of the
  candidates that fit and are measured or fitted to their own cells (`bounds`): a layout is
  pruned only while the model, fitted to the
  layout's own measurements, is confident it is slower (a layout measured nowhere yet is never
  pruned: each is measured once, at the shortest bucket it is wanted at, where calls are
  cheapest). `every`: none is pruned (the longest bucket a run reaches measures every layout that
  fits once). A layout timed at this bucket at other rows only (the run's own calls, at its
  packed batch's rows) is still wanted at these: its speed per token moves with the rows (on
  this CPU, experience 5-12% faster at 16 rows than at 64 at 768-1024 tokens), by as much as
  the layouts differ, which a curve linear in the rows does not carry (docs/results/tried.md).
  `profile` must have a cell for every candidate (`complete`).
  """
  cells = [profile.cell(stage, bucket, rows, c) for c in profile.candidates(stage)]

  def fits(cell: Cell) -> bool:
    need = cell.peak_bytes if cell.measured else lower_need(cell.peak_bytes)
    return budget is None or need * (1 + margin) <= budget

  fitting = [c for c in cells if fits(c) and not c.oom and c.throughput]
  best_lower = max((bounds(c, confidence)[0] for c in fitting if anchored(c)), default=0.0)
  out = []
  for cell in fitting:
    if cell.measured:
      continue
    # A layout measured nowhere is never pruned: until one cell anchors its own curve, the model
    # knows its terms' weights only from the other layouts (a CPU's collectives are far cheaper
    # against its FLOPs than the analytic model's nominal speeds say).
    if confidence > 0 and not every and anchored(cell) and bounds(cell, confidence)[1] < best_lower:
      continue
    out.append(cell)
  return [c.config for c in sorted(out, key=lambda c: -bounds(c, confidence)[1])]


def to_retime(
  profile: Profile,
  stage: Stage,
  bucket: int,
  rows: int,
  *,
  confidence: float,
  retimes: int,
) -> list[str]:
  """The measured candidates at (stage, bucket, rows) worth timing again, the fastest first:
  while the best measured layout's lower bound and another measured layout's upper bound
  overlap (x exp(-+confidence x its `noise`)), the ranking between them rests on the noise of
  one session's calls, and each of them timed in at most `retimes` sessions so far
  (`Cell.sessions`) is wanted, the best included. [] with fewer than two measured, or none
  near the best. `profile` as for `to_measure`."""
  cells = [profile.cells.get((stage, bucket, rows, c.name)) for c in profile.candidates(stage)]
  timed = sorted((c for c in cells if c is not None and _timed(c)), key=lambda c: -c.throughput)
  if len(timed) < 2 or retimes <= 0:
    return []

  def spread(cell: Cell) -> float:
    return math.exp(confidence * noise(cell))

  best_lower = timed[0].throughput / spread(timed[0])
  near = [c for c in timed[1:] if c.throughput * spread(c) >= best_lower]
  if not near:
    return []
  return [c.config for c in [timed[0], *near] if c.sessions <= retimes]
