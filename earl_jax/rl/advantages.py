"""Advantages on the train layout, from group statistics computed with collectives.

No controller gathers the rewards: `dispatch.group_stats` reduces each device's rows into
per-group sums and completes them with a psum over the batch axes of the train mesh.

Credit: with credit='episode' the value of every generated token is its episode's return R
(`Batch.rewards`); with credit='turn' it is the discounted reward-to-go G_t of the token's turn
(`Batch.returns`, gamma set where the batch is built), so a move is judged by what followed it.

Estimators, applied to those values (statistics over valid rows, or over generated tokens):
  'reinforce'     A = R - mean(R over the batch)                 (EARL's REINFORCE with a baseline)
  'reinforce_pp'  A = (R - mean) / (std + eps) over the batch     (REINFORCE++ normalisation)
  'grpo'          A = (R - mean_g) / (std_g + eps) over the row's group g (episodes that share
                  their start and opponent randomness; see RolloutConfig.group_size)
  'dr_grpo'       A = R - mean_g: Dr. GRPO (Liu et al., 2025), GRPO without the division by the
                  group's std, which weights groups whose rewards barely differ the most (its
                  other half, no length normalisation, is the loss's 'token' aggregation: every
                  generated token of the batch counts once, whatever its episode's length)
  'rloo'          A = R - (sum_g - R) / (n_g - 1): REINFORCE leave-one-out (Ahmadian et al.,
                  2024), each episode's baseline the mean of the others in its group (0 for an
                  episode alone in its group); episode credit only
"""

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from earl_jax.dispatch.group_stats import group_stats
from earl_jax.errors import ConfigError
from earl_jax.rl.batch import Batch
from earl_jax.sharding import rules

Estimator = Literal['reinforce', 'reinforce_pp', 'grpo', 'dr_grpo', 'rloo']
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
Credit = Literal['episode', 'turn']
CREDITS: tuple[str, ...] = get_args(Credit)
MoveCredit = Literal['reward_to_go', 'own_turn']
MOVE_CREDITS: tuple[str, ...] = get_args(MoveCredit)
GROUPED = ('grpo', 'dr_grpo', 'rloo')  # the estimators whose statistics run per group


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
  """How advantages are formed.

  Attributes:
    estimator: 'reinforce', 'reinforce_pp', 'grpo', 'dr_grpo' or 'rloo' (see the module
      docstring).
    credit: 'episode' (every token gets its episode's return) or 'turn' (its turn's
      discounted reward-to-go).
    gamma: the discount of the reward-to-go over turns (credit='turn').
    move_credit: where a reward that the environment gives the reply itself
      (`StepResult.move_rewards`: a legal move's bonus, an invalid reply's penalty) counts,
      credit='turn' only: 'reward_to_go' (with every reward, so an invalid reply's penalty also
      blames, discounted, every move before it) or 'own_turn' (its own turn alone: the turn
      that played into a full column is judged by that move, the moves before it by where the
      game was going). With the policy sharp on a move that is illegal in some state,
      'own_turn' is the signal that leaves it: a legal move tried there scores its bonus against
      the penalty, not the next turn's repeat of the illegal move (docs/results/main-job.md).
    eps: added to the std.
    std_ddof: the std's delta degrees of freedom ('grpo', 'reinforce_pp'): 0, the population
      std; 1, the sample std, as TRL's and verl's GRPO divide by (for groups of n the
      advantages are sqrt((n - 1) / n) of ddof 0's).
  """

  estimator: Estimator = 'reinforce'
  credit: Credit = 'episode'
  gamma: float = 1.0
  move_credit: MoveCredit = 'reward_to_go'
  eps: float = 1e-6
  std_ddof: int = 0

  def __post_init__(self):
    for field, known in (
      ('estimator', ESTIMATORS),
      ('credit', CREDITS),
      ('move_credit', MOVE_CREDITS),
    ):
      if getattr(self, field) not in known:
        raise ConfigError(
          f'AdvantageConfig.{field}={getattr(self, field)!r} is unknown; known: {list(known)}.'
        )
    if self.estimator == 'rloo' and self.credit != 'episode':
      raise ConfigError(
        f"AdvantageConfig.estimator='rloo' leaves one episode out of its group's baseline: it "
        f"needs credit='episode', got credit={self.credit!r}."
      )
    if self.move_credit == 'own_turn' and self.credit != 'turn':
      raise ConfigError(
        f"AdvantageConfig.move_credit='own_turn' credits a move reward to its turn: it needs "
        f"credit='turn', got credit={self.credit!r}."
      )
    if not 0 < self.gamma <= 1:
      raise ConfigError(f'AdvantageConfig.gamma must be in (0, 1], got {self.gamma}.')
    if self.std_ddof not in (0, 1) or isinstance(self.std_ddof, bool):
      raise ConfigError(
        f'AdvantageConfig.std_ddof={self.std_ddof!r}: expected 0 (the population std) or 1 '
        '(the sample std, as TRL and verl).'
      )
    if not 0 < self.eps <= 1:  # larger (or inf) shrinks every normalised advantage (to 0)
      raise ConfigError(
        f'AdvantageConfig.eps must be in (0, 1] (a small constant added to the std), got '
        f'{self.eps}.'
      )


def _normalise(
  values: Float[Array, ' E'],
  groups: Int[Array, ' E'],
  valid: Bool[Array, ' E'],
  *,
  mesh: Mesh,
  num_groups: int,
  config: AdvantageConfig,
) -> Float[Array, ' E']:
  """(values - mean) [/ (std + eps)] with per-group statistics over the valid entries.

  E is B (one value per row) or B x T (one per token, rows leading so the sharding is kept).
  """
  mean, std, count = group_stats(
    values, groups, valid, num_groups=num_groups, mesh=mesh, ddof=config.std_ddof
  )
  adv = values - mean
  if config.estimator in ('reinforce_pp', 'grpo'):
    adv = adv / (std + config.eps)
  elif config.estimator == 'rloo':  # R - (n mean - R) / (n - 1) = n / (n - 1) (R - mean)
    adv = jnp.where(count > 1, adv * count / jnp.maximum(count - 1, 1), 0.0)
  return jnp.where(valid, adv, 0.0)


def row_advantages(
  batch: Batch, *, mesh: Mesh, num_groups: int, config: AdvantageConfig
) -> Float[Array, ' B']:
  """Per-row advantages from the episode returns (0 for invalid rows)."""
  grouped = config.estimator in GROUPED
  groups = batch.group_ids if grouped else jnp.zeros_like(batch.group_ids)
  return _normalise(
    batch.rewards,
    groups,
    batch.valid,
    mesh=mesh,
    num_groups=num_groups if grouped else 1,
    config=config,
  )


def token_advantages(
  batch: Batch, *, mesh: Mesh, num_groups: int, config: AdvantageConfig
) -> Float[Array, 'B T']:
  """Per-token advantages from each turn's reward-to-go (0 off the generated tokens).

  The statistics run over every generated token of the group (or batch), with the same
  collective group statistics as the rows: [B, T] is viewed as B*T entries whose leading
  dimension keeps the rows' sharding.
  """
  B, T = batch.returns.shape
  grouped = config.estimator in GROUPED
  groups = batch.group_ids if grouped else jnp.zeros_like(batch.group_ids)
  flat = _normalise(
    batch.returns.reshape(B * T),
    jnp.repeat(groups, T),
    (batch.loss_mask & batch.valid[:, None]).reshape(B * T),
    mesh=mesh,
    num_groups=num_groups if grouped else 1,
    config=config,
  )
  return flat.reshape(B, T)


def with_advantages(batch: Batch, *, mesh: Mesh, num_groups: int, config: AdvantageConfig) -> Batch:
  """The batch with `advantages` filled on every generated token."""
  if config.credit == 'turn':
    tokens = token_advantages(batch, mesh=mesh, num_groups=num_groups, config=config)
  else:
    adv = row_advantages(batch, mesh=mesh, num_groups=num_groups, config=config)
    tokens = jnp.where(batch.loss_mask, adv[:, None], 0.0)
  return batch.replace(advantages=rules.constrain(tokens.astype(jnp.float32), ('batch', 'seq')))


def advantage_fn(mesh: Mesh, num_groups: int, config: AdvantageConfig):
  """`with_advantages` jitted for one mesh (call it under `jax.set_mesh(mesh)`); the caller keeps
  it for as long as it uses the mesh (the trainer holds one per train layout)."""
  # Not donated: fields of a batch may share buffers (old and reference log-probs, when there is
  # no reference model), and the batch is small next to the model.
  return jax.jit(
    functools.partial(with_advantages, mesh=mesh, num_groups=num_groups, config=config)
  )
