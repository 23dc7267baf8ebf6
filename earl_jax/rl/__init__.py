"""The RL algorithm: the batch, advantages from collective group statistics, losses, the update.

from earl_jax.rl import advantages, losses, train_step
from earl_jax.rl.batch import Batch
"""

from earl_jax.rl import advantages, batch, losses, train_step
from earl_jax.rl.batch import Batch

__all__ = ['Batch', 'advantages', 'batch', 'losses', 'train_step']
