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
