"""Where each stage's layout is chosen and its program built, step by step.

`StagePlanner` asks the selector for a stage's decision from the statistics it reads (after
measuring what a lazy profile lacks for it), and builds what the decision runs: the stage's
AOT-compiled program, refused before it runs when it exceeds the memory budget (the selector
then decides again: `placement.decide_compiled`); for the experience stage, the balancing
permutation and the packing of its ranks; for the train stage, the train state switched to a
new layout and the neighbouring buckets' programs, compiled in the background once the step's
update is done (`precompile`).

  planner = StagePlanner(config, selector, scheduler, executables, placement, log=print)
  plan = planner.rollout(prev_stats)                   # plan.decision, plan.program
  plan = planner.experience(stats, lengths, roll_layout)  # + plan.perm, plan.packed
  plan = planner.train(stats, bucket, rows, step=7)    # + plan.switch, plan.lookahead
  planner.precompile(plan.lookahead)                   # after the update
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from earl_jax import dispatch as dispatch_lib
from earl_jax.experiment import ExperimentConfig
from earl_jax.profiling.schedule import ProfileScheduler
from earl_jax.programs import Executables, SwitchRecord
from earl_jax.rl import packing
from earl_jax.rl.batch import Batch
from earl_jax.selector import selector as selector_lib
from earl_jax.stage import Stage
from earl_jax.train.placement import StagePlacement, decide_compiled


@dataclasses.dataclass(frozen=True)
class Plan:
  """A stage's decision and what it runs.

  Attributes:
    decision: the selector's decision (layout, bucket, rows), committed.
    program: the stage's compiled program.
    profile_s: seconds the plan waited for the profile (cells measured before it).
    perm: (experience) the row permutation that balances real tokens over the ranks, or None.
    packed: (experience) how the ranks pack their episodes (`packing.plan`), or None.
    switch: (train) the move of the train state to a new layout, or None.
    lookahead: (train) the neighbouring buckets' programs to precompile once the step's update
      is done (`StagePlanner.precompile`), as `Executables.key` arguments.
  """

  decision: selector_lib.Decision
  program: Any
  profile_s: float = 0.0
  perm: np.ndarray | None = None
  packed: packing.PackPlan | None = None
  switch: SwitchRecord | None = None
  lookahead: tuple[tuple[Stage, Any, int, int], ...] = ()


class StagePlanner:
  """The decision of each stage and the program it runs (see the module docstring)."""

  def __init__(
    self,
    config: ExperimentConfig,
    selector: selector_lib.Selector,
    scheduler: ProfileScheduler,
    executables: Executables,
    placement: StagePlacement,
    *,
    log: Callable[[str], None],
  ):
    self.config = config
    self.selector = selector
    self.scheduler = scheduler
    self.executables = executables
    self.placement = placement
    self.log = log

  def executable(self, decision: selector_lib.Decision, bucket: int, rows: int | None = None):
    """The AOT-compiled program of a stage, refused before running if it exceeds the budget."""
    return self.executables.get(
      self.executables.key(decision.stage, decision.config, bucket, rows or decision.rows),
      budget=self.selector.budget_bytes,
      margin=self.config.selector.safety_margin,
    )

  def _decide(
    self, stage: Stage, stats, build: Callable
  ) -> tuple[selector_lib.Decision, Any, float]:
    """The stage's decision, what `build` makes of it, and the seconds it waited for the
    profile (a lazy profile without the prior measures what it lacks; with it, the cells
    wanted are only sent to compile); see `placement.decide_compiled`."""
    profile_s = self.scheduler.before_decision(self.selector, stage, stats)
    decision, built = decide_compiled(self.selector, stage, stats, build, log=self.log)
    return decision, built, profile_s

  def rollout(self, stats: selector_lib.StepStats | None) -> Plan:
    """The rollout plan from the previous step's statistics (None: the first step); the
    engine's program, whose rows are the rollout's slots. First, while the devices are idle
    (the previous step is done), the profile cells measured between steps."""
    slots = self.config.rollout.slots
    between_s = self.scheduler.between_steps(self.selector, stats)
    decision, program, profile_s = self._decide(
      Stage.ROLLOUT, stats, lambda d: self.executable(d, d.run_bucket, slots)
    )
    return Plan(decision, program, between_s + profile_s)

  def experience(
    self,
    stats: selector_lib.StepStats,
    lengths: np.ndarray,
    roll_layout: dispatch_lib.Layout,
  ) -> Plan:
    """The experience plan from this step's statistics, and (with packing) the balancing
    permutation and the packing of its ranks, all fixed before the batch moves. `lengths`:
    every episode's length, in the batch's row order on `roll_layout`."""
    decision, (program, perm, packed), profile_s = self._decide(
      Stage.EXPERIENCE, stats, lambda d: self._experience_program(d, lengths, roll_layout)
    )
    return Plan(decision, program, profile_s, perm=perm, packed=packed)

  def _experience_program(self, decision, lengths: np.ndarray, roll_layout: dispatch_lib.Layout):
    perm = packed = None
    if self.config.pack:
      shape = {
        'ranks': decision.config.batch_shards,
        'bucket': decision.run_bucket,
        'row_multiple': self._row_multiple(),
      }
      if self.config.balance:  # the fewest packed rows, moving the fewest rows (a ring shift)
        like = jax.eval_shape(
          functools.partial(Batch.zeros, len(lengths), decision.run_bucket, xp=jnp)
        )
        perm = dispatch_lib.balanced_permutation(
          lengths,
          roll_layout,
          self.placement.layout(decision.config),
          like=like,
          method='ring',
          cost=lambda p: packing.rows_needed(lengths[p], **shape),
        )
        lengths = lengths[perm]
      packed = packing.plan(lengths, **shape)
    rows = None if packed is None else packed.rows
    return self.executable(decision, decision.run_bucket, rows), perm, packed

  def _row_multiple(self) -> int:
    """Packed rows split over the batch shards of every experience and train candidate (so any
    layout the selector picks, or falls back to, takes them) and over the micro-batches."""
    shards = [
      c.batch_shards
      for stage in (Stage.EXPERIENCE, Stage.TRAIN)
      for c in self.selector.profile(stage).candidates(stage)
    ]
    return math.lcm(self.config.micro_batches, *shards)

  def train(
    self, stats: selector_lib.StepStats, bucket: int, rows: int | None, *, step: int
  ) -> Plan:
    """The train plan; the train state switched if the layout changed (`plan.switch`); the
    neighbouring buckets' programs to precompile (`plan.lookahead`). `rows`: the packed rows
    (None: one per episode)."""

    def build(decision):
      if decision.config == self.placement.train_config:
        return self.executable(decision, decision.run_bucket, rows), None
      return self.placement.switch_train(
        decision,
        bucket,
        rows,
        step=step,
        budget=self.selector.budget_bytes,
        margin=self.config.selector.safety_margin,
      )

    decision, (update, switch), profile_s = self._decide(Stage.TRAIN, stats, build)
    lookahead = tuple(
      (stage, config, neighbour, rows or decision.rows)
      for stage, config, neighbour, _ in self.selector.lookahead(decision)[1:]
    )
    return Plan(decision, update, profile_s, switch=switch, lookahead=lookahead)

  def precompile(self, lookahead: Sequence[tuple[Stage, Any, int, int]]) -> None:
    """Compiles a train plan's `lookahead` in the background, after the step's update (so that
    no compile of its own overlaps the update the run times, `ProfileScheduler.observing`).
    While a profile measurement waits for a quiet step boundary, they wait in the queue
    (`Executables.hold`)."""
    for key in lookahead:
      self.executables.precompile(self.executables.key(*key), tree=self.placement.state)
