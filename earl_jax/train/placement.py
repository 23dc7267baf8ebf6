"""Where the parameters live: the train state, the reference policy and each stage's layout.

`StagePlacement` owns the arrays that persist across steps, each with the layout it is on: the
train state (parameters and AdamW moments) on the train layout, the frozen reference parameters
on the last experience layout. A stage on another layout gets a device-to-device copy
(`params_on`); a new train layout moves the whole state (`switch_train`). Every move's rate is
kept, so that the selector's switch gate can price the next one (`switch_cost_ms`).

`decide_compiled` is the one place where a decision meets XLA: the selector proposes, the
stage's program is built, and a program that XLA's memory analysis refuses marks its layout
infeasible and the stage is decided again.

A warm start (`ExperimentConfig.init_from`, the checkpoints of `experiments/sft.py` or of a run
of the main job) gives the initial parameters: `check_warm_start` compares its saved shapes with
the model from metadata alone, `load_warm_start` reads only its parameters onto the train layout.

  check_warm_start(config.init_from, model)           # metadata only: before anything compiles
  placement = StagePlacement.initialize(config, model, executables, train_config)
  decision, program = decide_compiled(selector, Stage.ROLLOUT, stats, build, log=print)
  params = placement.params_on(decision.config)       # drop it when the stage is done
  program, record = placement.switch_train(decision, bucket, rows, step=7, budget=b)
"""

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from earl_jax import dispatch as dispatch_lib
from earl_jax import distributed
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.errors import UserError
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import hf_import, qwen2
from earl_jax.programs import Executables, SwitchRecord
from earl_jax.programs import executables as executables_lib
from earl_jax.programs import memory as memory_lib
from earl_jax.rl import train_step
from earl_jax.rl.batch import Batch
from earl_jax.run import checkpointing
from earl_jax.selector import selector as selector_lib
from earl_jax.sharding import mesh as mesh_lib
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
    """Parameters (a warm start's, `config.init_from`; a HF checkpoint's; or initialized from
    `config.init_seed`) and the train state (fresh moments sharded like their parameters) on
    `train_config`'s mesh; the reference policy is a copy of the parameters when the loss has a
    KL term.

    Raises:
      WarmStartError: `init_from` is missing, holds no checkpoint, or one of another model shape.
    """
    train_mesh = executables.mesh(train_config)
    if config.init_from:
      params = load_warm_start(config.init_from, model, train_mesh)
    elif config.model_dir:
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


# -- warm start -------------------------------------------------------------------------------------


class WarmStartError(UserError):
  """An `ExperimentConfig.init_from` that does not hold a warm start of the run's model."""


# The ModelConfig fields that decide the parameters' shapes, with their dimension letters.
_SHAPE_FIELDS = (
  ('vocab_size', 'V'),
  ('hidden_size', 'D'),
  ('intermediate_size', 'F'),
  ('num_layers', 'L'),
  ('num_heads', 'H'),
  ('num_kv_heads', 'K'),
  ('head_dim', 'Dh'),
  ('tie_word_embeddings', None),
  ('qkv_bias', None),
)


def warm_start_dir(init_from: str) -> str:
  """The checkpoints folder `init_from` names: the folder itself, or the `checkpoints/` of the
  run folder it names.

  Raises:
    WarmStartError: `init_from` is not an existing folder.
  """
  if not os.path.isdir(init_from):
    raise WarmStartError(
      f'init_from={init_from!r} does not exist or is not a folder: expected the checkpoints '
      'folder of a warm start; run it first, e.g. `python experiments/sft.py --config=code` '
      "(it writes runs/code_sft/checkpoints, the `code` preset's init_from)."
    )
  nested = os.path.join(init_from, 'checkpoints')
  return nested if os.path.isdir(nested) else init_from


def check_warm_start(init_from: str | None, model: ModelConfig) -> tuple[Any, int] | None:
  """Checks that `init_from` holds a checkpoint whose parameters have `model`'s shapes, from its
  metadata alone (no array is read, nothing compiles): a Trainer calls it before compiling.

  Returns:
    None without `init_from`; else (the saved parameters' ShapeDtypeStructs, keyed by dotted
    parameter name, and the latest step), what `load_warm_start` restores.

  Raises:
    WarmStartError: a missing folder, no checkpoint in it, or parameters of another shape (the
      differing dimension named, from the checkpoint's `meta['model']` when it has one).
  """
  if init_from is None:
    return None
  directory = warm_start_dir(init_from)
  ckpt = checkpointing.Checkpointer(directory, async_save=False)
  try:
    if ckpt.latest_step() is None:
      raise WarmStartError(
        f'init_from={init_from!r}: no checkpoint in {ckpt.directory}: expected the checkpoints '
        'of a warm start run (experiments/sft.py writes them every checkpoint_every steps).'
      )
    step, meta, saved = _newest_readable_shapes(init_from, ckpt)
  finally:
    ckpt.close()
  if not isinstance(saved, dict) or 'params' not in saved:
    raise WarmStartError(
      f'init_from={init_from!r}: step {step} in {directory} holds no train state parameters: '
      'expected a checkpoint of experiments/sft.py or experiments/train.py.'
    )
  saved_params = _by_name(saved['params'])
  _check_model_fields(init_from, step, meta.get('model'), model)
  _check_param_shapes(init_from, step, saved_params, _by_name(_abstract_params(model)), model)
  return saved_params, step


def load_warm_start(init_from: str, model: ModelConfig, mesh: jax.sharding.Mesh):
  """The parameters of `init_from`'s latest checkpoint, checked (`check_warm_start`) and
  restored onto `mesh` with the model's parameter shardings, in `model.param_dtype`. Only the
  parameters are read (not the optimizer moments)."""
  saved, step = check_warm_start(init_from, model)
  _, abstract = qwen2.abstract_model(model, mesh)
  target = jax.tree_util.tree_map_with_path(
    lambda path, a: jax.ShapeDtypeStruct(a.shape, saved[_name(path)].dtype, sharding=a.sharding),
    abstract,
  )
  ckpt = checkpointing.Checkpointer(warm_start_dir(init_from), async_save=False)
  try:  # the newest step whose parameters restore and verify, as --resume takes it
    older = [s for s in sorted(ckpt.all_steps(), reverse=True) if s <= step]
    restored, params = ckpt.restore_newest_readable_params(
      target, on_skip=_skip_warm_start(init_from), steps=older
    )
  except checkpointing.CheckpointError:
    raise WarmStartError(
      f'init_from={init_from!r}: no checkpoint in {ckpt.directory} restores (steps {older}, '
      'each said above): expected an intact warm start; run experiments/sft.py again.'
    ) from None
  finally:
    ckpt.close()
  if restored != step:
    logging.warning('warm start: from step %d of %s, the newest that restores', restored, init_from)
  dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(params)}
  if dtypes != {np.dtype(model.param_dtype)}:  # e.g. a float32 warm start of a bfloat16 run
    shardings = qwen2.state_shardings(abstract)
    cast = lambda p: jax.tree.map(lambda x: x.astype(model.param_dtype), p)  # noqa: E731
    params = jax.jit(cast, out_shardings=shardings, donate_argnums=0)(params)
  return params


def _skip_warm_start(init_from: str) -> Callable[[int, str], None]:
  def skip(step: int, reason: str) -> None:
    logging.warning(
      'warm start: step %d of %s does not read (%s): trying an older one', step, init_from, reason
    )

  return skip


def _newest_readable_shapes(init_from: str, ckpt: checkpointing.Checkpointer):
  """(step, meta, saved state shapes) of the newest step whose metadata reads (older ones are
  tried, and the skipped ones said); WarmStartError when none does."""
  try:
    return ckpt.newest_readable(
      lambda step, meta: (step, meta, ckpt.state_shapes(step)), on_skip=_skip_warm_start(init_from)
    )
  except checkpointing.CheckpointError:
    raise WarmStartError(
      f'init_from={init_from!r}: no checkpoint in {ckpt.directory} has readable metadata (steps '
      f'{sorted(ckpt.all_steps(), reverse=True)}, each said above): expected an intact warm '
      'start; run experiments/sft.py again.'
    ) from None


def _abstract_params(model: ModelConfig):
  """The model's parameter ShapeDtypeStructs (on a data-parallel mesh: only shapes are read)."""
  mesh = mesh_lib.make_mesh(ParallelConfig(dp=len(mesh_lib.canonical_devices())))
  return qwen2.abstract_model(model, mesh)[1]


def _name(path) -> str:
  """A parameter's dotted name ('layers.0.mlp.up_proj'), the same for an nnx.State and for the
  nested dicts Orbax stores it as."""
  parts = [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path]
  return '.'.join(parts[:-1] if parts and parts[-1] == 'value' else parts)


def _by_name(tree) -> dict[str, Any]:
  return {_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_model_fields(init_from: str, step: int, saved: Any, model: ModelConfig) -> None:
  """Raises WarmStartError naming every shape field of the checkpoint's model (its meta) that
  differs from `model`'s."""
  if not isinstance(saved, dict):
    return  # no model in the meta (an RL checkpoint): the parameter shapes decide
  differ = [
    f'{field}{f" ({letter})" if letter else ""}={saved[field]!r} (here {getattr(model, field)!r})'
    for field, letter in _SHAPE_FIELDS
    if field in saved and saved[field] != getattr(model, field)
  ]
  if differ:
    raise WarmStartError(
      f'init_from={init_from!r}: step {step} is a checkpoint of model {saved.get("name")!r} with '
      f"{', '.join(differ)}: expected a warm start of this run's model {model.name!r} (the same "
      'shapes).'
    )


def _check_param_shapes(
  init_from: str, step: int, saved: dict[str, Any], want: dict[str, Any], model: ModelConfig
) -> None:
  """Raises WarmStartError naming the first parameters of another shape in the checkpoint, or
  missing from it, or extra."""
  problems = [
    f'{n} has shape {tuple(saved[n].shape)} (here {tuple(a.shape)})'
    for n, a in want.items()
    if n in saved and tuple(saved[n].shape) != tuple(a.shape)
  ]
  problems += [f'{n} is missing' for n in want if n not in saved]
  problems += [f'{n} is not in this model' for n in saved if n not in want]
  if problems:
    more = f' and {len(problems) - 3} more' if len(problems) > 3 else ''
    raise WarmStartError(
      f'init_from={init_from!r}: step {step} does not hold parameters of model {model.name!r}: '
      f'{"; ".join(problems[:3])}{more}: expected a warm start of the same shapes.'
    )
