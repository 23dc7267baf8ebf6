"""The RL algorithm: the batch, advantages from collective group statistics, losses, the update.

from earl_jax.rl import advantages, losses, train_step
from earl_jax.rl.trajectory import Batch
"""

from earl_jax.rl import advantages, losses, train_step, trajectory
from earl_jax.rl.trajectory import Batch

__all__ = ['Batch', 'advantages', 'losses', 'train_step', 'trajectory']
