"""Advantages on the train layout, from group statistics computed with collectives.

No controller gathers the rewards: `dispatch.group_stats` reduces each device's rows into
per-group sums and completes them with a psum over the batch axes of the train mesh.

Estimators (the episode return R of each row, broadcast over the tokens the policy generated):
  'reinforce'     A = R - mean(R over the batch)                 (EARL's REINFORCE with a baseline)
  'reinforce_pp'  A = (R - mean) / (std + eps) over the batch     (REINFORCE++ normalisation)
  'grpo'          A = (R - mean_g) / (std_g + eps) over the row's group g (episodes that share
                  their start and opponent randomness; see RolloutConfig.group_size)
"""

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from earl_jax.dispatch.group_stats import group_stats
from earl_jax.rl.trajectory import Batch
from earl_jax.sharding import rules

Estimator = Literal['reinforce', 'reinforce_pp', 'grpo']
ESTIMATORS: tuple[str, ...] = get_args(Estimator)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
  estimator: Estimator = 'reinforce'
  eps: float = 1e-6

  def __post_init__(self):
    if self.estimator not in ESTIMATORS:
      raise ValueError(
        f'AdvantageConfig.estimator={self.estimator!r} is unknown; known: {list(ESTIMATORS)}.'
      )
    if not self.eps > 0:
      raise ValueError(f'AdvantageConfig.eps must be > 0, got {self.eps}.')


def row_advantages(batch: Batch, *, mesh: Mesh, num_groups: int, config: AdvantageConfig):
  """Per-row advantages [B] (0 for invalid rows), computed with collectives on `mesh`."""
  if config.estimator == 'grpo':
    groups, G = batch.group_ids, num_groups
  else:
    groups, G = jnp.zeros_like(batch.group_ids), 1
  mean, std, _ = group_stats(batch.rewards, groups, batch.valid, num_groups=G, mesh=mesh)
  adv = batch.rewards - mean
  if config.estimator != 'reinforce':
    adv = adv / (std + config.eps)
  return jnp.where(batch.valid, adv, 0.0)


def with_advantages(batch: Batch, *, mesh: Mesh, num_groups: int, config: AdvantageConfig) -> Batch:
  """The batch with `advantages` filled: the row advantage on every generated token."""
  adv = row_advantages(batch, mesh=mesh, num_groups=num_groups, config=config)
  tokens = jnp.where(batch.loss_mask, adv[:, None], 0.0).astype(jnp.float32)
  return batch.replace(advantages=rules.constrain(tokens, ('batch', 'seq')))


@functools.lru_cache(maxsize=32)
def advantage_fn(mesh: Mesh, num_groups: int, config: AdvantageConfig):
  """`with_advantages` jitted for one mesh (call it under `jax.set_mesh(mesh)`)."""
  # Not donated: fields of a batch may share buffers (old and reference log-probs, when there is
  # no reference model), and the batch is small next to the model.
  return jax.jit(
    functools.partial(with_advantages, mesh=mesh, num_groups=num_groups, config=config)
  )
