"""Presets of experiments/train.py.

default   the embedded default: a tiny model from scratch, the built-in tokenizer, Connect Four
          against the random opponent, 8 fake CPU devices, under 10 minutes on 2 cores.
long      the same task trained 10x longer, aiming at >= 80% wins against random; on this machine it
          plateaus at 0.64-0.76 like the default (see README, Results).
smoke     a few seconds: the loop with every stage, for tests and CI.
qwen      a real Qwen2.5 checkpoint (--config.model_dir=...), chat template, for GPUs.
"""

import dataclasses

from earl_jax.config import BucketConfig
from earl_jax.envs.base import EnvConfig
from earl_jax.rl.advantages import AdvantageConfig
from earl_jax.rl.losses import LossConfig
from earl_jax.rl.train_step import OptimConfig
from earl_jax.rollout.engine import RolloutConfig
from earl_jax.rollout.sampler import SamplingConfig
from earl_jax.selector.selector import SelectorConfig
from earl_jax.testing import configs
from earl_jax.trainer import ExperimentConfig

# Connect Four with the built-in character tokenizer: a turn is ~58 tokens, an episode up to ~1300.
GAME_BUCKETS = BucketConfig(lengths=(128, 256, 384, 512, 768, 1024, 1536))


def default() -> ExperimentConfig:
  return ExperimentConfig(
    name='default',
    model='tiny-game',
    tokenizer='game',
    env=EnvConfig(game='connect_four', opponent='random', legal_move_reward=0.1),
    eval_env=EnvConfig(game='connect_four', opponent='random'),
    rollout=RolloutConfig(
      num_episodes=64,
      group_size=1,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=1),
      prompt_buckets=(64, 128),
    ),
    advantages=AdvantageConfig(estimator='reinforce'),
    loss=LossConfig(clip_eps=0.2, kl_coef=0.0, aggregation='token'),
    optim=OptimConfig(learning_rate=3e-3, grad_clip=1.0),
    buckets=GAME_BUCKETS,
    selector=SelectorConfig(
      statistic='max',
      candidates=('dp8', 'dp4.tp2', 'dp2.tp4'),
      profile_cache='.earl_cache/profile_default.json',
      decode_tokens=4,
      repeats=2,
      rounds=1,
    ),
    steps=60,
    eval_every=10,
    eval_episodes=128,
    checkpoint_every=20,
  )


def long() -> ExperimentConfig:
  return dataclasses.replace(default(), name='long', steps=600, eval_every=25, checkpoint_every=50)


def smoke() -> ExperimentConfig:
  return configs.smoke_experiment()


def qwen() -> ExperimentConfig:
  c = default()
  return dataclasses.replace(
    c,
    name='qwen',
    model_dir='/path/to/Qwen2.5-0.5B-Instruct',
    param_dtype='bfloat16',
    env=EnvConfig(game='connect_four', opponent='random', parse='lenient'),
    eval_env=EnvConfig(game='connect_four', opponent='random', parse='lenient'),
    rollout=RolloutConfig(
      num_episodes=64,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=64),
      prompt_buckets=(128, 256, 512),
    ),
    optim=OptimConfig(learning_rate=1e-6),
    loss=LossConfig(kl_coef=0.01),
    buckets=BucketConfig(lengths=(1024, 2048, 4096, 8192, 16384, 32768)),
    selector=SelectorConfig(statistic='p95', profile_cache='.earl_cache/profile_qwen.json'),
    steps=200,
  )


PRESETS = {'default': default, 'long': long, 'smoke': smoke, 'qwen': qwen}
