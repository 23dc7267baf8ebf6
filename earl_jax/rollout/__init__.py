"""Rollout: prefill + decode against a bucketed KV cache, the multi-turn engine, trajectories.

from earl_jax.rollout import engine, sampler, trajectories
"""

from earl_jax.rollout import engine, sampler, trajectories
from earl_jax.rollout.engine import RolloutConfig, RolloutEngine, reply_token_ids
from earl_jax.rollout.sampler import SamplingConfig
from earl_jax.rollout.trajectories import Trajectories

__all__ = [
  'RolloutConfig',
  'RolloutEngine',
  'SamplingConfig',
  'Trajectories',
  'engine',
  'reply_token_ids',
  'sampler',
  'trajectories',
]
