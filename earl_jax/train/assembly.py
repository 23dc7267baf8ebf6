"""What a run is built from, each part from what the one before returned (the trainer's
composition root; nothing here runs a step).

  model, tok = load_model(config)                          # the shapes and the tokenizer
  spec = stage_spec(config, tok, model)                    # the stages' static settings
  executables = Executables(model, spec=spec)              # one program per (stage, layout, ...)
  scheduler = start_profile(config, model=model, spec=spec, executables=executables)
  selector = make_selector(config, model, spec, scheduler.profile, num_devices, switch_cost)
  engines = make_engines(config, model, tok, executables)  # train, evaluation, sampled
  curriculum = make_curriculum(config)                     # code tasks by pass rate, or None
"""

import dataclasses
import math

from earl_jax.config import ModelConfig
from earl_jax.envs.curriculum import Curriculum
from earl_jax.errors import ConfigError
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import hf_import, tokenizer
from earl_jax.profiling.schedule import ProfileScheduler
from earl_jax.profiling.table import Profile
from earl_jax.programs import Executables, StageSpec
from earl_jax.rollout import engine
from earl_jax.selector import candidates
from earl_jax.selector import selector as selector_lib
from earl_jax.stage import Stage


def system_prompt(config: ExperimentConfig) -> str | None:
  """The chat's system message: the tools declared as Qwen2.5's template declares them when an
  environment calls tools in its format ('swe' with tool_format 'qwen'); else None (the
  tokenizer's default)."""
  from earl_jax.swe import tools  # only the tool schemas

  if any(getattr(env, 'tool_format', None) == 'qwen' for env in (config.env, config.eval_env)):
    return tokenizer.qwen_tool_system_prompt(tools.qwen_tools())
  return None


def load_model(config: ExperimentConfig) -> tuple[ModelConfig, tokenizer.Tokenizer]:
  """The model's shapes and the tokenizer: from a HF directory, or a preset."""
  if config.model_dir:
    model = hf_import.load_config(
      config.model_dir, param_dtype=config.param_dtype, dtype=config.param_dtype
    )
    return model, tokenizer.load_tokenizer(config.model_dir, system_prompt=system_prompt(config))
  model = ModelConfig.preset(config.model).replace(
    param_dtype=config.param_dtype, dtype=config.param_dtype
  )
  return model, tokenizer.load_tokenizer(config.tokenizer)


def stage_spec(config: ExperimentConfig, tok: tokenizer.Tokenizer, model: ModelConfig) -> StageSpec:
  """The static settings every stage program of the run is compiled with (the environment's
  move tokens where the loss has the rules' term)."""
  from earl_jax.envs import registry  # the environments, only where a run starts

  moves = None
  if config.loss.legal_move_coef:
    moves = engine.move_token_ids(tok, registry.make_env(config.env), model.vocab_size)
  return StageSpec.for_rollout(
    config.rollout,
    tok,
    model.vocab_size,
    micro_batches=config.micro_batches,
    update_epochs=config.update_epochs,
    optim=config.optim,
    loss=config.loss,
    packed=config.pack,
    move_token_ids=moves,
  )


def load_rows(config: ExperimentConfig) -> tuple[int, ...]:
  """The selector's load bins: the episodes of a step (experience and train run them all at
  once) and, when fewer, the rollout's slots (its program runs that many rows)."""
  return selector_lib.load_bins((config.rollout.slots, config.rollout.num_episodes))


def check_eval_episodes(config: ExperimentConfig, model: ModelConfig, num_devices: int) -> None:
  """Refuses an `eval_episodes` (or, with `eval_samples`, a number of sampled episodes) that
  some rollout layout cannot split over its batch shards (the evaluation plays on whichever
  layout the rollout runs on), before anything is written.

  Raises:
    ConfigError: naming the value and the multiple expected.
  """
  layouts = candidates.candidates_for(
    Stage.ROLLOUT,
    model,
    num_devices=num_devices,
    rows=load_rows(config),
    with_fsdp=config.selector.with_fsdp,
    only=config.selector.layouts,
  )
  shards = math.lcm(*(c.dp * c.fsdp for c in layouts))
  if config.eval_episodes % shards:
    raise ConfigError(
      f'eval_episodes={config.eval_episodes}: the evaluation plays on the rollout layout, and '
      f'its candidates ({", ".join(c.name for c in layouts)}) split rows over up to {shards} '
      f'batch shards: expected a multiple of {shards}.'
    )
  sampled = config.eval_samples * config.eval_sample_tasks
  if sampled % shards:
    raise ConfigError(
      f'eval_samples={config.eval_samples} x eval_sample_tasks={config.eval_sample_tasks} = '
      f'{sampled} sampled episodes: the evaluation plays on the rollout layout, and its '
      f'candidates ({", ".join(c.name for c in layouts)}) split rows over up to {shards} batch '
      f'shards: expected a multiple of {shards}.'
    )


def rollout_rows(config: ExperimentConfig) -> dict[Stage, int]:
  """The rollout's rows, its slots, where they are not the step's episodes."""
  slots = config.rollout.slots
  return {Stage.ROLLOUT: slots} if slots != config.rollout.num_episodes else {}


def make_selector(
  config: ExperimentConfig,
  model: ModelConfig,
  spec: StageSpec,
  profile: Profile | None,
  num_devices: int,
  switch_cost: selector_lib.SwitchCost,
) -> selector_lib.Selector:
  """The selector on the measured profile (its stages) and the analytic model (the others);
  `switch_cost` is consulted from the second decision on."""
  return selector_lib.Selector(
    config.selector,
    buckets=config.buckets,
    rows=load_rows(config),
    stage_rows=rollout_rows(config),
    model=model,
    num_devices=num_devices,
    profile=profile,
    spec=spec,
    switch_cost=switch_cost,
  )


@dataclasses.dataclass(frozen=True)
class Engines:
  """The run's rollout engines.

  Attributes:
    train: plays the training episodes.
    evaluation: the greedy evaluation (fixed seeds, its own episodes, groups of one).
    sampled: the sampled evaluation of code tasks (`eval_samples`: groups of that many samples
      of one task, drawn as the rollout draws), None when off.
  """

  train: engine.RolloutEngine
  evaluation: engine.RolloutEngine
  sampled: engine.RolloutEngine | None


def greedy_rollout(config: ExperimentConfig, num_episodes: int) -> engine.RolloutConfig:
  """The greedy evaluation's rollout: `num_episodes` groups of one, the run's slots and
  sampling otherwise (greedy)."""
  return dataclasses.replace(
    config.rollout,
    num_episodes=num_episodes,
    group_size=1,
    sampling=dataclasses.replace(config.rollout.sampling, greedy=True),
  )


def make_engines(
  config: ExperimentConfig,
  model: ModelConfig,
  tok: tokenizer.Tokenizer,
  executables: Executables,
) -> Engines:
  """The training engine and the evaluation's (`Engines`)."""
  train = engine.RolloutEngine(
    model, tok, config.env, config.rollout, config.buckets, programs=executables
  )
  evaluation = engine.RolloutEngine(
    model,
    tok,
    config.eval_env,
    greedy_rollout(config, config.eval_episodes),
    config.buckets,
    programs=executables,
  )
  sampled = None
  if config.eval_samples:
    sample_rollout = dataclasses.replace(
      config.rollout,
      num_episodes=config.eval_samples * config.eval_sample_tasks,
      group_size=config.eval_samples,
    )
    sampled = engine.RolloutEngine(
      model, tok, config.eval_env, sample_rollout, config.buckets, programs=executables
    )
  return Engines(train=train, evaluation=evaluation, sampled=sampled)


def start_profile(
  config: ExperimentConfig,
  *,
  model: ModelConfig,
  spec: StageSpec,
  executables: Executables,
  base: Profile | None = None,
  given: Profile | None = None,
) -> ProfileScheduler:
  """The run's profile and its measurement schedule (`ProfileScheduler.start`) on the run's
  load bins and rollout slots."""
  return ProfileScheduler.start(
    config.selector,
    model=model,
    buckets=config.buckets,
    rows=load_rows(config),
    stage_rows=rollout_rows(config),
    spec=spec,
    executables=executables,
    base=base,
    given=given,
  )


def make_curriculum(config: ExperimentConfig) -> Curriculum | None:
  """The online task curriculum over `config.env`'s tasks (None: `curriculum.enabled` off)."""
  if not config.curriculum.enabled:
    return None
  from earl_jax.envs import code_env, swe_env  # the tasks, only where a curriculum draws them

  env = config.env
  if env.task == 'swe':
    tasks = swe_env.load_split(env)
  else:
    tasks = code_env.load_tasks(env.task, env.split, env.split_seed, env.heldout_fraction)
  return Curriculum(config.curriculum, num_tasks=len(tasks))
