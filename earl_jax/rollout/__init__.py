"""Rollout: jitted prefill + decode against a bucketed KV cache, and the multi-turn engine.

from earl_jax.rollout import engine, sampler
"""

from earl_jax.rollout import engine, sampler
from earl_jax.rollout.engine import RolloutConfig, RolloutEngine, Trajectories
from earl_jax.rollout.sampler import SamplingConfig

__all__ = ['RolloutConfig', 'RolloutEngine', 'SamplingConfig', 'Trajectories', 'engine', 'sampler']
