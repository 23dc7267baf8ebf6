"""The profile: what each stage's program costs on each layout, measured and modelled.

One home for everything the Parallelism Selector ranks layouts by, one name each:

  table       `Profile` and `Cell` (pure data, JSON, the cache file), `MeasureConfig` (how a cell
              is timed) and `ProfileSettings` (what a run measures, and when).
  analytic    the analytic models: per-device memory for shapes too large to compile, and the
              roofline time of a call, in the terms the cost model fits.
  cost_model  `CostModel`: per (stage, layout), a curve over (bucket, rows) fitted to that
              layout's own measured cells, with its uncertainty; `complete` puts its figure in
              every unmeasured cell and `to_measure` is the measurement policy (a layout is
              pruned only while its upper bound is below the best one's lower bound).
  profiler    `Profiler`: compiles and times the candidate programs into cells (`run` measures a
              whole grid, `ProfileGrid`), the one bridge from the programs to the table.
  schedule    `ProfileScheduler`: a run's measurements between steps (background compiles,
              timing while the devices are idle, within `ProfileSettings.max_share`).

The first three are pure and the selector decides on them; `profiler` and `schedule` run
programs (import them as `earl_jax.profiling.profiler` and `earl_jax.profiling.schedule`; they
are not loaded here, and the selector never imports them).
"""

from earl_jax.profiling import analytic, cost_model, table
from earl_jax.profiling.cost_model import CostModel, Estimate
from earl_jax.profiling.table import Cell, MeasureConfig, Profile, ProfileSettings

__all__ = [
  'Cell',
  'CostModel',
  'Estimate',
  'MeasureConfig',
  'Profile',
  'ProfileSettings',
  'analytic',
  'cost_model',
  'table',
]
