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
4. The fastest feasible layout wins (a measured figure ranks as it is, a figure of the cost
   model at its lower bound: see below), with hysteresis so that the choice never flip-flops:
   - the bucket moves *down* only after `patience` consecutive lower readings (up at once);
   - the layout is held for `patience` decisions after a switch (a minimum dwell), so it never
     flips back within that, unless it stops fitting;
   - the current layout is kept while it is feasible and within `switch_threshold` of the best
     (the best at its score; the current layout at its figure where it is measured, fitted to
     its own cells, or within a factor e: a switch must beat what the model expects of it);
   - a switch must pay for itself: the measured time it saves over the steps expected in this
     bucket (the mean run of steps per bucket so far) must exceed what it costs (the reshard
     and any compile, from `switch_cost`), both numbers in the reason.
   A layout whose program XLA refuses at compile time (`mark_infeasible`) is left out from then
   on, and the decision that chose it is taken again.
5. Every decision is recorded with its reason.

The rule is pure: `Selector.rule(stage, state, stats, profile)` returns the decision and the
stage's next `StageState` and changes nothing; `commit` records them. Nothing here compiles or
measures. A lazily profiled cell the rule needs and nobody measured yet has the cost model's
figure and uncertainty (`profiling.cost_model`, with `ProfileSettings.prior`): the decision runs
on it at once, its reason naming which figures were measured and which came from the model (with
their uncertainty); once some layout is measured there, a layout the model alone rates ranks
by the model's lower bound, so that it wins only where it is faster even if the model is
optimistic. `Selector.wanted` names the cells
worth measuring: those whose upper bound reaches the best lower bound, and every layout at the
longest bucket the stage has reached and stays in (the caller measures them between steps and
hands them over with `use_profile`). Without the prior, `Selector.missing` names the buckets to
measure before the decision.

Where the ranking comes from, per stage: a measured `Profile` (the paper: decode throughput per
layout and context range, measured by `earl_jax.profiling.profiler`, for
`SelectorConfig.profile.stages`), or, for the other stages, the analytic memory model with a
static preference for the fewest model-parallel splits (the layout that wins at short context in
the paper and on CPU), so that they still move to wider layouts as their memory grows without
paying for a profile.

  grid = profiler.grid_for(sel_cfg, buckets=table, rows=64, spec=spec, budget_bytes=b)
  profile = profiler.run(cfg, grid, executables=exe, cache_path=sel_cfg.profile.cache)
  sel = Selector(sel_cfg, model=cfg, buckets=table, rows=64, profile=profile, spec=spec)
  stats = StepStats(episode_lengths=lengths, num_responses=64)
  d, state = sel.propose(Stage.ROLLOUT, stats)    # pure; `sel.decide` also commits
  sel.commit(d, state)                           # or sel.mark_infeasible(d, why), propose again
  d.config, d.bucket, d.run_bucket, d.reason
  for key in sel.lookahead(d): executables.precompile(executables.key(*key), tree=params)
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from absl import logging

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig, check_float32
from earl_jax.errors import ConfigError
from earl_jax.memory_budget import InfeasibleError, MiB, fits, resolve_budget
from earl_jax.profiling import analytic, cost_model
from earl_jax.profiling.analytic import ProgramShapes
from earl_jax.profiling.table import Cell, Profile, ProfileSettings
from earl_jax.selector.candidates import candidates_for, named_stages
from earl_jax.stage import STAGES, Stage

Statistic = Literal['mean', 'max', 'p95']
STATISTICS = ('mean', 'max', 'p95')


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
    with_cp: the stages whose candidates include context-parallel (cp > 1) layouts, which split
      each row's tokens (and the rollout's KV cache slots) over a ring of devices (True: all,
      False: none). They rank after every other layout until measured.
    profile: what the profile measures, and when (`profiler.grid_for` turns it into a
      `ProfileGrid`; `profiler.run` and `schedule.ProfileScheduler` measure it).
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
  with_cp: bool | tuple[Stage | str, ...] = True
  profile: ProfileSettings = dataclasses.field(default_factory=ProfileSettings)
  initial_context: int | None = None

  def __post_init__(self):
    if self.statistic not in STATISTICS:
      raise ConfigError(
        f'SelectorConfig.statistic must be one of {STATISTICS}, got {self.statistic!r}.'
      )
    check_float32(self, 'headroom', 'safety_margin', 'switch_threshold')
    if self.budget_mib is not None:
      check_float32(self, 'budget_mib')
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
    object.__setattr__(self, 'with_fsdp', named_stages(self.with_fsdp))
    object.__setattr__(self, 'with_cp', named_stages(self.with_cp))
    if self.candidates is not None:
      object.__setattr__(self, 'candidates', tuple(self.candidates))
      if not self.candidates:
        raise ConfigError(
          'SelectorConfig.candidates is empty: expected layout names (e.g. dp8,dp4.tp2), or '
          'none for every valid layout.'
        )
      for c in self.candidates:
        ParallelConfig.parse(c)  # raises naming the bad layout
    if self.initial_context is not None and self.initial_context <= 0:
      raise ConfigError(
        f'SelectorConfig.initial_context must be positive, got {self.initial_context}.'
      )

  @property
  def budget_bytes(self) -> int | None:
    return None if self.budget_mib is None else int(self.budget_mib * MiB)

  @property
  def layouts(self) -> tuple[ParallelConfig, ...] | None:
    """The parsed candidates (None: every valid layout)."""
    return (
      None if self.candidates is None else tuple(ParallelConfig.parse(c) for c in self.candidates)
    )


def load_bins(rows: int | Sequence[int]) -> tuple[int, ...]:
  """The load bins: the number(s) of responses the stages run, sorted and unique."""
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
    stage_rows: per stage name, the rows its program runs where that is not `num_responses`:
      the rollout on its slots, which the episodes take in turn (`RolloutConfig.num_slots`).
  """

  episode_lengths: Sequence[int]
  num_responses: int
  turn_lengths: Sequence[int] = ()
  free_memory_bytes: int | None = None
  stage_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
  stage_rows: Mapping[str, int] = dataclasses.field(default_factory=dict)

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
    object.__setattr__(
      self, 'stage_rows', {str(Stage.parse(k)): int(v) for k, v in self.stage_rows.items()}
    )
    for stage, rows in {'num_responses': self.num_responses, **self.stage_rows}.items():
      if rows <= 0:
        raise ValueError(f'StepStats rows of {stage} must be positive, got {rows}.')
    if self.free_memory_bytes is not None and self.free_memory_bytes <= 0:
      raise ValueError(
        f'StepStats.free_memory_bytes must be positive, got {self.free_memory_bytes}.'
      )

  def rows_of(self, stage: Stage) -> int:
    """The rows `stage`'s program runs: its load."""
    return self.stage_rows.get(str(Stage.parse(stage)), self.num_responses)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
  """One layout as the decision saw it (`measured`: its figure was measured; else `prior` says
  where it came from, or is '' for the analytic preference; `uncertainty`: the figure's relative
  standard deviation; `score`: what it is ranked by, the figure when measured, else the cost
  model's lower bound, figure x exp(-confidence x uncertainty))."""

  config: str
  throughput: float | None
  need_bytes: int
  feasible: bool
  measured: bool = True
  prior: str = ''
  uncertainty: float = 0.0
  score: float | None = None

  def __post_init__(self):
    if self.score is None:
      object.__setattr__(self, 'score', self.throughput)


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
    longest: the longest episode (after headroom; 0 where not read).
    throughput: the ranking score of `config` at (bucket, rows): measured tokens/s/device for a
      profiled stage, the fewest-splits preference otherwise.
    measured: whether the ranking came from measurements.
    uncertainty: the relative standard deviation of `throughput` (the measurement's noise, or
      the cost model's uncertainty; 0 for the preference).
    basis: where an unmeasured `throughput` came from (`Cell.prior`; '' when measured).
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
  uncertainty: float = 0.0
  basis: str = ''
  longest: float = 0.0

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
  """The analytic ranking: fewer model-parallel splits first, tensor before fsdp at equal size;
  context-parallel layouts after every other (until measured they are the last resort: their
  ring passes K/V shards at every layer), fewest splits first among them."""
  score = 1.0 / (config.tp * config.fsdp) - 1e-3 * (config.fsdp - 1)
  return score if config.cp == 1 else 1e-3 * score / config.cp


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Shapes:
  decode_tokens: int
  chunk: int
  micro_batches: int


# The values of a default `programs.StageSpec()` (tests/selector/selector_test.py checks that).
DEFAULT_SHAPES: ProgramShapes = _Shapes(decode_tokens=8, chunk=16, micro_batches=1)


def analytic_profile(
  model: ModelConfig,
  *,
  stages: Sequence[Stage],
  buckets: BucketConfig,
  rows: Sequence[int],
  candidates: Mapping[Stage, Sequence[ParallelConfig]],
  spec: ProgramShapes,
  coefficients: analytic.Coefficients | None = None,
) -> Profile:
  """A profile without measurements: analytic memory, fewest-splits scores (nothing compiles)."""
  coefficients = coefficients or analytic.Coefficients()
  cells = {}
  for stage in stages:
    for bucket in buckets.lengths:
      for load in rows:
        for config in candidates[stage]:
          need = analytic.estimate(
            stage,
            model,
            config,
            bucket,
            load,
            decode_tokens=spec.decode_tokens,
            chunk=spec.chunk,
            micro_batches=spec.micro_batches,
            coefficients=coefficients,
          ).total
          cells[(stage, bucket, load, config.name)] = Cell(
            stage=stage,
            config=config.name,
            bucket=bucket,
            rows=load,
            peak_bytes=need,
            oom=False,
            throughput=fewest_splits_score(config),
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageState:
  """One stage's hysteresis state: what the rule reads, and returns updated (never changed in
  place). JSON in checkpoints (`as_dict` / `from_dict`)."""

  config: ParallelConfig | None = None
  bucket: int | None = None
  lower_readings: int = 0
  decisions: int = 0
  since_switch: int | None = None  # decisions since the layout last changed (None: never)
  bucket_steps: int = 0  # consecutive decisions at the current bucket
  bucket_runs: tuple[int, ...] = ()  # lengths of finished runs
  top_bucket: int | None = None  # the longest run bucket of any decision so far

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d['config'] = None if self.config is None else self.config.name
    d['bucket_runs'] = list(self.bucket_runs)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> 'StageState':
    d = dict(d)
    d['config'] = None if d['config'] is None else ParallelConfig.parse(d['config'])
    d['bucket_runs'] = tuple(d.get('bucket_runs', ()))
    return cls(**d)

  def expected_steps(self, patience: int) -> float:
    """Steps a bucket is expected to last: the mean of the finished runs so far (`patience`
    until one has finished)."""
    return float(np.mean(self.bucket_runs)) if self.bucket_runs else float(patience)

  def advanced(
    self, config: ParallelConfig, bucket: int, lower_readings: int, run_bucket: int | None = None
  ) -> 'StageState':
    """The state after a decision for `config` at `bucket` (with the reading's lower count), run
    at `run_bucket` (default: `bucket`)."""
    bucket_steps, bucket_runs = self.bucket_steps, self.bucket_runs
    if self.bucket is not None and bucket != self.bucket:
      bucket_runs = (*bucket_runs, bucket_steps)
      bucket_steps = 0
    since_switch = self.since_switch
    if self.config is not None and config != self.config:
      since_switch = 0
    elif since_switch is not None:
      since_switch += 1
    return StageState(
      config=config,
      bucket=bucket,
      lower_readings=lower_readings,
      decisions=self.decisions + 1,
      since_switch=since_switch,
      bucket_steps=bucket_steps + 1,
      bucket_runs=bucket_runs,
      top_bucket=max(self.top_bucket or 0, run_bucket or bucket),
    )


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
  lower_readings: int  # consecutive readings below the held bucket, after this one


@dataclasses.dataclass(frozen=True)
class _Candidate:
  """A layout and how the decision sees it."""

  config: ParallelConfig
  option: Option


@dataclasses.dataclass(frozen=True)
class _Choice:
  """Step 4's outcome: the layout to run, why, and the switch gate's (gain, cost) in ms."""

  chosen: _Candidate
  why: str
  gate: tuple[float, float] | None = None


# (stage, from layout, to layout, run bucket, rows) -> milliseconds the switch would stall.
SwitchCost = Callable[[Stage, ParallelConfig, ParallelConfig, int, int], float]

TIMED = 'tok/s/dev'  # a measured figure, or a prior scaled by measurements


def _unit_of(figure: Cell | Option) -> str:
  """The unit of a ranking figure: measured or scaled by measurements (tokens per device per
  second), the analytic time model's nominal speeds, or the unprofiled stages' preference."""
  if figure.measured or figure.prior not in ('', cost_model.ANALYTIC):
    return TIMED
  return '(analytic)' if figure.prior == cost_model.ANALYTIC else '(preference)'


def _bound(value: float | None, option: Option) -> str:
  """' (lower bound)' where `value`, what an option is weighed at, is the cost model's lower
  bound, not its figure."""
  return '' if value == option.throughput else ' (lower bound)'


# The uncertainty (a log-scale standard deviation) within which the cost model's figure of the
# current layout is weighed as it is against a measured best: within a factor e, the model knows
# the layout from cells near it; beyond, it barely does, and the layout is kept until measured.
HELD_AT_FIGURE = 1.0


def barely_known(option: Option | Cell) -> bool:
  """Whether the current layout's figure is too uncertain to weigh a switch against: not
  measured, not fitted to its own cells, and beyond `HELD_AT_FIGURE`. Such a layout is kept
  until it is measured: weighed at its lower bound, a layout known from the other layouts'
  cells lost to whichever layout was measured first at a new bucket, slower or not; and
  elsewhere a switch must beat what the model expects of it, not its lower bound
  (docs/results/main-job.md, issue 40)."""
  return not cost_model.anchored(option) and option.uncertainty > HELD_AT_FIGURE


def _figures(options: Sequence[Option]) -> str:
  """'; measured: a, b; model: c (150+-20%, c@256)' for a profiled stage: which ranking figures
  were measured, and the model's figure, uncertainty and basis of the others ('' for a stage
  ranked by the preference)."""
  if not any(o.measured or o.prior for o in options):
    return ''
  measured = [o.config for o in options if o.measured]
  model = [
    f'{o.config} ({o.throughput or 0:.1f}+-{o.uncertainty:.0%}, {o.prior})'
    for o in options
    if not o.measured
  ]
  return f'; measured: {", ".join(measured) or "none"}' + (
    f'; model: {", ".join(model)}' if model else ''
  )


class Selector:
  """Decides each stage's layout (see the module docstring).

  Nothing here compiles or measures: stages covered by `profile` are ranked by its
  measurements, the others by the analytic model (from `model` and `spec`). A profiled stage's
  bucket that the profile lacks (`ProfileSettings.lazy`) is reported by `missing`; the caller
  measures it and hands the result to `use_profile` before it asks for the decision.

  The rule itself is `rule(stage, state, stats, profile) -> (decision, new state)`, which
  changes nothing; `propose` runs it on the current state, `commit` records its outcome, and
  `decide` is both.
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
    spec: ProgramShapes | None = None,
    switch_cost: SwitchCost | None = None,
    stage_rows: Mapping[Stage | str, int] | None = None,
  ):
    """Args:
    config: the decision rule and where rankings come from.
    buckets: the context-length table.
    rows: the number(s) of responses the stages run (the load bins).
    stage_rows: the rows of a stage whose program runs another count than the largest load
      before any step says (the rollout's slots; see `StepStats.stage_rows`); each one of `rows`.
    model: the model (needed unless every stage is in `profile`); with
      `config.profile.prior`, the cells a profile lacks get prior figures from it.
    num_devices: devices of every stage (default: all).
    profile: a measured profile (`profiler.run`); it must cover every stage of
      `config.profile.stages` (possibly not every bucket, with `lazy`).
    spec: static stage settings of the analytic model (decode tokens, prompt chunk,
      micro-batches; a `programs.StageSpec` has them); default `DEFAULT_SHAPES`.
    switch_cost: what a switch would stall the step, in ms (default: nothing); weighed against
      its measured gain.

    Raises:
      ValueError: the profile's buckets differ from `buckets`, or it lacks a profiled stage.
    """
    self.config = config
    self.buckets = buckets
    self.rows = load_bins(rows)
    self.stage_rows = {str(Stage.parse(k)): int(v) for k, v in (stage_rows or {}).items()}
    if not set(self.stage_rows.values()) <= set(self.rows):
      raise ValueError(f'stage_rows {self.stage_rows} are not among the load bins {self.rows}.')
    self.num_devices = num_devices or jax.device_count()
    self.budget_bytes = resolve_budget(config.budget_bytes)
    self.history: list[Decision] = []
    self._state: dict[Stage, StageState] = {}
    self._refused: dict[Stage, set[tuple[str, int, int]]] = {}
    self._switch_cost = switch_cost
    self._model = model
    self._shapes = spec or DEFAULT_SHAPES
    self._profiles: dict[Stage, Profile] = {}
    if profile is not None:
      self.use_profile(profile)
    unmeasured = [s for s in config.profile.stages if s not in self._profiles]
    if unmeasured:
      raise ValueError(
        f'SelectorConfig.profile.stages names {[str(s) for s in unmeasured]}, which no '
        'profile covers; measure one with profiling.profiler.run(model, '
        'profiler.grid_for(...)) and pass it as `profile`, or leave those stages to the '
        'analytic model.'
      )
    unprofiled = [s for s in STAGES if s not in self._profiles]
    if unprofiled and model is not None:
      self._profiles.update(dict.fromkeys(unprofiled, self._analytic(model, unprofiled, spec)))

  def _analytic(self, model: ModelConfig, stages: list[Stage], spec) -> Profile:
    candidates = {
      s: candidates_for(
        s,
        model,
        num_devices=self.num_devices,
        rows=self.rows,
        with_fsdp=self.config.with_fsdp,
        with_cp=self.config.with_cp,
        lengths=self.buckets.lengths,
        only=self.config.layouts,
      )
      for s in stages
    }
    return analytic_profile(
      model,
      stages=stages,
      buckets=self.buckets,
      rows=self.rows,
      candidates=candidates,
      spec=spec or DEFAULT_SHAPES,
    )

  # -- state ----------------------------------------------------------------------------------------

  def current(self, stage: Stage) -> ParallelConfig | None:
    """The layout of the stage's last decision."""
    return self.state(stage).config

  def state(self, stage: Stage) -> StageState:
    """The stage's committed state (a fresh one before its first decision)."""
    return self._state.get(Stage.parse(stage), StageState())

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

  def use_profile(self, profile: Profile) -> None:
    """Ranks `profile`'s stages by it from now on (e.g. with cells measured since); with
    `config.profile.prior` and a model, the cells it lacks get prior figures
    (`prior.complete`)."""
    if tuple(self.buckets.lengths) != profile.buckets:
      raise ValueError(
        f'Buckets {self.buckets.lengths} differ from the profiled buckets {profile.buckets}.'
      )
    if self.config.profile.prior and self._model is not None:
      profile = cost_model.complete(profile, model=self._model, shapes=self._shapes)
    self._profiles.update(dict.fromkeys(profile.stages, profile))

  def state_dict(self) -> dict[str, Any]:
    """JSON-able state (current layouts, buckets, hysteresis counters, refused programs)."""
    return {
      'stages': {str(s): state.as_dict() for s, state in self._state.items()},
      'refused': {str(s): sorted(list(k) for k in keys) for s, keys in self._refused.items()},
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for s, d in state['stages'].items():
      self._state[Stage.parse(s)] = StageState.from_dict(d)
    for s, keys in state.get('refused', {}).items():
      self._refused[Stage.parse(s)] = {tuple(k) for k in keys}

  def log(self) -> list[dict[str, Any]]:
    """Every decision so far, JSON-able."""
    return [d.as_dict() for d in self.history]

  # -- asking, deciding, recording --------------------------------------------------------------

  def missing(self, stage: Stage, stats: StepStats | None) -> list[int]:
    """The buckets a decision for `stage` on `stats` would rank or run at that its profile has
    not measured yet (a profiled stage under a lazy profile); [] when it can decide now.
    Measure the first, `use_profile` the result, and ask again."""
    stage = Stage.parse(stage)
    if stage not in self.config.profile.stages:
      return []
    profile = self.profile(stage)
    reading = self._read(stage, stats or self._initial_stats(), self.state(stage), profile)
    buckets = dict.fromkeys((reading.bucket, reading.run_bucket))
    return [b for b in buckets if not profile.covers(stage, b, reading.rows)]

  def wanted(
    self,
    stage: Stage,
    stats: StepStats | None,
    *,
    ahead: bool = False,
    second: bool = False,
    again: bool = False,
    contenders: bool = False,
  ) -> list[tuple[int, int, str]]:
    """The cells worth measuring for `stage`'s decisions on `stats`, as (bucket, rows, layout),
    the most promising first (`cost_model.to_measure`): at the buckets a decision would rank and
    run at, or (`ahead`) at the next bucket up once the longest context nears it
    (`ProfileSettings.ahead`). At the longest run bucket the stage has reached, once it has
    stayed there `ProfileSettings.settle` decisions, every layout that fits is wanted, pruned or
    not: crossovers happen at long contexts. `second`: for each layout measured at one bucket
    only, a cell at the shortest bucket the stage has decided at (at the load read now), so that
    its curve rests on two buckets (one cannot tell its fixed cost from its compute). `again`:
    the measured cells to time again at the buckets a decision would rank and run at, where the
    best and another are within their noise (`cost_model.to_retime`,
    `ProfileSettings.retimes`). `contenders`: the cells to measure that could beat the best
    (the longest bucket's every layout left out where the bounds rank it below). [] for a
    stage ranked by the analytic model, and without the prior (see `missing`). Pure: the same on
    every process that holds the same profile."""
    stage = Stage.parse(stage)
    settings = self.config.profile
    if stage not in settings.stages or not settings.prior or self._model is None:
      return []
    profile = self.profile(stage)
    state = self.state(stage)
    reading = self._read(stage, stats or self._initial_stats(), state, profile)
    if second:
      return self._second_buckets(stage, profile, reading.rows)
    if again:
      return [
        (bucket, reading.rows, name)
        for bucket in dict.fromkeys((reading.bucket, reading.run_bucket))
        for name in cost_model.to_retime(
          profile,
          stage,
          bucket,
          reading.rows,
          confidence=settings.confidence,
          retimes=settings.retimes,
        )
      ]
    buckets = [reading.bucket, reading.run_bucket]
    if ahead:
      lengths = self.buckets.lengths
      i = lengths.index(reading.run_bucket)
      below = lengths[i - 1] if i else 0
      if reading.longest < below + settings.ahead * (reading.run_bucket - below):
        return []  # the run is not near the next bucket yet
      buckets = lengths[i + 1 : i + 2]
    settled = settings.settle == 0 or (
      state.bucket == reading.bucket and state.bucket_steps >= settings.settle
    )
    longest = (
      not ahead and not contenders and reading.run_bucket >= (state.top_bucket or 0) and settled
    )
    out = []
    for bucket in dict.fromkeys(buckets):
      names = cost_model.to_measure(
        profile,
        stage,
        bucket,
        reading.rows,
        budget=self.budget_bytes,
        margin=self.config.safety_margin,
        confidence=settings.confidence,
        every=longest and bucket == reading.run_bucket,
      )
      out += [(bucket, reading.rows, name) for name in names]
    return out

  def _second_buckets(
    self, stage: Stage, profile: Profile, rows: int
  ) -> list[tuple[int, int, str]]:
    """`wanted(second=True)`: each layout measured at one bucket only, at the shortest bucket
    the stage has decided at, where it fits and is not refused."""
    decided = [d.bucket for d in self.history if d.stage == stage]
    if not decided:
      return []
    shortest = min(decided)
    buckets: dict[str, set[int]] = {}
    for (s, bucket, _, name), cell in profile.cells.items():
      if s == stage and cell.measured and cell.throughput and not cell.oom:
        buckets.setdefault(name, set()).add(bucket)
    refused = self._refused.get(stage, set())
    out = []
    for config in profile.candidates(stage):
      measured = buckets.get(config.name, set())
      cell = profile.cell(stage, shortest, rows, config.name)
      if (
        len(measured) == 1
        and shortest not in measured
        and self._fits(cell.peak_bytes, self.budget_bytes)
        and (config.name, shortest, rows) not in refused
      ):
        out.append((shortest, rows, config.name))
    return out

  def propose(self, stage: Stage, stats: StepStats | None) -> tuple[Decision, StageState]:
    """The rule on the stage's current state: (decision, the state after it); records nothing.

    Args:
      stage: the stage to decide.
      stats: the previous step's statistics; None before the first step (the initial context).

    Raises:
      ValueError: a context longer than the largest bucket, or a load above the profiled ones.
      memory_budget.InfeasibleError: no layout fits; names the smallest layout's need.
    """
    stage = Stage.parse(stage)
    profile = self.profile(stage)
    return self.rule(stage, self.state(stage), stats or self._initial_stats(), profile)

  def commit(self, decision: Decision, state: StageState) -> None:
    """Records a proposed decision: its state becomes the stage's, and it joins the log."""
    self._state[decision.stage] = state
    self.history.append(decision)
    if decision.switched:
      logging.info('selector: %s', decision.reason)

  def decide(self, stage: Stage, stats: StepStats | None) -> Decision:
    """The layout and bucket for the coming `stage`, from the previous step's `stats`, recorded
    (`propose`, then `commit`)."""
    decision, state = self.propose(stage, stats)
    self.commit(decision, state)
    return decision

  def mark_infeasible(self, decision: Decision, reason: str) -> None:
    """XLA refused `decision`'s program (at its run bucket and load): its layout is left out
    there from now on. The refused decision joins the log, marked; a proposal that was not
    committed leaves the state as it was, so that the next proposal takes the next candidate."""
    self._refused.setdefault(decision.stage, set()).add(
      (decision.config.name, decision.run_bucket, decision.rows)
    )
    refused = dataclasses.replace(decision, reason=f'{decision.reason}; REFUSED: {reason}')
    self.history.append(refused)
    logging.warning('selector: %s', refused.reason)

  def initial_decisions(self) -> dict[Stage, Decision]:
    """What a first decision (no statistics yet) would choose for every stage; records
    nothing."""
    stats = self._initial_stats()
    return {s: self.rule(s, StageState(), stats, self.profile(s))[0] for s in self.stages}

  def expected_steps(self, stage: Stage) -> float:
    """Steps a bucket is expected to last: the mean of the finished runs so far (at least
    `patience` until one has finished)."""
    return self.state(stage).expected_steps(self.config.patience)

  # -- the rule -------------------------------------------------------------------------------------

  def rule(
    self, stage: Stage, state: StageState, stats: StepStats, profile: Profile
  ) -> tuple[Decision, StageState]:
    """Steps 1-5 of the module docstring: the decision for `stage` from its `state`, the
    statistics and the profile, and the state after it. Pure: reads this selector's settings
    and refused programs, changes nothing."""
    reading = self._read(stage, stats, state, profile)
    options = self._options(
      stage, profile, reading.bucket, reading.run_bucket, reading.rows, reading.budget
    )
    feasible = [o for o in options if o.option.feasible]
    if not feasible:
      raise self._infeasible(stage, reading.run_bucket, reading.rows, reading.budget, options)
    # By score (a model figure at its lower bound) once some layout is measured; before that,
    # every figure is the model's alone and they rank as they are.
    ranked = any(o.option.measured for o in feasible)
    best = max(feasible, key=lambda o: o.option.score if ranked else o.option.throughput)
    unit = _unit_of(profile.cell(stage, reading.bucket, reading.rows, best.config))
    choice = self._choose(stage, stats, options, best, state, reading, unit, ranked)
    chosen = choice.chosen
    infeasible = [o.config.name for o in options if not o.option.feasible]
    reason = (
      f'{stage}: {self.config.statistic} context {reading.value:.0f} -> bucket '
      f'{reading.bucket}, longest {reading.longest:.0f} -> run bucket {reading.run_bucket}, '
      f'{stats.rows_of(stage)} responses -> load {reading.rows}; {choice.why}'
      + (f'; infeasible: {", ".join(infeasible)}' if infeasible else '')
      + (f'; {"; ".join(reading.notes)}' if reading.notes else '')
      + _figures([o.option for o in options])
    )
    decision = Decision(
      stage=stage,
      step=state.decisions,
      config=chosen.config,
      bucket=reading.bucket,
      run_bucket=reading.run_bucket,
      rows=reading.rows,
      statistic=reading.value,
      longest=reading.longest,
      throughput=chosen.option.throughput,
      measured=profile.cell(stage, reading.bucket, reading.rows, chosen.config).measured,
      need_bytes=chosen.option.need_bytes,
      budget_bytes=reading.budget,
      switched=state.config is not None and chosen.config != state.config,
      previous=state.config,
      reason=reason,
      options=tuple(o.option for o in options),
      gain_ms=None if choice.gate is None else choice.gate[0],
      cost_ms=None if choice.gate is None else choice.gate[1],
      uncertainty=chosen.option.uncertainty,
      basis=chosen.option.prior if not chosen.option.measured else '',
    )
    return decision, state.advanced(
      chosen.config, reading.bucket, reading.lower_readings, reading.run_bucket
    )

  def _fits(self, need: int, budget: int | None) -> bool:
    return budget is None or fits(need, budget, margin=self.config.safety_margin)

  def _score(self, figure: Cell) -> float | None:
    """What a figure ranks by: a measurement as it is; the cost model's figure at its lower bound
    (`ProfileSettings.confidence`), so that a layout the model alone rates, however fast, wins
    only where it is faster even if the model is too optimistic (the measurement policy, which
    looks at upper bounds, measures it meanwhile)."""
    if figure.throughput is None or figure.measured or figure.prior == cost_model.ANALYTIC:
      return figure.throughput
    return figure.throughput * math.exp(-self.config.profile.confidence * figure.uncertainty)

  def _options(
    self, stage, profile: Profile, bucket: int, run_bucket: int, rows: int, budget: int | None
  ) -> list[_Candidate]:
    refused = self._refused.get(stage, set())
    out = []
    for config in profile.candidates(stage):
      run_cell = profile.cell(stage, run_bucket, rows, config)
      rank_cell: Cell = profile.cell(stage, bucket, rows, config)
      figure = rank_cell if rank_cell.throughput is not None else run_cell
      feasible = (
        self._fits(run_cell.peak_bytes, budget)
        and figure.throughput is not None
        and (config.name, run_bucket, rows) not in refused
      )
      option = Option(
        config=config.name,
        throughput=figure.throughput,
        need_bytes=run_cell.peak_bytes,
        feasible=feasible,
        measured=figure.measured,
        prior=figure.prior,
        uncertainty=figure.uncertainty,
        score=self._score(figure),
      )
      out.append(_Candidate(config, option))
    return out

  def _infeasible(self, stage, run_bucket, rows, budget, options) -> InfeasibleError:
    smallest = min(options, key=lambda o: o.option.need_bytes)
    need = smallest.option.need_bytes
    margin = self.config.safety_margin
    refused = self._refused.get(stage, set())
    if budget is None or all((o.config.name, run_bucket, rows) in refused for o in options):
      return InfeasibleError(
        f'No {stage} layout is left at bucket {run_bucket} with {rows} responses: XLA refused '
        f'every candidate ({", ".join(n for n, _, _ in sorted(self._refused.get(stage, ())))}).'
      )
    return InfeasibleError(
      f'No {stage} layout fits the per-device budget of {budget / MiB:.1f} MiB at bucket '
      f'{run_bucket} with {rows} responses: the smallest need is {smallest.config.name} with '
      f'{need / MiB:.1f} MiB per device (x{1 + margin:.2f} safety margin = '
      f'{need * (1 + margin) / MiB:.1f} MiB). Raise the budget, lower the load'
      + ('' if stage in self.config.with_cp else ', allow context parallelism (selector.with_cp)')
      + ' or shorten the context.'
    )

  def _initial_stats(self) -> StepStats:
    n = self.config.initial_context or self.buckets.lengths[0]
    return StepStats(episode_lengths=(n,), num_responses=self.rows[-1], stage_rows=self.stage_rows)

  def _read(self, stage: Stage, stats: StepStats, state: StageState, profile: Profile) -> _Reading:
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
    bucket, lower_readings = raw_bucket, 0
    if state.bucket is not None and raw_bucket < state.bucket:
      lower_readings = state.lower_readings + 1
      if lower_readings < cfg.patience:
        bucket = state.bucket
        notes.append(
          f'held bucket {state.bucket} ({cfg.statistic} reads {raw_bucket}, '
          f'{lower_readings}/{cfg.patience} lower readings)'
        )
      else:
        lower_readings = 0
    budget = self.budget_bytes
    if stats.free_memory_bytes is not None and (budget is None or stats.free_memory_bytes < budget):
      budget = stats.free_memory_bytes
      notes.append(f'free memory {budget / MiB:.1f} MiB')
    rows = profile.rows_bin(stats.rows_of(stage))
    return _Reading(value, longest, bucket, run_bucket, rows, budget, tuple(notes), lower_readings)

  def _gate(self, stage, stats, state, weighed, prev: _Candidate, best: _Candidate, reading):
    """The switch-cost gate: (gain ms, cost ms) of moving from `prev` to `best`, weighed at
    `weighed` (their throughputs as `_choose` compares them), or None when the time per step is
    not known (no throughputs, or no token count for the stage)."""
    now, top = weighed
    work = stats.stage_tokens.get(str(stage))
    if not work or not now or not top:
      return None
    per_step = work / self.num_devices  # tokens per device per step
    saved_s = per_step / now - per_step / top
    gain = 1e3 * saved_s * state.expected_steps(self.config.patience)
    cost = 0.0
    if self._switch_cost is not None:
      cost = float(
        self._switch_cost(stage, prev.config, best.config, reading.run_bucket, reading.rows)
      )
    return gain, cost

  def _choose(
    self, stage, stats, options, best: _Candidate, state, reading, unit, ranked: bool
  ) -> _Choice:
    """Step 4: the layout to run, why, and the switch gate's numbers when it was weighed.
    `ranked`: the best was ranked by score (some layout is measured here); else by figure, and
    the current layout is weighed at its figure too."""
    cfg = self.config
    prev = state.config
    current = next((o for o in options if o.config == prev), None)
    if prev is None:
      return _Choice(best, f'first decision: fastest feasible is {best.config.name}')
    if current is None or not current.option.feasible:
      why = self._why_left(stage, prev, current, reading)
      return _Choice(best, f'{why}; fastest feasible is {best.config.name}')
    if prev == best.config:
      return _Choice(current, f'kept {prev.name} (fastest feasible)')
    if state.since_switch is not None and state.since_switch < cfg.patience:
      return _Choice(
        current,
        f'held {prev.name} ({state.since_switch}/{cfg.patience} decisions since the last switch; '
        f'best now {best.config.name})',
      )
    # A layout the model barely knows is measured first (the profile's lead, `order_wanted`).
    if ranked and barely_known(current.option):
      return _Choice(
        current,
        f'kept {prev.name}: measured nowhere near here (the model: '
        f'{current.option.throughput:.1f}+-{current.option.uncertainty:.0%}, '
        f'{current.option.prior}); '
        f'{best.config.name} is weighed against it once it is',
      )
    if ranked:
      now, top = current.option.throughput, best.option.score
    else:
      now, top = current.option.throughput, best.option.throughput
    figures = (
      f'{top:.1f}{_bound(top, best.option)} vs {now:.1f}{_bound(now, current.option)} {unit}'
    )
    if now >= (1.0 - cfg.switch_threshold) * top:
      return _Choice(
        current,
        f'kept {prev.name} (within {cfg.switch_threshold:.0%} of best {best.config.name}: '
        f'{figures})',
      )
    faster = f'{best.config.name} is {top / now - 1:.0%} faster than {prev.name} ({figures})'
    timed = unit == TIMED and _unit_of(current.option) == TIMED
    gate = self._gate(stage, stats, state, (now, top), current, best, reading) if timed else None
    if gate is None:
      return _Choice(best, faster)
    gain, cost = gate
    weighed = (
      f'saves {gain:.0f} ms over {state.expected_steps(cfg.patience):.1f} expected steps, '
      f'switch costs {cost:.0f} ms'
    )
    if gain <= cost:
      return _Choice(current, f'kept {prev.name}: {faster}, but it {weighed}', gate)
    return _Choice(best, f'{faster}; it {weighed}', gate)

  def _why_left(self, stage, prev: ParallelConfig, current: _Candidate | None, reading):
    """Why the current layout `prev` cannot stay: refused by XLA, or over the budget."""
    refused = self._refused.get(stage, ())
    if current is not None and (prev.name, reading.run_bucket, reading.rows) in refused:
      return f'{prev.name} was refused by XLA at bucket {reading.run_bucket}'
    need = current.option.need_bytes if current else 0
    budget = 'unlimited' if reading.budget is None else f'{reading.budget / MiB:.1f} MiB'
    return (
      f'{prev.name} no longer fits ({need / MiB:.1f} MiB x'
      f'{1 + self.config.safety_margin:.2f} > {budget} at bucket {reading.run_bucket})'
    )

  def best_for(self, stage: Stage, bucket: int, rows: int) -> ParallelConfig | None:
    """The fastest layout that fits at (bucket, rows), without hysteresis (None: nothing fits,
    or the bucket is not profiled yet)."""
    stage = Stage.parse(stage)
    profile = self._profiles[stage]
    if not profile.covers(stage, bucket, rows):
      return None
    options = self._options(stage, profile, bucket, bucket, rows, self.budget_bytes)
    feasible = [o for o in options if o.option.feasible]
    if not feasible:
      return None
    return max(feasible, key=lambda o: o.option.score).config

  def lookahead(self, decision: Decision) -> list[tuple[Stage, ParallelConfig, int, int]]:
    """Keys worth compiling in the background now: the chosen one, and its neighbours'.

    For the next bucket down, and the next one up once the longest episode nears it (past
    `ProfileSettings.ahead` of the way through its bucket, as for `wanted`): the fastest
    feasible layout there (once that bucket is profiled), where the model knows it from its own
    cells (a layout measured nowhere is fastest only by the other layouts' curves: a compile of a
    guess, 5-15 s of a train program on a 2-core host, that takes a core from the steps and
    from the profile's measurements), and the chosen layout too when it fits there (hysteresis
    may keep it). Each key is (stage, config, bucket, rows), the arguments of
    `Executables.precompile`.
    """
    stage, rows = decision.stage, decision.rows
    keys = [(stage, decision.config, decision.run_bucket, rows)]
    lengths = self.buckets.lengths
    i = lengths.index(decision.run_bucket)
    below = lengths[i - 1] if i else 0
    near = decision.longest >= below + self.config.profile.ahead * (decision.run_bucket - below)
    neighbours = [lengths[j] for j in (i + 1, i - 1) if 0 <= j < len(lengths) and (j < i or near)]
    profile = self._profiles[stage]
    for nb in neighbours:
      if not profile.covers(stage, nb, rows):
        keys.append((stage, decision.config, nb, rows))  # not profiled yet
        continue
      options = self._options(stage, profile, nb, nb, rows, self.budget_bytes)
      feasible = {o.config: o.option.feasible for o in options}
      best = self.best_for(stage, nb, rows)
      if best is not None and not cost_model.anchored(profile.cell(stage, nb, rows, best)):
        best = None
      for config in (best, decision.config):
        key = (stage, config, nb, rows)
        if config is not None and feasible[config] and key not in keys:
          keys.append(key)
    return keys
