"""Policy-gradient losses: PPO-clip against old log-probs, optional KL to a frozen reference.

All inputs are [B, T] token tables aligned with the tokens (see batch.Batch); `mask` marks
the generated positions that carry loss. Aggregation is 'token' (every generated token weighs the
same: sum over the batch / number of tokens) or 'sequence' (each row's tokens are averaged first,
then rows are averaged; long replies do not dominate).

The importance ratio PPO clips is per token (`ratio='token'`: PPO, GRPO, DAPO) or per episode
(`ratio='sequence'`: GSPO, Zheng et al. 2025): s_i = exp(mean over episode i's generated tokens
of log pi - log pi_old), the same for each of its tokens, in GSPO's token form
sg(s_i) x pi(y_t) / sg(pi(y_t)), so that a token's gradient is s_i x grad log pi(y_t). With
token aggregation its gradient is that of -(1/N) sum_i n_i min(s_i A_i, clip(s_i) A_i) (N
tokens, n_i episode i's). An episode is its segment (`segment_ids`) of a row, so packed rows
holding several episodes each get per-episode ratios.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from earl_jax.config import check_float32
from earl_jax.errors import ConfigError

Aggregation = Literal['token', 'sequence']
AGGREGATIONS = ('token', 'sequence')
Ratio = Literal['token', 'sequence']
RATIOS = ('token', 'sequence')


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """PPO-clip settings.

  Attributes:
    clip_eps: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high or clip_eps].
    clip_eps_high: optional asymmetric upper clip (DAPO's clip-higher); None = clip_eps.
    kl_coef: weight of the k3 KL estimate to the reference policy (0 disables it).
    entropy_coef: weight of an entropy bonus (the mean entropy of the policy's next-token
      distribution at generated positions is subtracted from the loss). It keeps a policy from
      collapsing onto one reply before it has learnt when that reply is wrong: once p(a) ~ 1 the
      policy gradient of a, (1 - p(a)), vanishes and a bad habit can no longer be unlearnt. 0
      disables it (and the train forward then skips the entropy). With `entropy_target` it is
      the starting value of an adapted coefficient.
    entropy_target: optional target entropy (nats per generated token, of the tempered policy).
      The coefficient then adapts after every update, as in adaptive entropy control:
      coef <- clip(coef * exp(entropy_adapt_rate * (target - entropy)), entropy_coef_min,
      entropy_coef_max), so the policy stays sharp enough to win but never collapses (needs
      entropy_coef > 0). The floor keeps the coefficient able to recover within a few steps
      after a long stretch above the target (an untrained policy starts far above it).
    entropy_adapt_rate: how fast the coefficient adapts (per nat of entropy error per step).
    entropy_coef_min, entropy_coef_max: the range the adapted coefficient stays in.
    unlikelihood_coef: weight of an unlikelihood term on the tokens with a negative advantage
      (Welleck et al. 2019's -log(1 - p) for a token to avoid, weighted here by -A): its
      gradient on the token's logit is -A x p(a), largest where the policy is sure of a reply
      that scored below the baseline, where the policy gradient's -A x (1 - p(a)) vanishes. 0
      disables it.
    legal_move_coef: weight of a supervised term from the environment's rules: at the first
      token of every reply, -log p(legal), p(legal) the probability the policy gives the moves
      that are legal there (`Batch.legal_moves`; `legal_move_loss`). A label at every reply,
      whatever was sampled, where the reward says only that the sampled move lost: the policy
      learns from the rules which moves the position forbids (a full column), rather than
      from the one sampled move, whose gradient vanishes once the policy is sure of it. With
      replies constrained to the moves (`RolloutConfig.reply_tokens`) it is -log(1 -
      p(illegal moves)), 0 where every move is legal; without, the reply's format counts too.
      Needs a board game whose replies are moves alone (`EnvConfig.parse='strict'`, no
      thinking): the term reads each reply's first token as its move. 0 disables it.
    aggregation: 'token' or 'sequence'.
    ratio: the importance ratio that is clipped: 'token' (each token's) or 'sequence' (GSPO:
      each episode's, the exp of its mean log-ratio; see the module docstring). GSPO's ratios
      stay far closer to 1 than a token's: its paper clips at clip_eps=3e-4,
      clip_eps_high=4e-4.
  """

  clip_eps: float = 0.2
  clip_eps_high: float | None = None
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  entropy_target: float | None = None
  entropy_adapt_rate: float = 1.0
  entropy_coef_min: float = 1e-4
  entropy_coef_max: float = 0.5
  unlikelihood_coef: float = 0.0
  legal_move_coef: float = 0.0
  aggregation: Aggregation = 'token'
  ratio: Ratio = 'token'

  def __post_init__(self):
    optional = [n for n in ('clip_eps_high', 'entropy_target') if getattr(self, n) is not None]
    check_float32(
      self,
      'clip_eps',
      'kl_coef',
      'entropy_coef',
      'entropy_adapt_rate',
      'entropy_coef_min',
      'entropy_coef_max',
      'unlikelihood_coef',
      'legal_move_coef',
      *optional,
    )
    if not 0 < self.clip_eps < 1:
      raise ConfigError(f'LossConfig.clip_eps must be in (0, 1), got {self.clip_eps}.')
    if self.clip_eps_high is not None and not self.clip_eps_high > 0:
      raise ConfigError(f'LossConfig.clip_eps_high must be > 0, got {self.clip_eps_high}.')
    if not self.kl_coef >= 0:
      raise ConfigError(f'LossConfig.kl_coef must be >= 0, got {self.kl_coef}.')
    if not self.unlikelihood_coef >= 0:
      raise ConfigError(f'LossConfig.unlikelihood_coef must be >= 0, got {self.unlikelihood_coef}.')
    if not self.legal_move_coef >= 0:
      raise ConfigError(f'LossConfig.legal_move_coef must be >= 0, got {self.legal_move_coef}.')
    if not self.entropy_coef >= 0:
      raise ConfigError(f'LossConfig.entropy_coef must be >= 0, got {self.entropy_coef}.')
    if self.entropy_target is not None:
      if not self.entropy_target > 0:
        raise ConfigError(f'LossConfig.entropy_target must be > 0, got {self.entropy_target}.')
      lo, hi = self.entropy_coef_min, self.entropy_coef_max
      if not 0 < lo <= self.entropy_coef <= hi:
        raise ConfigError(
          'LossConfig.entropy_target adapts entropy_coef multiplicatively within '
          f'[entropy_coef_min, entropy_coef_max] = [{lo}, {hi}], which must hold entropy_coef '
          f'and be positive; got entropy_coef={self.entropy_coef}.'
        )
      if not self.entropy_adapt_rate > 0:
        raise ConfigError(
          f'LossConfig.entropy_adapt_rate must be > 0, got {self.entropy_adapt_rate}.'
        )
    if self.aggregation not in AGGREGATIONS:
      raise ConfigError(
        f'LossConfig.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}.'
      )
    if self.ratio not in RATIOS:
      raise ConfigError(f'LossConfig.ratio must be one of {RATIOS}, got {self.ratio!r}.')

  @property
  def uses_entropy(self) -> bool:
    """Whether the train forward computes the policy's entropy."""
    return self.entropy_coef > 0


def legal_move_loss(
  legal_logp: Float[Array, 'B T'],
  legal_moves: Int[Array, 'B T'],
  mask: Bool[Array, 'B T'],
  aggregation: Aggregation,
  num_moves: int,
) -> tuple[Float[Array, ''], dict[str, Float[Array, '']]]:
  """The rules' term of `LossConfig.legal_move_coef` (to minimise), and its metrics.

  At each generated token t that starts a reply (legal_moves[t] != 0: the bits of the moves
  legal there, of `num_moves`), -log p_t, where log p_t = legal_logp[t] is the log-probability
  the policy gives those moves (`qwen2.token_stats`); 0 at the other generated tokens,
  aggregated over all of them like the policy loss. Metrics: `legal_move_loss`;
  `illegal_move_prob`, 1 - p_t averaged over the replies where some move is illegal (a full
  column: 1/7 of a uniform policy over Connect Four's moves, with one); and
  `illegal_move_frac`, the share of the generated tokens that start such a reply.
  """
  labelled = mask & (legal_moves != 0)
  per_token = jnp.where(labelled, -legal_logp, 0.0)
  value = aggregate(per_token, mask, aggregation)
  some_illegal = (labelled & (legal_moves != (1 << num_moves) - 1)).astype(jnp.float32)
  num_some = jnp.sum(some_illegal)
  illegal_prob = -jnp.expm1(jnp.where(labelled, legal_logp, 0.0))
  return value, {
    'legal_move_loss': value,
    'illegal_move_prob': jnp.sum(illegal_prob * some_illegal) / jnp.maximum(num_some, 1.0),
    'illegal_move_frac': num_some / jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0),
  }


def adapt_entropy_coef(
  coef: Float[Array, ''], entropy: Float[Array, ''], config: LossConfig
) -> Float[Array, '']:
  """The next entropy coefficient (unchanged without `config.entropy_target`)."""
  if config.entropy_target is None:
    return coef
  step = jnp.exp(config.entropy_adapt_rate * (config.entropy_target - entropy))
  return jnp.clip(coef * step, config.entropy_coef_min, config.entropy_coef_max)


def aggregate(
  values: Float[Array, 'B T'], mask: Bool[Array, 'B T'], aggregation: Aggregation
) -> Float[Array, '']:
  """Masked mean of per-token values, by token or by sequence."""
  weights = mask.astype(jnp.float32)
  if aggregation == 'token':
    return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  per_row = jnp.sum(values * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
  rows = (jnp.sum(weights, axis=1) > 0).astype(jnp.float32)
  return jnp.sum(per_row * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def segment_mean(
  values: Float[Array, 'B T'], mask: Bool[Array, 'B T'], segments: Int[Array, 'B T']
) -> Float[Array, 'B T']:
  """Per token: the mean of `values` over the masked tokens of its segment (the same row and
  segment id), 0 off the mask. Row by row (a vmap over B), so rows stay where they are."""
  T = values.shape[1]

  def row(v, m, s):
    w = m.astype(jnp.float32)
    sums = jax.ops.segment_sum(v * w, s, num_segments=T + 1)  # ids 0 (padding) .. T at most
    counts = jax.ops.segment_sum(w, s, num_segments=T + 1)
    return jnp.where(m, (sums / jnp.maximum(counts, 1.0))[s], 0.0)

  return jax.vmap(row)(values, mask, segments)


def kl_k3(logp: Float[Array, 'B T'], ref_logp: Float[Array, 'B T']) -> Float[Array, 'B T']:
  """Schulman's k3 estimator of KL(pi || ref) per token: exp(r) - r - 1 with r = ref - logp."""
  log_ratio = ref_logp - logp
  return jnp.exp(log_ratio) - log_ratio - 1.0


def ppo_loss(
  logp: Float[Array, 'B T'],
  old_logp: Float[Array, 'B T'],
  ref_logp: Float[Array, 'B T'],
  advantages: Float[Array, 'B T'],
  mask: Bool[Array, 'B T'],
  config: LossConfig,
  entropy: Float[Array, 'B T'] | None = None,
  entropy_coef: Float[Array, ''] | float | None = None,
  segments: Int[Array, 'B T'] | None = None,
) -> tuple[Float[Array, ''], dict[str, Float[Array, '']]]:
  """The clipped surrogate (to minimise) plus kl_coef * KL minus entropy_coef * entropy.

  `entropy` (the policy's next-token entropy per position) is needed when `entropy_coef` > 0.
  `entropy_coef` overrides `config.entropy_coef` (the adapted coefficient of the train state).
  `segments`: which episode of its row each token is (`Batch.segment_ids`), needed with
  `config.ratio='sequence'`.
  """
  log_ratio = jnp.where(mask, logp - old_logp, 0.0)
  if config.ratio == 'sequence':
    if segments is None:
      raise ValueError("LossConfig.ratio='sequence' needs the tokens' segment ids.")
    episode = jax.lax.stop_gradient(segment_mean(log_ratio, mask, segments))
    ratio = jnp.exp(jnp.where(mask, episode + logp - jax.lax.stop_gradient(logp), 0.0))
  else:
    ratio = jnp.exp(log_ratio)
  high = config.clip_eps_high if config.clip_eps_high is not None else config.clip_eps
  clipped = jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + high)
  surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
  pg_loss = -aggregate(surrogate, mask, config.aggregation)
  weights = mask.astype(jnp.float32)
  num_tokens = jnp.maximum(jnp.sum(weights), 1.0)
  metrics = {
    'pg_loss': pg_loss,
    'clip_frac': jnp.sum((jnp.abs(ratio - clipped) > 0) * weights) / num_tokens,
    'approx_kl_old': jnp.sum(0.5 * jnp.square(log_ratio) * weights) / num_tokens,
    'entropy_proxy': -jnp.sum(logp * weights) / num_tokens,
  }
  loss = pg_loss
  if config.kl_coef:  # without a KL term `ref_logp` is not a reference policy; report nothing
    kl = aggregate(kl_k3(logp, ref_logp), mask, config.aggregation)
    metrics['kl_ref'] = kl
    loss = pg_loss + config.kl_coef * kl
  if config.unlikelihood_coef:
    unlikely = -jnp.log(jnp.maximum(-jnp.expm1(logp), 1e-6))  # -log(1 - p), p = exp(logp)
    weighted = jnp.maximum(-advantages, 0.0) * unlikely
    metrics['unlikelihood'] = aggregate(weighted, mask, config.aggregation)
    loss = loss + config.unlikelihood_coef * metrics['unlikelihood']
  if entropy is not None:
    ent = aggregate(entropy, mask, config.aggregation)
    metrics['entropy'] = ent
    coef = config.entropy_coef if entropy_coef is None else entropy_coef
    loss = loss - jax.lax.stop_gradient(coef) * ent
  elif config.entropy_coef:
    raise ValueError('LossConfig.entropy_coef > 0 needs the per-token entropy.')
  return loss, metrics
