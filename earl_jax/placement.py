"""Where the parameters live: the train state, the reference policy and each stage's layout.

`StagePlacement` owns the arrays that persist across steps, each with the layout it is on: the
train state (parameters and AdamW moments) on the train layout, the frozen reference parameters
on the last experience layout. A stage on another layout gets a device-to-device copy
(`params_on`); a new train layout moves the whole state (`switch_train`). Every move's rate is
kept, so that the selector's switch gate can price the next one (`switch_cost_ms`).

`decide_compiled` is the one place where a decision meets XLA: the selector proposes, the
stage's program is built, and a program that XLA's memory analysis refuses marks its layout
infeasible and the stage is decided again.

  placement = StagePlacement.initialize(config, model, executables, train_config)
  decision, program = decide_compiled(selector, Stage.ROLLOUT, stats, build, log=print)
  params = placement.params_on(decision.config)       # drop it when the stage is done
  program, record = placement.switch_train(decision, bucket, rows, step=7, budget=b)
"""

import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from earl_jax import dispatch as dispatch_lib
from earl_jax import distributed
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import hf_import, qwen2
from earl_jax.programs import Executables, SwitchRecord
from earl_jax.programs import executables as executables_lib
from earl_jax.programs import memory as memory_lib
from earl_jax.rl import train_step
from earl_jax.rl.batch import Batch
from earl_jax.selector import selector as selector_lib
from earl_jax.stage import Stage

Built = TypeVar('Built')


def decide_compiled(
  selector: selector_lib.Selector,
  stage: Stage,
  stats: selector_lib.StepStats | None,
  build: Callable[[selector_lib.Decision], Built],
  *,
  log: Callable[[str], None],
) -> tuple[selector_lib.Decision, Built]:
  """The stage's decision and what `build` makes of it (its program, a switched state, ...).

  `build` raising `InfeasibleError` (XLA's memory analysis refused the program at compile
  time) marks the decision's layout infeasible there, logs the reason, and the stage is
  decided again with the next candidate; the decision is committed only once `build` succeeds.
  """
  while True:
    decision, state = selector.propose(stage, stats)
    try:
      built = build(decision)
    except memory_lib.InfeasibleError as e:
      selector.mark_infeasible(decision, str(e))
      log(f'refused at compile time, deciding again: {e}')
      continue
    selector.commit(decision, state)
    return decision, built


def tree_bytes(tree: Any) -> int:
  """Bytes of every array of `tree` (globally, counting each element once)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class StagePlacement:
  """The train state and reference parameters, each on its layout, and the moves between."""

  def __init__(
    self,
    executables: Executables,
    *,
    state: train_step.TrainState,
    train_config: ParallelConfig,
    ref_params: Any | None,
  ):
    """Args:
    executables: the run's compiled programs (their meshes, shardings and resharder).
    state: the train state, on `train_config`'s layout.
    train_config: the train layout.
    ref_params: the frozen reference parameters on the train layout (None: no KL term).
    """
    self.executables = executables
    self._state = state
    self._train_config = train_config
    self._ref_params = ref_params
    self._ref_config = train_config
    self._reshard_ms_per_byte: float | None = None  # measured device-to-device moves

  @classmethod
  def initialize(
    cls,
    config: ExperimentConfig,
    model: ModelConfig,
    executables: Executables,
    train_config: ParallelConfig,
  ) -> 'StagePlacement':
    """Parameters (a HF checkpoint's, or initialized from `config.init_seed`) and the train
    state (moments sharded like their parameters) on `train_config`'s mesh; the reference
    policy is a copy of the parameters when the loss has a KL term."""
    train_mesh = executables.mesh(train_config)
    if config.model_dir:
      _, params = hf_import.load_params(config.model_dir, model, train_mesh)
    else:
      _, params = qwen2.init_model(model, train_mesh, seed=config.init_seed)
    optimizer = train_step.make_optimizer(config.optim)
    # The frozen reference policy lives on the experience layout (the only stage that reads it).
    ref_params = jax.tree.map(jnp.copy, params) if config.loss.kl_coef > 0 else None
    state = train_step.init_train_state(params, optimizer, entropy_coef=config.loss.entropy_coef)
    return cls(executables, state=state, train_config=train_config, ref_params=ref_params)

  # -- what lives where -----------------------------------------------------------------------------

  @property
  def state(self) -> train_step.TrainState:
    """The train state, on `train_config`'s layout."""
    return self._state

  @property
  def train_config(self) -> ParallelConfig:
    return self._train_config

  @property
  def has_reference(self) -> bool:
    """Whether a frozen reference policy is kept (the loss has a KL term)."""
    return self._ref_params is not None

  def replace_state(self, state: train_step.TrainState) -> None:
    """The state an update returned (same layout: its input was donated)."""
    self._state = state

  def restore(self, state: train_step.TrainState, train_config: ParallelConfig) -> None:
    """A state restored from a checkpoint, on the layout it was saved from."""
    self._state, self._train_config = state, train_config

  def drop_state(self) -> None:
    """Frees the train state before a restore replaces it (it is not moved)."""
    del self._state

  def mesh(self, parallel: ParallelConfig) -> jax.sharding.Mesh:
    return self.executables.mesh(parallel)

  def layout(self, parallel: ParallelConfig) -> dispatch_lib.Layout:
    """The batch layout every stage program is compiled for (`Batch.shardings`)."""
    mesh = self.mesh(parallel)
    return dispatch_lib.Layout(
      mesh=mesh, specs=jax.tree.map(lambda s: s.spec, Batch.shardings(mesh))
    )

  # -- moves ----------------------------------------------------------------------------------------

  def params_on(self, parallel: ParallelConfig):
    """The train parameters laid out on `parallel`'s mesh: the state's own arrays on the train
    layout, else a device-to-device copy that the caller drops as soon as its stage is done."""
    if parallel == self._train_config:
      return self._state.params
    t0 = time.perf_counter()
    out = jax.block_until_ready(
      self.executables.resharder(
        self._state.params, self.executables.param_shardings(parallel), donate=False
      )
    )
    self._note_reshard(out, time.perf_counter() - t0)
    return out

  def ref_on(self, parallel: ParallelConfig):
    """The reference parameters, moved (donated) to `parallel` when the experience layout
    changes."""
    if parallel != self._ref_config:
      self._ref_params = self.executables.resharder(
        self._ref_params, self.executables.param_shardings(parallel)
      )
      self._ref_config = parallel
    return self._ref_params

  def switch_train(
    self,
    decision: selector_lib.Decision,
    bucket: int,
    rows: int | None,
    *,
    step: int,
    budget: int | None,
    margin: float,
  ) -> tuple[executables_lib.Executable, SwitchRecord]:
    """Moves the train state (params + AdamW moments) to the decision's layout; returns the
    train program there and the switch's record.

    Raises:
      InfeasibleError: the program does not fit `budget` (checked before anything moves).
    """
    state, program, record = executables_lib.switch(
      Stage.TRAIN,
      self._state,
      self.executables,
      decision.config,
      bucket,
      rows or decision.rows,
      source=self._train_config,
      step=step,
      budget=budget,
      margin=margin,
    )
    self._state = state
    self._note_reshard(state, record.reshard_ms / 1e3)
    self._train_config = decision.config
    return program, record

  def _note_reshard(self, tree: Any, seconds: float) -> None:
    """Keeps the device-to-device move rate (ms per byte) the switch-cost gate estimates from."""
    # Process 0's timing, on every process: the switch gate reads it, and every process must
    # take the same decision (local timings differ).
    rate = distributed.broadcast_json(1e3 * seconds / max(tree_bytes(tree), 1))
    old = self._reshard_ms_per_byte
    self._reshard_ms_per_byte = rate if old is None else 0.5 * (old + rate)

  def switch_cost_ms(
    self, stage: Stage, dst: ParallelConfig, bucket: int, rows: int, *, compile_ms: float
  ) -> float:
    """What moving `stage` to `dst` would stall a step, in ms: `compile_ms` (the program's
    profiled compile time) unless its program is compiled or compiling already, and for train
    the move of the train state (its bytes at the measured device-to-device rate)."""
    cost = 0.0
    if not self.executables.requested(self.executables.key(stage, dst, bucket, rows)):
      cost += compile_ms
    if stage == Stage.TRAIN and self._reshard_ms_per_byte is not None:
      cost += self._reshard_ms_per_byte * tree_bytes(self._state)
    return cost
