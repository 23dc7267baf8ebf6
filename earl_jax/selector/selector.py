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
4. The fastest feasible layout wins, with hysteresis so that the choice never flip-flops:
   - the bucket moves *down* only after `patience` consecutive lower readings (up at once);
   - the layout is held for `patience` decisions after a switch (a minimum dwell), so it never
     flips back within that, unless it stops fitting;
   - the current layout is kept while it is feasible and within `switch_threshold` of the best;
   - a switch must pay for itself: the measured time it saves over the steps expected in this
     bucket (the mean run of steps per bucket so far) must exceed what it costs (the reshard
     and any compile, from `switch_cost`), both numbers in the reason.
   A layout whose program XLA refuses at compile time (`mark_infeasible`) is left out from then
   on, and the decision that chose it is taken again.
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

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from absl import logging

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.errors import ConfigError
from earl_jax.programs import builders
from earl_jax.programs import memory as memory_lib
from earl_jax.selector import analytic
from earl_jax.selector.profiler import (
  Cell,
  MeasureConfig,
  Profile,
  ProfileConfig,
  candidates_for,
  fsdp_stages,
)
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
    lazy: measure a bucket the first time a decision needs it (a run pays only for the buckets
      it reaches); False: every bucket at start-up.
  """

  stages: tuple[Stage | str, ...] = (Stage.ROLLOUT,)
  cache: str | None = None
  measure: MeasureConfig = dataclasses.field(default_factory=MeasureConfig)
  lazy: bool = False

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
    candidates: layout names to consider ('dp8', 'dp2.tp4', 'fsdp8', ...); None: every valid
      one.
    with_fsdp: the stages whose candidates include fsdp > 1 layouts (True: all, False: none);
      the default lets the train stage shard parameters and moments over every device.
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
  with_fsdp: bool | tuple[Stage | str, ...] = (Stage.TRAIN,)
  profile: ProfileSettings = dataclasses.field(default_factory=ProfileSettings)
  initial_context: int | None = None

  def __post_init__(self):
    if self.statistic not in STATISTICS:
      raise ConfigError(
        f'SelectorConfig.statistic must be one of {STATISTICS}, got {self.statistic!r}.'
      )
    if not self.headroom >= 1.0:
      raise ConfigError(f'SelectorConfig.headroom must be >= 1, got {self.headroom}.')
    if not 0.0 <= self.safety_margin < 1.0:
      raise ConfigError(
        f'SelectorConfig.safety_margin must be in [0, 1), got {self.safety_margin}.'
      )
    if not 0.0 <= self.switch_threshold < 1.0:
      raise ConfigError(
        f'SelectorConfig.switch_threshold must be in [0, 1), got {self.switch_threshold}.'
      )
    if not isinstance(self.patience, int) or self.patience < 1:
      raise ConfigError(f'SelectorConfig.patience must be an int >= 1, got {self.patience!r}.')
    if self.budget_mib is not None and not self.budget_mib > 0:
      raise ConfigError(f'SelectorConfig.budget_mib must be positive, got {self.budget_mib}.')
    object.__setattr__(self, 'with_fsdp', fsdp_stages(self.with_fsdp))
    if self.candidates is not None:
      object.__setattr__(self, 'candidates', tuple(self.candidates))
      for c in self.candidates:
        ParallelConfig.parse(c)  # raises naming the bad layout
    if self.initial_context is not None and self.initial_context <= 0:
      raise ConfigError(
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
    stage_tokens: per stage name, the tokens it processes in a step (rollout: the tokens it
      generates; experience and train: rows x bucket per forward or update), in the units of
      the profile's throughput: what a layout's time per step is estimated from.
  """

  episode_lengths: Sequence[int]
  num_responses: int
  turn_lengths: Sequence[int] = ()
  free_memory_bytes: int | None = None
  stage_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    lengths = tuple(int(n) for n in self.episode_lengths)
    if not lengths:
      raise ValueError('StepStats.episode_lengths is empty.')
    if min(lengths) <= 0:
      raise ValueError(f'StepStats.episode_lengths must be positive, got min {min(lengths)}.')
    object.__setattr__(self, 'episode_lengths', lengths)
    object.__setattr__(self, 'turn_lengths', tuple(int(n) for n in self.turn_lengths))
    object.__setattr__(
      self, 'stage_tokens', {str(Stage.parse(k)): int(v) for k, v in self.stage_tokens.items()}
    )
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
    gain_ms: what switching to the best layout would save over the expected steps in this
      bucket (None: no switch was weighed, or its time is not measured).
    cost_ms: what that switch would cost (reshard + compile), when weighed.
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
  gain_ms: float | None = None
  cost_ms: float | None = None

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
  since_switch: int | None = None  # decisions since the layout last changed (None: never)
  bucket_steps: int = 0  # consecutive decisions at the current bucket
  bucket_runs: list[int] = dataclasses.field(default_factory=list)  # lengths of finished runs

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d['config'] = None if self.config is None else self.config.name
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> '_StageState':
    d = dict(d)
    d['config'] = None if d['config'] is None else ParallelConfig.parse(d['config'])
    d['bucket_runs'] = list(d.get('bucket_runs', []))
    return cls(**d)


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


# (stage, from layout, to layout, run bucket, rows) -> milliseconds the switch would stall.
SwitchCost = Callable[[Stage, ParallelConfig, ParallelConfig, int, int], float]
# (stage, bucket) -> the profile with that bucket measured (for every profiled stage).
Measure = Callable[[Stage, int], Profile]


class Selector:
  """Decides each stage's layout (see the module docstring).

  Construction never compiles or measures anything: stages covered by `profile` are ranked by
  its measurements, the others by the analytic model (from `model` and `spec`). With `measure`,
  a profiled stage's bucket that the profile lacks is measured the first time a decision needs
  it (`ProfileSettings.lazy`).
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
    measure: Measure | None = None,
    switch_cost: SwitchCost | None = None,
  ):
    """Args:
    config: the decision rule and where rankings come from.
    buckets: the context-length table.
    rows: the number(s) of responses the stages run (the load bins).
    model: the model (needed unless every stage is in `profile`).
    num_devices: devices of every stage (default: all).
    profile: a measured profile (`profiler.run(profile_config(...))`); it must cover every
      stage of `config.profile.stages` (possibly not every bucket, with `measure`).
    spec: static stage settings of the analytic model (decode tokens, prompt chunk,
      micro-batches); default `StageSpec()`.
    measure: measures a missing bucket of the profiled stages (see the class docstring).
    switch_cost: what a switch would stall the step, in ms (default: nothing); weighed against
      its measured gain.

    Raises:
      ValueError: the profile's buckets differ from `buckets`, or it lacks a profiled stage.
    """
    self.config = config
    self.buckets = buckets
    self.rows = _load_bins(rows)
    self.num_devices = num_devices or jax.device_count()
    self.budget_bytes = memory_lib.resolve_budget(config.budget_bytes)
    self.history: list[Decision] = []
    self._state: dict[Stage, _StageState] = {}
    self._before: dict[Stage, tuple[_StageState, int]] = {}
    self._refused: dict[Stage, set[tuple[str, int, int]]] = {}
    self._measure = measure
    self._switch_cost = switch_cost
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
      cands = {
        s: candidates_for(
          s,
          model,
          num_devices=self.num_devices,
          rows=self.rows,
          with_fsdp=config.with_fsdp,
          only=config.layouts,
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
    """JSON-able state (current layouts, buckets, hysteresis counters, refused programs)."""
    return {
      'stages': {str(s): st.as_dict() for s, st in self._state.items()},
      'refused': {str(s): sorted(list(k) for k in r) for s, r in self._refused.items()},
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for s, d in state['stages'].items():
      self._state[Stage.parse(s)] = _StageState.from_dict(d)
    for s, keys in state.get('refused', {}).items():
      self._refused[Stage.parse(s)] = {tuple(k) for k in keys}

  def log(self) -> list[dict[str, Any]]:
    """Every decision so far, JSON-able."""
    return [d.as_dict() for d in self.history]

  # -- feasibility found at compile time ------------------------------------------------------------

  def mark_infeasible(self, decision: 'Decision', reason: str) -> None:
    """XLA refused `decision`'s program (at its run bucket and load): leave that layout out
    there from now on, and undo the decision, so that `decide` with the same statistics takes
    the next candidate. The refused decision stays in the log, marked."""
    stage = decision.stage
    self._refused.setdefault(stage, set()).add(
      (decision.config.name, decision.run_bucket, decision.rows)
    )
    state, count = self._before[stage]
    self._state[stage] = state
    refused = dataclasses.replace(decision, reason=f'{decision.reason}; REFUSED: {reason}')
    self.history[count] = refused
    logging.warning('selector: %s', refused.reason)

  # -- the rule -------------------------------------------------------------------------------------

  def _fits(self, need: int, budget: int | None) -> bool:
    return budget is None or memory_lib.fits(need, budget, margin=self.config.safety_margin)

  def _ensure_measured(self, stage: Stage, buckets: Sequence[int], rows: int) -> None:
    if self._measure is None or stage not in self.config.profile.stages:
      return
    for b in dict.fromkeys(buckets):
      if not self._profiles[stage].covers(stage, b, rows):
        measured = self._measure(stage, b)
        for s in measured.stages:
          self._profiles[s] = measured

  def _options(self, stage: Stage, bucket: int, run_bucket: int, rows: int, budget: int | None):
    profile = self._profiles[stage]
    refused = self._refused.get(stage, set())
    out = []
    for c in profile.candidates(stage):
      run_cell = profile.cell(stage, run_bucket, rows, c)
      rank_cell: Cell = profile.cell(stage, bucket, rows, c)
      score = rank_cell.throughput if rank_cell.throughput is not None else run_cell.throughput
      feasible = (
        self._fits(run_cell.peak_bytes, budget)
        and score is not None
        and (c.name, run_bucket, rows) not in refused
      )
      opt = Option(
        config=c.name, throughput=score, need_bytes=run_cell.peak_bytes, feasible=feasible
      )
      out.append((c, opt))
    return out

  def _infeasible(self, stage, run_bucket, rows, budget, options) -> memory_lib.InfeasibleError:
    c, smallest = min(options, key=lambda o: o[1].need_bytes)
    mib = memory_lib.MiB
    margin = self.config.safety_margin
    refused = self._refused.get(stage, set())
    if budget is None or all((o.name, run_bucket, rows) in refused for o, _ in options):
      return memory_lib.InfeasibleError(
        f'No {stage} layout is left at bucket {run_bucket} with {rows} responses: XLA refused '
        f'every candidate ({", ".join(n for n, _, _ in sorted(self._refused.get(stage, ())))}).'
      )
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
      saved = (self._state.get(s), self._before.get(s), len(self.history))
      self._state[s] = _StageState()
      out[s] = self.decide(s, None)
      del self.history[saved[2] :]
      for table, value in ((self._state, saved[0]), (self._before, saved[1])):
        if value is None:
          table.pop(s, None)
        else:
          table[s] = value
    return out

  def _read(self, stage: Stage, stats: StepStats, st: _StageState) -> _Reading:
    """Steps 1-3 of the rule: the ranking and run buckets (with hysteresis), the load, the budget."""
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

  def expected_steps(self, stage: Stage) -> float:
    """Steps a bucket is expected to last: the mean of the finished runs so far (at least
    `patience` until one has finished)."""
    runs = self._state.get(Stage.parse(stage), _StageState()).bucket_runs
    return float(np.mean(runs)) if runs else float(self.config.patience)

  def _gate(self, stage, stats, prev, best, r: _Reading, measured: bool):
    """The switch-cost gate: (gain ms, cost ms) of moving from `prev` to `best`, or None when
    the time per step is not measured (no throughputs, or no token count for the stage)."""
    work = stats.stage_tokens.get(str(stage))
    (prev_c, prev_o), (best_c, best_o) = prev, best
    if not measured or not work or not prev_o.throughput or not best_o.throughput:
      return None
    per_step = work / self.num_devices  # tokens per device per step
    saved_s = per_step / prev_o.throughput - per_step / best_o.throughput
    gain = 1e3 * saved_s * self.expected_steps(stage)
    cost = 0.0
    if self._switch_cost is not None:
      cost = float(self._switch_cost(stage, prev_c, best_c, r.run_bucket, r.rows))
    return gain, cost

  def _choose(self, stage, stats, options, best, st: _StageState, r: _Reading, measured: bool):
    """Step 4: the layout to run, why, and the switch gate's numbers when it was weighed."""
    cfg = self.config
    best_c, best_o = best
    prev = st.config
    unit = 'tok/s/dev' if measured else '(preference)'
    current = next(((c, o) for c, o in options if c == prev), None)
    if prev is None:
      return best, f'first decision: fastest feasible is {best_c.name}', None
    if current is None or not current[1].feasible:
      if current is not None and (prev.name, r.run_bucket, r.rows) in self._refused.get(stage, ()):
        why = f'{prev.name} was refused by XLA at bucket {r.run_bucket}'
      else:
        need = current[1].need_bytes if current else 0
        budget = 'unlimited' if r.budget is None else f'{r.budget / memory_lib.MiB:.1f} MiB'
        why = (
          f'{prev.name} no longer fits ({need / memory_lib.MiB:.1f} MiB x'
          f'{1 + cfg.safety_margin:.2f} > {budget} at bucket {r.run_bucket})'
        )
      return best, f'{why}; fastest feasible is {best_c.name}', None
    cur_o = current[1]
    if prev == best_c:
      return current, f'kept {prev.name} (fastest feasible)', None
    if st.since_switch is not None and st.since_switch < cfg.patience:
      return (
        current,
        (
          f'held {prev.name} ({st.since_switch}/{cfg.patience} decisions since the last switch; '
          f'best now {best_c.name})'
        ),
        None,
      )
    if cur_o.throughput >= (1.0 - cfg.switch_threshold) * best_o.throughput:
      return (
        current,
        (
          f'kept {prev.name} (within {cfg.switch_threshold:.0%} of best {best_c.name}: '
          f'{cur_o.throughput:.1f} vs {best_o.throughput:.1f} {unit})'
        ),
        None,
      )
    faster = (
      f'{best_c.name} is {best_o.throughput / cur_o.throughput - 1:.0%} faster than {prev.name} '
      f'({best_o.throughput:.1f} vs {cur_o.throughput:.1f} {unit})'
    )
    gate = self._gate(stage, stats, current, best, r, measured)
    if gate is None:
      return best, faster, None
    gain, cost = gate
    weighed = (
      f'saves {gain:.0f} ms over {self.expected_steps(stage):.1f} expected steps, switch costs '
      f'{cost:.0f} ms'
    )
    if gain <= cost:
      return current, f'kept {prev.name}: {faster}, but it {weighed}', gate
    return best, f'{faster}; it {weighed}', gate

  def _advance(self, st: _StageState, config: ParallelConfig, bucket: int) -> None:
    if st.bucket is not None and bucket != st.bucket:
      st.bucket_runs.append(st.bucket_steps)
      st.bucket_steps = 0
    if st.config is not None and config != st.config:
      st.since_switch = 0
    elif st.since_switch is not None:
      st.since_switch += 1
    st.bucket_steps += 1
    st.config, st.bucket = config, bucket
    st.decisions += 1

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
    self._before[stage] = (copy.deepcopy(st), len(self.history))
    r = self._read(stage, stats, st)
    self._ensure_measured(stage, (r.bucket, r.run_bucket), r.rows)
    profile = self.profile(stage)
    options = self._options(stage, r.bucket, r.run_bucket, r.rows, r.budget)
    feasible = [(c, o) for c, o in options if o.feasible]
    if not feasible:
      self._state[stage] = self._before[stage][0]
      raise self._infeasible(stage, r.run_bucket, r.rows, r.budget, options)
    best = max(feasible, key=lambda x: x[1].throughput)
    measured = profile.cell(stage, r.bucket, r.rows, best[0]).measured
    prev = st.config
    (chosen_c, chosen), why, gate = self._choose(stage, stats, options, best, st, r, measured)
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
      gain_ms=None if gate is None else gate[0],
      cost_ms=None if gate is None else gate[1],
    )
    self._advance(st, chosen_c, r.bucket)
    self.history.append(decision)
    if decision.switched:
      logging.info('selector: %s', reason)
    return decision

  def best_for(self, stage: Stage, bucket: int, rows: int) -> ParallelConfig | None:
    """The fastest layout that fits at (bucket, rows), without hysteresis (None: nothing fits,
    or the bucket is not profiled yet)."""
    stage = Stage.parse(stage)
    if not self._profiles[stage].covers(stage, bucket, rows):
      return None
    options = self._options(stage, bucket, bucket, rows, self.budget_bytes)
    feasible = [(c, o) for c, o in options if o.feasible]
    if not feasible:
      return None
    return max(feasible, key=lambda x: x[1].throughput)[0]

  def lookahead(self, decision: Decision) -> list[tuple[Stage, ParallelConfig, int, int]]:
    """Keys worth compiling in the background now: the chosen one, and its neighbours'.

    For the next bucket up and the next one down: the fastest feasible layout there (once that
    bucket is profiled), and the chosen layout too when it fits there (hysteresis may keep it).
    Each key is (stage, config, bucket, rows), the arguments of `Executables.precompile`.
    """
    keys = [(decision.stage, decision.config, decision.run_bucket, decision.rows)]
    lengths = self.buckets.lengths
    i = lengths.index(decision.run_bucket)
    neighbours = [lengths[j] for j in (i + 1, i - 1) if 0 <= j < len(lengths)]
    profile = self._profiles[decision.stage]
    for nb in neighbours:
      if not profile.covers(decision.stage, nb, decision.rows):
        keys.append((decision.stage, decision.config, nb, decision.rows))  # not profiled yet
        continue
      options = dict(self._options(decision.stage, nb, nb, decision.rows, self.budget_bytes))
      for c in (self.best_for(decision.stage, nb, decision.rows), decision.config):
        key = (decision.stage, c, nb, decision.rows)
        if c is not None and options[c].feasible and key not in keys:
          keys.append(key)
    return keys
