"""The policy update: AdamW with gradient clipping, micro-batched, jitted per (config, bucket).

  optimizer = train_step.make_optimizer(OptimConfig(learning_rate=3e-4))
  state = train_step.init_train_state(params, optimizer)            # opt state sharded like params
  step = train_step.make_train_step(graphdef, optimizer, LossConfig(), micro_batches=2)
  with jax.set_mesh(mesh):
    state, metrics = step(state, batch)                               # donates `state`

A step whose loss, gradients, or updated parameters and moments are not all finite is skipped:
parameters and optimizer state are kept exactly as they were, and `state.skipped` counts it.
"""

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from earl_jax.config import check_float32
from earl_jax.errors import ConfigError
from earl_jax.models import qwen2
from earl_jax.rl import losses
from earl_jax.rl.batch import Batch
from earl_jax.sharding import mesh as mesh_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """AdamW with global-norm clipping and a learning-rate schedule.

  Attributes:
    learning_rate: the peak learning rate.
    warmup_steps: linear warm-up from 0 over this many updates.
    hold_steps: updates at the peak rate between warm-up and decay (a warmup-stable-decay
      schedule, as MiniCPM's: the policy learns at full rate, then the decay settles what it
      learned); 0 starts the decay right after warm-up.
    decay_steps: 0 keeps the rate constant after warm-up; otherwise it decays to
      `end_lr_fraction * learning_rate` over this many updates after warm-up and hold
      (`schedule`), then stays there. PPO anneals its rate this way: late in a run, when the policy is sharp, a full
      Adam step can tip it into a deterministic policy whose gradient vanishes. Counted in
      optimizer updates (`ExperimentConfig.update_epochs` of them per step).
    schedule: the decay's shape, 'cosine' or 'linear'.
    end_lr_fraction: where the decay ends, as a fraction of the peak, in [0, 1].
    weight_decay, b1, b2, eps: AdamW's.
    grad_clip: the global gradient norm is clipped to this.
    kl_target: adapt the rate to how far each update moves the policy, as rl_games' adaptive
      schedule does (`kl_adaptive_rate`): where the KL from the sampler to the updated policy
      exceeds twice this, the rate is divided by `kl_rate_factor`; below half of it, multiplied
      by it. The KL of an update is read by the next update's forward on the same batch, so
      this needs `ExperimentConfig.update_epochs >= 2`. 0: off (the schedule alone).
    kl_rate_factor: the adaptive rate's step, > 1.
    kl_rate_range: (lowest, highest) multiple of the schedule's rate the adaptive rate reaches;
      it starts at 1, so lowest <= 1 <= highest.
  """

  learning_rate: float = 1e-4
  warmup_steps: int = 0
  hold_steps: int = 0
  decay_steps: int = 0
  schedule: typing.Literal['cosine', 'linear'] = 'cosine'
  end_lr_fraction: float = 0.0
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  eps: float = 1e-8
  grad_clip: float = 1.0
  kl_target: float = 0.0
  kl_rate_factor: float = 1.5
  kl_rate_range: tuple[float, float] = (0.1, 1.0)

  def __post_init__(self):
    check_float32(
      self,
      'learning_rate',
      'end_lr_fraction',
      'weight_decay',
      'b1',
      'b2',
      'eps',
      'grad_clip',
      'kl_target',
      'kl_rate_factor',
    )
    if not self.learning_rate > 0:
      raise ConfigError(f'OptimConfig.learning_rate must be > 0, got {self.learning_rate}.')
    for name in ('b1', 'b2'):  # Adam's bias correction divides by 1 - beta**t
      if not 0 <= getattr(self, name) < 1:
        raise ConfigError(f'OptimConfig.{name} must be in [0, 1), got {getattr(self, name)}.')
    if not self.eps > 0:
      raise ConfigError(f'OptimConfig.eps must be > 0, got {self.eps}.')
    if self.warmup_steps < 0 or self.weight_decay < 0 or not self.grad_clip > 0:
      raise ConfigError(
        'OptimConfig: warmup_steps and weight_decay must be >= 0 and grad_clip > 0, got '
        f'{self.warmup_steps}, {self.weight_decay}, {self.grad_clip}.'
      )
    for name in ('hold_steps', 'decay_steps'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f'OptimConfig.{name} must be an int >= 0, got {value!r}.')
    if self.hold_steps and not self.decay_steps:
      raise ConfigError(
        f'OptimConfig.hold_steps={self.hold_steps} holds the peak rate before a decay, but '
        'decay_steps=0 (no decay): expected decay_steps > 0, or hold_steps=0.'
      )
    if self.schedule not in ('cosine', 'linear'):
      raise ConfigError(
        f"OptimConfig.schedule={self.schedule!r} is unknown; known values: ['cosine', 'linear']."
      )
    if not 0 <= self.end_lr_fraction <= 1:
      raise ConfigError(
        f'OptimConfig.end_lr_fraction must be in [0, 1], got {self.end_lr_fraction}.'
      )
    if not self.kl_target >= 0:
      raise ConfigError(f'OptimConfig.kl_target must be >= 0 (0: off), got {self.kl_target}.')
    if not self.kl_rate_factor > 1:
      raise ConfigError(f'OptimConfig.kl_rate_factor must be > 1, got {self.kl_rate_factor}.')
    low_high = self.kl_rate_range
    if not (
      isinstance(low_high, tuple)
      and len(low_high) == 2
      and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in low_high)
      and 0 < low_high[0] <= 1 <= low_high[1]
    ):
      raise ConfigError(
        f'OptimConfig.kl_rate_range={low_high!r}: expected (lowest, highest) multiples of the '
        'rate with 0 < lowest <= 1 <= highest, e.g. (0.1, 1.0).'
      )


def learning_rate_schedule(config: OptimConfig) -> optax.ScalarOrSchedule:
  """Warm-up, then constant, or held and decayed (see `OptimConfig`): a function of the
  update count, or the plain float when the rate is constant throughout."""
  peak, end = config.learning_rate, config.learning_rate * config.end_lr_fraction
  if not config.warmup_steps and not config.decay_steps:
    return peak
  pieces, boundaries = [], []
  if config.warmup_steps:
    pieces.append(optax.linear_schedule(0.0, peak, config.warmup_steps))
    boundaries.append(config.warmup_steps)
  if config.hold_steps:
    pieces.append(optax.constant_schedule(peak))
    boundaries.append(config.warmup_steps + config.hold_steps)
  if config.decay_steps:
    if config.schedule == 'cosine':
      decay = optax.cosine_decay_schedule(peak, config.decay_steps, alpha=config.end_lr_fraction)
    else:
      decay = optax.linear_schedule(peak, end, config.decay_steps)
    pieces.append(decay)
  else:
    pieces.append(optax.constant_schedule(peak))
  return optax.join_schedules(pieces, boundaries) if boundaries else pieces[0]


class KlRateState(NamedTuple):
  """`kl_adaptive_rate`'s state: the multiple of the scheduled rate the last update used, which
  the next one adapts."""

  rate_scale: Float[Array, '']


def kl_adaptive_rate(
  target: float, factor: float, low: float, high: float
) -> optax.GradientTransformationExtraArgs:
  """Scales the updates by a multiple of the rate that follows the policy's move (rl_games'
  `AdaptiveScheduler` and skrl's `KLAdaptiveLR`, on a multiple of the scheduled rate rather than
  on the rate itself).

  Its `update` takes two extra arguments: `approx_kl_old`, the loss's KL from the sampler to
  the current parameters on the batch, and `kl_measured`, whether that KL measures an update
  (false on a batch's first update, where the parameters are the sampler's). Where measured,
  a KL above `2 * target` divides the multiple by `factor` (down to `low`), one below
  `target / 2` multiplies it (up to `high`); the update then uses the new multiple.
  """

  def init_fn(params):
    del params
    return KlRateState(rate_scale=jnp.ones((), jnp.float32))

  def update_fn(updates, state, params=None, *, approx_kl_old=None, kl_measured=None, **extra):
    del params, extra
    if approx_kl_old is None or kl_measured is None:
      raise ValueError('kl_adaptive_rate needs approx_kl_old= and kl_measured= (train_step).')
    scale = state.rate_scale
    down = kl_measured & (approx_kl_old > 2.0 * target)
    up = kl_measured & (approx_kl_old < 0.5 * target)
    scale = jnp.where(down, jnp.maximum(scale / factor, low), scale)
    scale = jnp.where(up, jnp.minimum(scale * factor, high), scale)
    updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
    return updates, KlRateState(rate_scale=scale)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
  """Clipping, AdamW on the schedule's rate, and (with `kl_target`) the KL-adaptive multiple."""
  lr = learning_rate_schedule(config)
  parts = [
    optax.clip_by_global_norm(config.grad_clip),
    optax.adamw(lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay),
  ]
  if config.kl_target:
    low, high = config.kl_rate_range
    parts.append(kl_adaptive_rate(config.kl_target, config.kl_rate_factor, low, high))
  return optax.chain(*parts)


def rate_scale(opt_state: optax.OptState) -> Float[Array, ''] | None:
  """The KL-adaptive multiple of the rate in `opt_state`, or None where the optimizer has none."""
  return optax.tree_utils.tree_get(opt_state, 'rate_scale')


# Pytree container: its fields also hold shardings and ShapeDtypeStructs (for jit and AOT), so
# the shape annotations document it and the runtime checker skips it.
@typing.no_type_check
@flax.struct.dataclass
class TrainState:
  params: nnx.State
  opt_state: optax.OptState
  step: Int[Array, '']
  skipped: Int[Array, '']
  # The entropy bonus's coefficient: LossConfig.entropy_coef, adapted after every update when
  # LossConfig.entropy_target is set (checkpointed with the rest, so resume is exact).
  entropy_coef: Float[Array, '']


def abstract_train_state(
  abstract_params: nnx.State, optimizer: optax.GradientTransformation
) -> TrainState:
  """ShapeDtypeStructs with shardings of the train state, for AOT lowering (no allocation).

  The layout is stated, not left to XLA (which would replicate the moments): every optimizer
  moment is sharded like its parameter (`optax.tree_map_params`), and scalars such as the step
  counts are replicated on the parameters' mesh.
  """
  param_sh = jax.tree.map(lambda a: a.sharding, abstract_params)
  mesh = jax.tree.leaves(param_sh)[0].mesh
  rep = NamedSharding(mesh, PartitionSpec())
  opt_shapes = jax.eval_shape(optimizer.init, abstract_params)
  opt_sh = optax.tree_map_params(
    optimizer, lambda _, sh: sh, opt_shapes, param_sh, transform_non_params=lambda _: rep
  )
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  shapes = TrainState(
    params=abstract_params,
    opt_state=opt_shapes,
    step=scalar,
    skipped=scalar,
    entropy_coef=jax.ShapeDtypeStruct((), jnp.float32),
  )
  shardings = TrainState(params=param_sh, opt_state=opt_sh, step=rep, skipped=rep, entropy_coef=rep)
  return jax.tree.map(
    lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, shardings
  )


def init_train_state(
  params: nnx.State, optimizer: optax.GradientTransformation, *, entropy_coef: float = 0.0
) -> TrainState:
  """A fresh train state whose moments are sharded like their parameters (see above)."""
  abstract = abstract_train_state(mesh_lib.abstract_arrays(params), optimizer)
  shardings = jax.tree.map(lambda a: a.sharding, abstract)

  def init(params):
    return TrainState(
      params=params,
      opt_state=optimizer.init(params),
      step=jnp.zeros((), jnp.int32),
      skipped=jnp.zeros((), jnp.int32),
      entropy_coef=jnp.asarray(entropy_coef, jnp.float32),
    )

  return jax.jit(init, out_shardings=shardings)(params)


def loss_fn(
  params: nnx.State,
  graphdef: nnx.GraphDef,
  batch: Batch,
  config: losses.LossConfig,
  temperature: float = 1.0,
  entropy_coef: Float[Array, ''] | None = None,
  token_ids: tuple[int, ...] | None = None,
  packed: bool = False,
  move_token_ids: tuple[int, ...] | None = None,
) -> tuple[Float[Array, ''], dict]:
  """The PPO loss of `batch` (`losses.ppo_loss`), plus the rules' term
  (`losses.legal_move_loss`, with `config.legal_move_coef`; `move_token_ids`: the token of
  each of the environment's moves, in move order), and the metrics."""
  model = nnx.merge(graphdef, params)
  segments = (batch.segment_ids, batch.positions) if packed else None
  rules_term = bool(config.legal_move_coef)
  if rules_term and move_token_ids is None:
    raise ValueError('LossConfig.legal_move_coef > 0 needs the move tokens (move_token_ids).')
  stats = qwen2.token_stats(
    model,
    batch.tokens,
    temperature,
    token_ids,
    segments,
    entropy=config.uses_entropy,
    subset=(batch.legal_moves, move_token_ids) if rules_term else None,
  )
  logp, entropy = stats.logprobs, stats.entropy
  loss, metrics = losses.ppo_loss(
    logp,
    batch.old_logprobs,
    batch.ref_logprobs,
    batch.advantages,
    batch.loss_mask,
    config,
    entropy=entropy,
    entropy_coef=entropy_coef,
    segments=batch.segment_ids,
  )
  if rules_term:
    term, rules_metrics = losses.legal_move_loss(
      stats.subset_logprobs,
      batch.legal_moves,
      batch.loss_mask,
      config.aggregation,
      len(move_token_ids),
    )
    metrics.update(rules_metrics)
    loss = loss + config.legal_move_coef * term
  # The sampler's recorded log-probs against the experience forward's: ~0 unless the rollout and
  # the training forward disagree (numerics, a temperature mismatch, stale weights).
  weights = batch.loss_mask.astype(jnp.float32)
  gap = jnp.abs(batch.sample_logprobs - batch.old_logprobs) * weights
  metrics['sampler_logprob_gap'] = jnp.sum(gap) / jnp.maximum(jnp.sum(weights), 1.0)
  return loss, metrics


def _split_micro(batch: Batch, n: int) -> Batch:
  """[B, ...] -> [n, B / n, ...]: micro-batch i takes rows i, i + n, i + 2n, ...

  Strided rows keep every micro-batch spread over all data shards (no resharding).
  """
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)


def train_step(
  state: TrainState,
  batch: Batch,
  *,
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  loss_config: losses.LossConfig,
  micro_batches: int = 1,
  temperature: float = 1.0,
  token_ids: tuple[int, ...] | None = None,
  packed: bool = False,
  move_token_ids: tuple[int, ...] | None = None,
  update_epochs: int = 1,
) -> tuple[TrainState, dict[str, Float[Array, '']]]:
  """One optimizer update on `batch`, averaging gradients over `micro_batches` slices.

  The policy is softmax(logits / temperature) (over `token_ids` alone when given: constrained
  decoding), the distribution the rollout sampled from. `packed`: the rows hold several
  episodes each (`rl.packing`), attended within their segments. `move_token_ids`: the
  environment's move tokens, for the rules' term (`loss_fn`). `update_epochs`: the updates
  the caller makes on each batch, in a row; every update but a batch's first reads the
  previous one's move in its KL to the sampler (for `OptimConfig.kl_target`).
  """

  def grad_fn(micro_batch):
    fn = jax.value_and_grad(loss_fn, has_aux=True)
    return fn(
      state.params,
      graphdef,
      micro_batch,
      loss_config,
      temperature,
      state.entropy_coef,
      token_ids,
      packed,
      move_token_ids,
    )

  if micro_batches == 1:
    (loss, aux), grads = grad_fn(batch)
  else:
    loss, aux, grads = _accumulate_micro_batches(
      grad_fn, batch, micro_batches, loss_config.aggregation
    )

  # Calls so far (kept or skipped): the first of every `update_epochs` starts a batch.
  kl_measured = (state.step + state.skipped) % update_epochs != 0
  new_state, grad_norm, finite = apply_gradients(
    state, loss, grads, optimizer, approx_kl_old=aux['approx_kl_old'], kl_measured=kl_measured
  )
  if loss_config.uses_entropy:
    coef = state.entropy_coef
    adapted = losses.adapt_entropy_coef(coef, aux['entropy'], loss_config)
    new_state = new_state.replace(entropy_coef=jnp.where(finite, adapted, coef))
  metrics = {'loss': loss, 'grad_norm': grad_norm, 'finite': finite.astype(jnp.float32), **aux}
  if loss_config.uses_entropy:
    metrics['entropy_coef'] = state.entropy_coef
  scale = rate_scale(new_state.opt_state)
  if scale is not None:  # the multiple this update used (kept by the next one if skipped)
    metrics['rate_scale'] = scale
  return new_state, metrics


def apply_gradients(
  state: TrainState,
  loss: Float[Array, ''],
  grads: Any,
  optimizer: optax.GradientTransformation,
  **extra_args: Any,
) -> tuple[TrainState, Float[Array, ''], Bool[Array, '']]:
  """(the state after one optimizer update with `grads`, the gradients' global norm, whether the
  update was kept). `extra_args` go to the transforms that take them (`kl_adaptive_rate`).

  The update is kept only if the loss, the gradients and what the update made are all finite: a
  finite gradient times an overflowing rate would otherwise turn the parameters into inf / NaN.
  A skipped update leaves parameters and moments exactly as they were and counts in `skipped`;
  `entropy_coef` is passed on unchanged.
  """
  grad_norm = optax.tree.norm(grads)
  optimizer = optax.with_extra_args_support(optimizer)
  updates, new_opt = optimizer.update(grads, state.opt_state, state.params, **extra_args)
  new_params = optax.apply_updates(state.params, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite((new_params, new_opt))
  keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
  new_state = TrainState(
    params=jax.tree.map(keep, new_params, state.params),
    opt_state=jax.tree.map(keep, new_opt, state.opt_state),
    step=state.step + finite.astype(jnp.int32),
    skipped=state.skipped + (~finite).astype(jnp.int32),
    entropy_coef=state.entropy_coef,
  )
  return new_state, grad_norm, finite


def _accumulate_micro_batches(
  grad_fn: Callable[[Batch], Any], batch: Batch, micro_batches: int, aggregation: str
) -> tuple[Any, Any, Any]:
  """(loss, aux, grads) of the whole batch from `grad_fn` ((loss, aux), grads of one batch) on
  `micro_batches` strided slices, scanned one at a time."""
  micro = _split_micro(batch, micro_batches)
  # Weight each micro-batch by its share of what the aggregation averages over (loss tokens,
  # or rows that have any), so the accumulated gradient is exactly the full batch's.
  if aggregation == 'token':
    counts = jnp.sum(micro.loss_mask, axis=(1, 2))
  else:
    counts = jnp.sum(jnp.any(micro.loss_mask, axis=2), axis=1)
  counts = counts.astype(jnp.float32)
  weights = counts / jnp.maximum(jnp.sum(counts), 1.0)

  def body(acc, micro_batch_and_weight):
    micro_batch, weight = micro_batch_and_weight
    (loss, aux), grads = grad_fn(micro_batch)
    return jax.tree.map(lambda a, b: a + weight * b, acc, (loss, aux, grads)), None

  (loss0, aux0), grads0 = jax.eval_shape(grad_fn, jax.tree.map(lambda x: x[0], micro))
  acc0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss0, aux0, grads0))
  (loss, aux, grads), _ = jax.lax.scan(body, acc0, (micro, weights))
  return loss, aux, grads


def _all_finite(tree: Any) -> Bool[Array, '']:
  """Whether every floating-point element of `tree` is finite."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def make_train_step(
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  loss_config: losses.LossConfig,
  *,
  micro_batches: int = 1,
  temperature: float = 1.0,
  token_ids: tuple[int, ...] | None = None,
  packed: bool = False,
  move_token_ids: tuple[int, ...] | None = None,
  update_epochs: int = 1,
  state_shardings: TrainState | None = None,
  batch_shardings: Batch | None = None,
  metrics_sharding: jax.sharding.Sharding | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  """`train_step` jitted with the state donated (and explicit shardings when given).

  Call it under `jax.set_mesh(mesh)`; it compiles once per (mesh, batch shape).
  """
  fn = lambda state, batch: train_step(  # noqa: E731
    state,
    batch,
    graphdef=graphdef,
    optimizer=optimizer,
    loss_config=loss_config,
    micro_batches=micro_batches,
    temperature=temperature,
    token_ids=token_ids,
    packed=packed,
    move_token_ids=move_token_ids,
    update_epochs=update_epochs,
  )
  kwargs = {}
  if state_shardings is not None:
    kwargs['in_shardings'] = (state_shardings, batch_shardings)
    kwargs['out_shardings'] = (state_shardings, metrics_sharding)
  return jax.jit(fn, donate_argnums=(0,), **kwargs)
