"""The decision: before each stage, the layout and context bucket from last step's statistics.

Inputs (`StepStats`, from the previous step): the context lengths of its episodes (and turns),
the number of responses (the load) and, optionally, the free per-device memory. Rule:

1. A statistic of the episode lengths (mean as in the paper, or max / p95 to be OOM-safe), times
   an optional headroom for growth, is mapped to a bucket: the profile row that ranks layouts by
   speed. The *run bucket* holds the longest episode (times the headroom): it is what the step
   compiles and runs, and where memory is checked, so no choice can run out of memory there.
2. The load maps to the smallest profiled number of responses that holds it.
3. Feasible layouts: their per-device peak at (run bucket, load) x (1 + safety margin) fits the
   budget (the configured one, or the free memory when smaller). None feasible: an error that
   names the smallest layout's need.
4. The fastest feasible layout wins, with hysteresis so that the choice never flip-flops: the
   current layout is kept while it is feasible and within `switch_threshold` of the best, and
   the bucket moves *down* only after `patience` consecutive lower readings (up at once).
5. Every decision is recorded with its reason.

Where the ranking comes from, per stage: a measured `Profile` (the paper: decode throughput per
layout and context range, measured at start-up by its own call, `profiler.run`, for
`SelectorConfig.profile.stages`), or, for the other stages, the analytic memory model with a
static preference for the fewest model-parallel splits (the layout that wins at short context in
the paper and on CPU), so that they still move to wider layouts as their memory grows without
paying for a profile.

  pconfig = selector.profile_config(sel_cfg, buckets=table, rows=64, spec=spec, budget_bytes=b)
  profile = profiler.run(cfg, pconfig, executables=exe, cache_path=sel_cfg.profile.cache)
  sel = Selector(sel_cfg, model=cfg, buckets=table, rows=64, profile=profile, spec=spec)
  d = sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=lengths, num_responses=64))
  d.config, d.bucket, d.run_bucket, d.reason
  for key in sel.lookahead(d): executables.precompile(*key, tree=params)
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from absl import logging

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.programs import builders
from earl_jax.programs import memory as memory_lib
from earl_jax.selector import analytic
from earl_jax.selector.candidates import stage_candidates
from earl_jax.selector.profiler import Cell, MeasureConfig, Profile, ProfileConfig
from earl_jax.stage import STAGES, Stage

Statistic = Literal['mean', 'max', 'p95']
STATISTICS = ('mean', 'max', 'p95')


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
  """Which stages the start-up profile measures, where it is cached, and how it times.

  Attributes:
    stages: stages ranked by a measured profile (the paper profiles rollout decode); the others
      are ranked by the analytic model and the fewest-splits preference.
    cache: JSON file of the profile (reused when it matches the setup).
    measure: how each cell is timed.
  """

  stages: tuple[Stage | str, ...] = (Stage.ROLLOUT,)
  cache: str | None = None
  measure: MeasureConfig = dataclasses.field(default_factory=MeasureConfig)

  def __post_init__(self):
    object.__setattr__(self, 'stages', tuple(Stage.parse(s) for s in self.stages))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectorConfig:
  """How the selector decides.

  Attributes:
    statistic: 'mean' (the paper), 'max' or 'p95' of last step's episode lengths.
    headroom: lengths are multiplied by this before bucketing (anticipated growth, >= 1).
    safety_margin: a layout fits when its peak x (1 + margin) <= budget.
    switch_threshold: keep the current layout while it is within this fraction of the best.
    patience: consecutive lower-bucket readings before the bucket moves down.
    budget_mib: per-device budget in MiB. None: the device's own limit (GPU/TPU); on CPU, where
      devices report none, unlimited unless given (an emulated figure).
    candidates: layout names to consider ('dp8', 'dp2.tp4', ...); None: every valid one.
    with_fsdp: include fsdp > 1 layouts in the default candidates.
    profile: what the start-up profile measures (`profile_config` turns it into a
      `ProfileConfig`; `profiler.run` measures it).
    initial_context: context length assumed before any statistics (None: the smallest bucket).
  """

  statistic: Statistic = 'mean'
  headroom: float = 1.0
  safety_margin: float = 0.05
  switch_threshold: float = 0.03
  patience: int = 2
  budget_mib: float | None = None
  candidates: tuple[str, ...] | None = None
  with_fsdp: bool = False
  profile: ProfileSettings = dataclasses.field(default_factory=ProfileSettings)
  initial_context: int | None = None

  def __post_init__(self):
    if self.statistic not in STATISTICS:
      raise ValueError(
        f'SelectorConfig.statistic must be one of {STATISTICS}, got {self.statistic!r}.'
      )
    if not self.headroom >= 1.0:
      raise ValueError(f'SelectorConfig.headroom must be >= 1, got {self.headroom}.')
    if not 0.0 <= self.safety_margin < 1.0:
      raise ValueError(f'SelectorConfig.safety_margin must be in [0, 1), got {self.safety_margin}.')
    if not 0.0 <= self.switch_threshold < 1.0:
      raise ValueError(
        f'SelectorConfig.switch_threshold must be in [0, 1), got {self.switch_threshold}.'
      )
    if not isinstance(self.patience, int) or self.patience < 1:
      raise ValueError(f'SelectorConfig.patience must be an int >= 1, got {self.patience!r}.')
    if self.budget_mib is not None and not self.budget_mib > 0:
      raise ValueError(f'SelectorConfig.budget_mib must be positive, got {self.budget_mib}.')
    if self.candidates is not None:
      object.__setattr__(self, 'candidates', tuple(self.candidates))
      for c in self.candidates:
        ParallelConfig.parse(c)  # raises naming the bad layout
    if self.initial_context is not None and self.initial_context <= 0:
      raise ValueError(
        f'SelectorConfig.initial_context must be positive, got {self.initial_context}.'
      )

  @property
  def budget_bytes(self) -> int | None:
    return None if self.budget_mib is None else int(self.budget_mib * memory_lib.MiB)

  @property
  def layouts(self) -> tuple[ParallelConfig, ...] | None:
    """The parsed candidates (None: every valid layout)."""
    return (
      None if self.candidates is None else tuple(ParallelConfig.parse(c) for c in self.candidates)
    )


def profile_config(
  config: SelectorConfig,
  *,
  buckets: BucketConfig,
  rows: int | Sequence[int],
  spec: builders.StageSpec,
  budget_bytes: int | None,
) -> ProfileConfig:
  """The start-up profile a selector with `config` ranks its profiled stages by."""
  return ProfileConfig(
    stages=config.profile.stages,
    buckets=buckets,
    rows=_load_bins(rows),
    budget_bytes=budget_bytes,
    candidates=config.layouts,
    with_fsdp=config.with_fsdp,
    measure=config.profile.measure,
    spec=spec,
  )


def _load_bins(rows: int | Sequence[int]) -> tuple[int, ...]:
  return (rows,) if isinstance(rows, int) else tuple(sorted(set(rows)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepStats:
  """What the previous step tells the selector.

  Attributes:
    episode_lengths: tokens of each episode (its whole context) of the previous step.
    turn_lengths: tokens of each agent-environment round (recorded with the decision).
    num_responses: concurrent responses (rows) the stage will run: the load.
    free_memory_bytes: per-device bytes available to the stage's program, if known.
  """

  episode_lengths: Sequence[int]
  num_responses: int
  turn_lengths: Sequence[int] = ()
  free_memory_bytes: int | None = None

  def __post_init__(self):
    lengths = tuple(int(n) for n in self.episode_lengths)
    if not lengths:
      raise ValueError('StepStats.episode_lengths is empty.')
    if min(lengths) <= 0:
      raise ValueError(f'StepStats.episode_lengths must be positive, got min {min(lengths)}.')
    object.__setattr__(self, 'episode_lengths', lengths)
    object.__setattr__(self, 'turn_lengths', tuple(int(n) for n in self.turn_lengths))
    if self.num_responses <= 0:
      raise ValueError(f'StepStats.num_responses must be positive, got {self.num_responses}.')
    if self.free_memory_bytes is not None and self.free_memory_bytes <= 0:
      raise ValueError(
        f'StepStats.free_memory_bytes must be positive, got {self.free_memory_bytes}.'
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
  """One layout as the decision saw it."""

  config: str
  throughput: float | None
  need_bytes: int
  feasible: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
  """A layout and bucket for one stage, and why.

  Attributes:
    stage: the stage.
    step: the selector's decision count for this stage (0 first).
    config: the chosen layout.
    bucket: the bucket of the statistic (the context range that ranked the layouts).
    run_bucket: the bucket that holds the longest episode: compile and run at this one.
    rows: the load bin (profiled responses >= num_responses).
    statistic: the value of the statistic (after headroom).
    throughput: the ranking score of `config` at (bucket, rows): measured tokens/s/device for a
      profiled stage, the fewest-splits preference otherwise.
    measured: whether the ranking came from measurements.
    need_bytes: per-device peak of `config` at (run_bucket, rows) (XLA, or analytic).
    budget_bytes: the budget it was checked against (None: unlimited).
    switched: the layout differs from the previous decision's.
    previous: the previous decision's layout.
    reason: a sentence for the log.
    options: every candidate with its score, need and feasibility.
  """

  stage: Stage
  step: int
  config: ParallelConfig
  bucket: int
  run_bucket: int
  rows: int
  statistic: float
  throughput: float | None
  measured: bool
  need_bytes: int
  budget_bytes: int | None
  switched: bool
  previous: ParallelConfig | None
  reason: str
  options: tuple[Option, ...]

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d['stage'] = str(self.stage)
    d['config'] = self.config.name
    d['previous'] = None if self.previous is None else self.previous.name
    return d


def context_statistic(lengths: Sequence[int], statistic: str) -> float:
  """mean, max or p95 (linear interpolation) of the lengths."""
  if statistic not in STATISTICS:
    raise ValueError(f'statistic must be one of {STATISTICS}, got {statistic!r}.')
  x = np.asarray(lengths, np.float64)
  if statistic == 'mean':
    return float(x.mean())
  if statistic == 'max':
    return float(x.max())
  return float(np.percentile(x, 95))


def fewest_splits_score(config: ParallelConfig) -> float:
  """The analytic ranking: fewer model-parallel splits first, tensor before fsdp at equal size."""
  return 1.0 / (config.tp * config.fsdp) - 1e-3 * (config.fsdp - 1)


def analytic_profile(
  model: ModelConfig,
  *,
  stages: Sequence[Stage],
  buckets: BucketConfig,
  rows: Sequence[int],
  candidates: Mapping[Stage, Sequence[ParallelConfig]],
  spec: builders.StageSpec,
  coefficients: analytic.Coefficients | None = None,
) -> Profile:
  """A profile without measurements: analytic memory, fewest-splits scores (nothing compiles)."""
  coefficients = coefficients or analytic.Coefficients()
  cells = {}
  for stage in stages:
    for bucket in buckets.lengths:
      for r in rows:
        for c in candidates[stage]:
          need = analytic.estimate(
            stage,
            model,
            c,
            bucket,
            r,
            decode_tokens=spec.decode_tokens,
            chunk=spec.chunk,
            micro_batches=spec.micro_batches,
            coefficients=coefficients,
          ).total
          cells[(stage, bucket, r, c.name)] = Cell(
            stage=stage,
            config=c.name,
            bucket=bucket,
            rows=r,
            peak_bytes=need,
            oom=False,
            throughput=fewest_splits_score(c),
            measured=False,
          )
  key = {
    'source': 'analytic',
    'stages': [str(s) for s in stages],
    'candidates': {str(s): [c.name for c in candidates[s]] for s in stages},
    'buckets': list(buckets.lengths),
    'rows': list(rows),
  }
  return Profile(key=key, cells=cells)


@dataclasses.dataclass
class _StageState:
  config: ParallelConfig | None = None
  bucket: int | None = None
  lower_readings: int = 0
  decisions: int = 0


@dataclasses.dataclass(frozen=True)
class _Reading:
  """What one step's statistics say, before any layout is ranked."""

  value: float  # the statistic, after headroom
  longest: float  # the longest episode, after headroom
  bucket: int  # the ranking bucket, after the hysteresis on moving down
  run_bucket: int  # the bucket that holds the longest episode
  rows: int  # the load bin
  budget: int | None
  notes: tuple[str, ...]


class Selector:
  """Decides each stage's layout (see the module docstring).

  Construction never compiles or measures anything: stages covered by `profile` are ranked by
  its measurements, the others by the analytic model (from `model` and `spec`).
  """

  def __init__(
    self,
    config: SelectorConfig,
    *,
    buckets: BucketConfig,
    rows: int | Sequence[int],
    model: ModelConfig | None = None,
    num_devices: int | None = None,
    profile: Profile | None = None,
    spec: builders.StageSpec | None = None,
  ):
    """Args:
    config: the decision rule and where rankings come from.
    buckets: the context-length table.
    rows: the number(s) of responses the stages run (the load bins).
    model: the model (needed unless every stage is in `profile`).
    num_devices: devices of every stage (default: all).
    profile: a measured profile (`profiler.run(profile_config(...))`); it must cover every
      stage of `config.profile.stages`.
    spec: static stage settings of the analytic model (decode tokens, prompt chunk,
      micro-batches); default `StageSpec()`.

    Raises:
      ValueError: the profile's buckets differ from `buckets`, or it lacks a profiled stage.
    """
    self.config = config
    self.buckets = buckets
    self.rows = _load_bins(rows)
    self.budget_bytes = memory_lib.resolve_budget(config.budget_bytes)
    self.history: list[Decision] = []
    self._state: dict[Stage, _StageState] = {}
    self._profiles: dict[Stage, Profile] = {}
    if profile is not None:
      if tuple(buckets.lengths) != profile.buckets:
        raise ValueError(
          f'Buckets {buckets.lengths} differ from the profiled buckets {profile.buckets}.'
        )
      self._profiles.update(dict.fromkeys(profile.stages, profile))
    unmeasured = [s for s in config.profile.stages if s not in self._profiles]
    if unmeasured:
      raise ValueError(
        f'SelectorConfig.profile.stages names {[str(s) for s in unmeasured]}, which no '
        'profile covers; measure one with profiler.run(model, selector.profile_config(...)) '
        'and pass it as `profile`, or leave those stages to the analytic model.'
      )
    missing = [s for s in STAGES if s not in self._profiles]
    if missing and model is not None:
      n = num_devices or jax.device_count()
      cands = {
        s: stage_candidates(
          s, model, num_devices=n, rows=self.rows, with_fsdp=config.with_fsdp, only=config.layouts
        )
        for s in missing
      }
      est = analytic_profile(
        model,
        stages=missing,
        buckets=buckets,
        rows=self.rows,
        candidates=cands,
        spec=spec or builders.StageSpec(),
      )
      self._profiles.update(dict.fromkeys(missing, est))

  # -- state ----------------------------------------------------------------------------------------

  def current(self, stage: Stage) -> ParallelConfig | None:
    """The layout of the stage's last decision."""
    return self._state.get(Stage.parse(stage), _StageState()).config

  @property
  def stages(self) -> tuple[Stage, ...]:
    """The stages this selector can decide."""
    return tuple(s for s in STAGES if s in self._profiles)

  def profile(self, stage: Stage) -> Profile:
    stage = Stage.parse(stage)
    if stage not in self._profiles:
      raise ValueError(
        f"The selector has no ranking for '{stage}' (it has {[str(s) for s in self.stages]}); "
        'give the model so that unprofiled stages use the analytic model, or a profile that '
        'covers the stage.'
      )
    return self._profiles[stage]

  def state_dict(self) -> dict[str, Any]:
    """JSON-able state (current layouts, buckets, hysteresis counters) for checkpoints."""
    return {
      str(s): {
        'config': None if st.config is None else st.config.name,
        'bucket': st.bucket,
        'lower_readings': st.lower_readings,
        'decisions': st.decisions,
      }
      for s, st in self._state.items()
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for s, d in state.items():
      self._state[Stage.parse(s)] = _StageState(
        config=None if d['config'] is None else ParallelConfig.parse(d['config']),
        bucket=d['bucket'],
        lower_readings=d['lower_readings'],
        decisions=d['decisions'],
      )

  def log(self) -> list[dict[str, Any]]:
    """Every decision so far, JSON-able."""
    return [d.as_dict() for d in self.history]

  # -- the rule -------------------------------------------------------------------------------------

  def _fits(self, need: int, budget: int | None) -> bool:
    return budget is None or memory_lib.fits(need, budget, margin=self.config.safety_margin)

  def _options(self, stage: Stage, bucket: int, run_bucket: int, rows: int, budget: int | None):
    profile = self._profiles[stage]
    out = []
    for c in profile.candidates(stage):
      run_cell = profile.cell(stage, run_bucket, rows, c)
      rank_cell: Cell = profile.cell(stage, bucket, rows, c)
      score = rank_cell.throughput if rank_cell.throughput is not None else run_cell.throughput
      feasible = self._fits(run_cell.peak_bytes, budget) and score is not None
      opt = Option(
        config=c.name, throughput=score, need_bytes=run_cell.peak_bytes, feasible=feasible
      )
      out.append((c, opt))
    return out

  def _infeasible(self, stage, run_bucket, rows, budget, options) -> memory_lib.InfeasibleError:
    c, smallest = min(options, key=lambda o: o[1].need_bytes)
    mib = memory_lib.MiB
    margin = self.config.safety_margin
    return memory_lib.InfeasibleError(
      f'No {stage} layout fits the per-device budget of {budget / mib:.1f} MiB at bucket '
      f'{run_bucket} with {rows} responses: the smallest need is {c.name} with '
      f'{smallest.need_bytes / mib:.1f} MiB per device (x{1 + margin:.2f} safety margin = '
      f'{smallest.need_bytes * (1 + margin) / mib:.1f} MiB). Raise the budget, lower the load or '
      f'shorten the context.'
    )

  def _initial_stats(self) -> StepStats:
    n = self.config.initial_context or self.buckets.lengths[0]
    return StepStats(episode_lengths=(n,), num_responses=self.rows[-1])

  def initial_decisions(self) -> dict[Stage, Decision]:
    """What `decide(stage, None)` would choose for every stage, without recording anything."""
    out = {}
    for s in self.stages:
      saved = (self._state.get(s), len(self.history))
      self._state[s] = _StageState()
      out[s] = self.decide(s, None)
      del self.history[saved[1] :]
      if saved[0] is None:
        del self._state[s]
      else:
        self._state[s] = saved[0]
    return out

  def _read(self, stage: Stage, stats: StepStats, st: _StageState) -> _Reading:
    """Step 1-3 of the rule: the ranking and run buckets (with hysteresis), the load, the budget."""
    cfg = self.config
    value = context_statistic(stats.episode_lengths, cfg.statistic) * cfg.headroom
    longest = max(stats.episode_lengths) * cfg.headroom
    try:
      raw_bucket = self.buckets.bucket_for(math.ceil(value))
      run_bucket = self.buckets.bucket_for(math.ceil(longest))
    except ValueError as e:
      raise ValueError(f'{stage}: context too long for the bucket table: {e}') from None
    notes = []
    bucket = raw_bucket
    if st.bucket is not None and raw_bucket < st.bucket:
      st.lower_readings += 1
      if st.lower_readings < cfg.patience:
        bucket = st.bucket
        notes.append(
          f'held bucket {st.bucket} ({cfg.statistic} reads {raw_bucket}, '
          f'{st.lower_readings}/{cfg.patience} lower readings)'
        )
      else:
        st.lower_readings = 0
    else:
      st.lower_readings = 0
    budget = self.budget_bytes
    if stats.free_memory_bytes is not None and (budget is None or stats.free_memory_bytes < budget):
      budget = stats.free_memory_bytes
      notes.append(f'free memory {budget / memory_lib.MiB:.1f} MiB')
    rows = self.profile(stage).rows_bin(stats.num_responses)
    return _Reading(value, longest, bucket, run_bucket, rows, budget, tuple(notes))

  def _choose(self, options, best, prev: ParallelConfig | None, reading: _Reading, unit: str):
    """Step 4: the fastest feasible layout, or the current one while it is close enough."""
    cfg = self.config
    best_c, best_o = best
    current = next(((c, o) for c, o in options if c == prev), None)
    if prev is None:
      return best, f'first decision: fastest feasible is {best_c.name}'
    if current is not None and current[1].feasible:
      cur_o = current[1]
      if cur_o.throughput >= (1.0 - cfg.switch_threshold) * best_o.throughput:
        if prev == best_c:
          return current, f'kept {prev.name} (fastest feasible)'
        return current, (
          f'kept {prev.name} (within {cfg.switch_threshold:.0%} of best {best_c.name}: '
          f'{cur_o.throughput:.1f} vs {best_o.throughput:.1f} {unit})'
        )
      return best, (
        f'{best_c.name} is {best_o.throughput / cur_o.throughput - 1:.0%} faster than '
        f'{prev.name} ({best_o.throughput:.1f} vs {cur_o.throughput:.1f} {unit})'
      )
    need = current[1].need_bytes if current else 0
    return best, (
      f'{prev.name} no longer fits ({need / memory_lib.MiB:.1f} MiB x'
      f'{1 + cfg.safety_margin:.2f} > {reading.budget / memory_lib.MiB:.1f} MiB at bucket '
      f'{reading.run_bucket}); fastest feasible is {best_c.name}'
    )

  def decide(self, stage: Stage, stats: StepStats | None) -> Decision:
    """The layout and bucket for the coming `stage`, from the previous step's `stats`.

    Args:
      stage: the stage to decide.
      stats: the previous step's statistics; None before the first step (the initial context).

    Raises:
      ValueError: a context longer than the largest bucket, or a load above the profiled ones.
      memory.InfeasibleError: no layout fits; names the smallest layout's need.
    """
    stage = Stage.parse(stage)
    stats = stats or self._initial_stats()
    profile = self.profile(stage)
    st = self._state.setdefault(stage, _StageState())
    r = self._read(stage, stats, st)
    options = self._options(stage, r.bucket, r.run_bucket, r.rows, r.budget)
    feasible = [(c, o) for c, o in options if o.feasible]
    if not feasible:
      raise self._infeasible(stage, r.run_bucket, r.rows, r.budget, options)
    best = max(feasible, key=lambda x: x[1].throughput)
    measured = profile.cell(stage, r.bucket, r.rows, best[0]).measured
    prev = st.config
    (chosen_c, chosen), why = self._choose(
      options, best, prev, r, 'tok/s/dev' if measured else '(preference)'
    )
    infeasible = [c.name for c, o in options if not o.feasible]
    reason = (
      f'{stage}: {self.config.statistic} context {r.value:.0f} -> bucket {r.bucket}, longest '
      f'{r.longest:.0f} -> run bucket {r.run_bucket}, {stats.num_responses} responses -> load '
      f'{r.rows}; {why}'
      + (f'; infeasible: {", ".join(infeasible)}' if infeasible else '')
      + (f'; {"; ".join(r.notes)}' if r.notes else '')
    )
    decision = Decision(
      stage=stage,
      step=st.decisions,
      config=chosen_c,
      bucket=r.bucket,
      run_bucket=r.run_bucket,
      rows=r.rows,
      statistic=r.value,
      throughput=chosen.throughput,
      measured=profile.cell(stage, r.bucket, r.rows, chosen_c).measured,
      need_bytes=chosen.need_bytes,
      budget_bytes=r.budget,
      switched=prev is not None and chosen_c != prev,
      previous=prev,
      reason=reason,
      options=tuple(o for _, o in options),
    )
    st.config, st.bucket = chosen_c, r.bucket
    st.decisions += 1
    self.history.append(decision)
    if decision.switched:
      logging.info('selector: %s', reason)
    return decision

  def best_for(self, stage: Stage, bucket: int, rows: int) -> ParallelConfig | None:
    """The fastest layout that fits at (bucket, rows), without hysteresis (None: nothing fits)."""
    options = self._options(Stage.parse(stage), bucket, bucket, rows, self.budget_bytes)
    feasible = [(c, o) for c, o in options if o.feasible]
    if not feasible:
      return None
    return max(feasible, key=lambda x: x[1].throughput)[0]

  def lookahead(self, decision: Decision) -> list[tuple[Stage, ParallelConfig, int, int]]:
    """Keys worth compiling in the background now: the chosen one, and the next bucket's.

    For the next bucket up: its fastest feasible layout, and the chosen layout too when it fits
    there (hysteresis may keep it). Each key is (stage, config, bucket, rows), the arguments of
    `Executables.precompile`.
    """
    keys = [(decision.stage, decision.config, decision.run_bucket, decision.rows)]
    higher = [b for b in self.buckets.lengths if b > decision.run_bucket]
    if higher:
      nb = higher[0]
      options = dict(self._options(decision.stage, nb, nb, decision.rows, self.budget_bytes))
      for c in (self.best_for(decision.stage, nb, decision.rows), decision.config):
        key = (decision.stage, c, nb, decision.rows)
        if c is not None and options[c].feasible and key not in keys:
          keys.append(key)
    return keys
