"""Tiny experiment configs shared by tests, the smoke preset and notebooks."""

import dataclasses

from earl_jax.config import BucketConfig
from earl_jax.envs.base import EnvConfig
from earl_jax.experiment import ExperimentConfig
from earl_jax.rl.losses import LossConfig
from earl_jax.rl.train_step import OptimConfig
from earl_jax.rollout.engine import RolloutConfig
from earl_jax.rollout.sampler import SamplingConfig
from earl_jax.selector.selector import ProfileSettings, SelectorConfig


def smoke_experiment(**changes) -> ExperimentConfig:
  """Every stage of the EARL loop in seconds: Tic-Tac-Toe, 8 episodes, two layouts, two buckets."""
  env = EnvConfig(game='tic_tac_toe', opponent='random', legal_move_reward=0.1)
  config = ExperimentConfig(
    name='smoke',
    model='tiny-game',
    tokenizer='game',
    env=env,
    eval_env=dataclasses.replace(env, legal_move_reward=0.0),
    rollout=RolloutConfig(
      num_episodes=8,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=1),
      prompt_buckets=(16, 32),
    ),
    loss=LossConfig(kl_coef=0.01),
    optim=OptimConfig(learning_rate=3e-3),
    buckets=BucketConfig(lengths=(64, 128)),
    # Ranked by the analytic model (no timing), so that a run's layouts are reproducible.
    selector=SelectorConfig(
      statistic='max', candidates=('dp8', 'dp4.tp2'), profile=ProfileSettings(stages=())
    ),
    balance=True,  # exercise the permuted layout-aware dispatch every step
    steps=3,
    eval_every=2,
    eval_episodes=8,
    checkpoint_every=2,
  )
  return dataclasses.replace(config, **changes)


def staged_profile(config, winners: dict[str, str], needs: dict[str, dict[str, int]] | None = None):
  """A profile of every stage of `config` in which `winners[stage]` is the fastest layout at every
  bucket (others rank by the fewest-splits preference), and memory is the analytic model's: a
  reproducible way to put the stages of a test run on different layouts.

  Args:
    config: an ExperimentConfig (its model preset, buckets, rollout load and candidates).
    winners: stage name -> layout name ('dp4.tp2', ...), among `config.selector.candidates`.
    needs: stage name -> {layout name: per-device bytes} replacing the analytic memory there.
  """
  from earl_jax.config import ModelConfig, ParallelConfig
  from earl_jax.profiling import table as profile_lib
  from earl_jax.programs.builders import StageSpec
  from earl_jax.selector import candidates as candidates_lib
  from earl_jax.selector import selector
  from earl_jax.stage import STAGES, Stage

  model = ModelConfig.preset(config.model)
  rows = (config.rollout.num_episodes,)
  candidates = {
    s: candidates_lib.candidates_for(
      s,
      model,
      num_devices=8,
      rows=rows,
      with_fsdp=config.selector.with_fsdp,
      with_cp=config.selector.with_cp,
      lengths=config.buckets.lengths,
      only=config.selector.layouts,
    )
    for s in STAGES
  }
  base = selector.analytic_profile(
    model,
    stages=STAGES,
    buckets=config.buckets,
    rows=rows,
    candidates=candidates,
    spec=StageSpec(micro_batches=config.micro_batches),
  )
  best = {Stage.parse(s): ParallelConfig.parse(c).name for s, c in winners.items()}
  need = {
    (Stage.parse(s), ParallelConfig.parse(c).name): n
    for s, table in (needs or {}).items()
    for c, n in table.items()
  }
  cells = {
    k: dataclasses.replace(
      c,
      throughput=10.0 if best.get(k[0]) == c.config else c.throughput,
      peak_bytes=need.get((k[0], c.config), c.peak_bytes),
    )
    for k, c in base.cells.items()
  }
  return profile_lib.Profile(key=base.key, cells=cells)
