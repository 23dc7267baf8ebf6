"""What a run is built from, each part from what the one before returned (the trainer's
composition root; nothing here runs a step).

  model, tok = load_model(config)                          # the shapes and the tokenizer
  spec = stage_spec(config, tok, model)                    # the stages' static settings
  executables = Executables(model, spec=spec)              # one program per (stage, layout, ...)
  profile = RunProfile.start(config, model=model, spec=spec, executables=executables)
  selector = make_selector(config, model, spec, profile.profile, num_devices, switch_cost)
  train_engine, eval_engine = make_engines(config, model, tok, executables)
"""

import dataclasses

from earl_jax.config import ModelConfig
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import hf_import, tokenizer
from earl_jax.programs import Executables, StageSpec, profiling
from earl_jax.rollout import engine
from earl_jax.selector import selector as selector_lib
from earl_jax.selector.profile import Profile
from earl_jax.stage import Stage


def load_model(config: ExperimentConfig) -> tuple[ModelConfig, tokenizer.Tokenizer]:
  """The model's shapes and the tokenizer: from a HF directory, or a preset."""
  if config.model_dir:
    model = hf_import.load_config(
      config.model_dir, param_dtype=config.param_dtype, dtype=config.param_dtype
    )
    return model, tokenizer.load_tokenizer(config.model_dir)
  model = ModelConfig.preset(config.model).replace(
    param_dtype=config.param_dtype, dtype=config.param_dtype
  )
  return model, tokenizer.load_tokenizer(config.tokenizer)


def stage_spec(config: ExperimentConfig, tok: tokenizer.Tokenizer, model: ModelConfig) -> StageSpec:
  """The static settings every stage program of the run is compiled with."""
  return StageSpec.for_rollout(
    config.rollout,
    tok,
    model.vocab_size,
    micro_batches=config.micro_batches,
    optim=config.optim,
    loss=config.loss,
    packed=config.pack,
  )


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
    rows=config.rollout.num_episodes,
    model=model,
    num_devices=num_devices,
    profile=profile,
    spec=spec,
    switch_cost=switch_cost,
  )


def make_engines(
  config: ExperimentConfig,
  model: ModelConfig,
  tok: tokenizer.Tokenizer,
  executables: Executables,
) -> tuple[engine.RolloutEngine, engine.RolloutEngine]:
  """The training engine, and the evaluation engine (fixed seeds, greedy, its own episodes)."""
  train = engine.RolloutEngine(
    model, tok, config.env, config.rollout, config.buckets, programs=executables
  )
  eval_rollout = dataclasses.replace(
    config.rollout,
    num_episodes=config.eval_episodes,
    group_size=1,
    sampling=dataclasses.replace(config.rollout.sampling, greedy=True),
  )
  evaluation = engine.RolloutEngine(
    model, tok, config.eval_env, eval_rollout, config.buckets, programs=executables
  )
  return train, evaluation


class RunProfile:
  """The measured profile the selector ranks its profiled stages by, and how it is completed:
  with `selector.profile.lazy`, each bucket is measured when a decision first needs it."""

  def __init__(
    self, profiler: profiling.RunProfiler | None, profile: Profile | None, *, lazy: bool
  ):
    """Use `RunProfile.start`."""
    self._profiler = profiler
    self._lazy = lazy
    self.profile = profile  # None: the selector decides on the analytic model only

  @classmethod
  def start(
    cls,
    config: ExperimentConfig,
    *,
    model: ModelConfig,
    spec: StageSpec,
    executables: Executables,
    base: Profile | None = None,
    given: Profile | None = None,
  ) -> 'RunProfile':
    """The start-up profile of `config.selector.profile.stages`: `given` when passed, else
    every candidate program of those stages compiled and timed at every bucket (with `lazy`:
    none yet), or what the cache holds when it was made for exactly this setup. `base`: cells
    measured before (the checkpoint a resume continues from), preferred to the cache's."""
    settings = config.selector.profile
    if not settings.stages:
      return cls(None, given, lazy=False)
    profiler = profiling.RunProfiler.for_selector(
      config.selector,
      model=model,
      buckets=config.buckets,
      rows=config.rollout.num_episodes,
      spec=spec,
      executables=executables,
      base=base,
    )
    profile = given if given is not None else profiler.start(measure=not settings.lazy)
    return cls(profiler, profile, lazy=settings.lazy)

  def measure_missing(
    self, selector: selector_lib.Selector, stage: Stage, stats: selector_lib.StepStats | None
  ) -> float:
    """Measures the buckets a lazy profile lacks for the coming decision of `stage` (handing
    them to `selector`); returns the seconds spent."""
    if self._profiler is None or not self._lazy:
      return 0.0
    profile, seconds = self._profiler.measure_missing(selector, stage, stats)
    self.profile = profile or self.profile
    return seconds

  def compile_ms(self, stage: Stage, bucket: int, rows: int, layout: str) -> float:
    """The profiled compile time of a program (0 when not profiled)."""
    cell = None if self.profile is None else self.profile.cells.get((stage, bucket, rows, layout))
    return cell.compile_ms if cell is not None and cell.compile_ms else 0.0
