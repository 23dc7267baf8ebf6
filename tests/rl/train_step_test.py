"""The policy update: the loss falls on a fixed batch, micro-batching is exact, bad steps are skipped."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from earl_jax.config import ModelConfig
from earl_jax.models import qwen2
from earl_jax.rl import losses, train_step
from earl_jax.rl.batch import Batch
from earl_jax.testing import small_mesh
from earl_jax.testing.typecheck import unchecked

CFG = ModelConfig.preset('tiny')


def _batch(rows=8, T=32, seed=0, mesh=None) -> Batch:
  rng = np.random.RandomState(seed)
  b = Batch.zeros(rows, T)
  lengths = rng.randint(T // 2, T + 1, rows)
  tokens = rng.randint(0, CFG.vocab_size, (rows, T)).astype(np.int32)
  mask = np.zeros((rows, T), bool)
  for r, n in enumerate(lengths):
    tokens[r, n:] = 0
    mask[r, 4:n] = rng.rand(n - 4) < 0.6
  b = b.replace(
    tokens=tokens,
    loss_mask=mask,
    advantages=np.where(mask, rng.randn(rows, 1), 0).astype(np.float32),
    lengths=lengths.astype(np.int32),
    valid=np.ones(rows, bool),
  )
  if mesh is not None:
    b = jax.device_put(b, Batch.shardings(mesh))
  return b


def _with_old_logprobs(graphdef, params, batch, mesh):
  from earl_jax.testing import logprob_fn

  with jax.set_mesh(mesh):
    lp = jax.jit(logprob_fn(graphdef))(params, batch.tokens)
  return batch.replace(old_logprobs=lp, ref_logprobs=lp)


def _run_steps(
  loss_config, n, *, seed, zero_advantages=False, edit=None, optim=None, params_seen=None, **step_kw
):
  """`n` AdamW updates (lr 3e-3, or `optim`) on one fixed batch (changed by `edit(batch)` when
  given); returns the final state and each step's metrics (and appends the parameters after
  each update to `params_seen` when given)."""
  mesh = small_mesh(dp=2, tp=2)
  graphdef, params = qwen2.init_model(CFG, mesh, seed=seed)
  batch = _batch()
  if edit is not None:
    batch = edit(batch)
  batch = jax.device_put(batch, Batch.shardings(mesh))
  if zero_advantages:
    batch = batch.replace(advantages=batch.advantages * 0)
  batch = _with_old_logprobs(graphdef, params, batch, mesh)
  opt = train_step.make_optimizer(optim or train_step.OptimConfig(learning_rate=3e-3))
  state = train_step.init_train_state(params, opt, entropy_coef=loss_config.entropy_coef)
  step = train_step.make_train_step(graphdef, opt, loss_config, **step_kw)
  seen = []
  with jax.set_mesh(mesh):
    for _ in range(n):
      state, m = step(state, batch)
      seen.append({k: float(v) for k, v in m.items()})
      if params_seen is not None:
        params_seen.append(jax.device_get(state.params))
  return state, seen


def test_loss_decreases_on_a_fixed_batch():
  state, seen = _run_steps(losses.LossConfig(kl_coef=0.01), 6, seed=0)
  losses_seen = [m['loss'] for m in seen]
  assert losses_seen[-1] < losses_seen[0] - 0.05, losses_seen
  assert int(state.step) == 6 and int(state.skipped) == 0
  # The moments are sharded like their parameters (not replicated).
  mu = state.opt_state[1][0].mu['layers'][0]['mlp']['up_proj'][...]
  up = state.params['layers'][0]['mlp']['up_proj'][...]
  assert mu.sharding.is_equivalent_to(up.sharding, 2)
  assert mu.addressable_data(0).shape == up.addressable_data(0).shape == (64, 96)


def test_entropy_bonus_raises_entropy_with_zero_advantages():
  """With no policy-gradient signal, the entropy term alone drives the update: entropy goes up."""
  _, seen = _run_steps(losses.LossConfig(entropy_coef=0.1), 4, seed=2, zero_advantages=True)
  entropies = [m['entropy'] for m in seen]
  assert entropies[-1] > entropies[0] + 1e-3, entropies
  # pg_loss is 0 with zero advantages, so the loss is exactly the entropy term.
  for m in seen:
    np.testing.assert_allclose(m['loss'], -0.1 * m['entropy'], rtol=1e-5, atol=1e-7)


MOVES = (3, 7, 8, 20, 41, 42, 50)


def _with_legal_moves(batch):
  """Every generated token starts a reply in which moves 0 and 2 are illegal; it plays move 1."""
  mask = np.asarray(batch.loss_mask)
  return batch.replace(
    tokens=np.where(mask, MOVES[1], batch.tokens).astype(np.int32),
    legal_moves=np.where(mask, 0b1111010, 0).astype(np.int32),
  )


def test_the_rules_term_raises_the_legal_moves_probability_with_no_policy_signal():
  """With zero advantages the loss is exactly coef x the rules' term, and the updates move the
  policy's probability onto the moves labelled legal."""
  config = losses.LossConfig(legal_move_coef=2.0)
  _, seen = _run_steps(
    config, 5, seed=4, zero_advantages=True, edit=_with_legal_moves, move_token_ids=MOVES
  )
  probs = [m['illegal_move_prob'] for m in seen]
  # A random tiny model gives the 5 legal move tokens ~5/V: each update moves more onto them.
  assert all(b < a for a, b in itertools.pairwise(probs)) and probs[-1] < probs[0] - 0.02, probs
  np.testing.assert_allclose(seen[0]['illegal_move_frac'], 1.0)
  for m in seen:
    np.testing.assert_allclose(m['loss'], 2.0 * m['legal_move_loss'], rtol=1e-5)
  with pytest.raises(ValueError, match='needs the move tokens'):
    _run_steps(config, 1, seed=4, edit=_with_legal_moves)


@pytest.mark.parametrize('target', [0.5, 8.0])
def test_adaptive_entropy_coefficient_follows_the_target(target):
  """Entropy below the target raises the coefficient, above it lowers it; the state carries it."""
  config = losses.LossConfig(entropy_coef=0.02, entropy_target=target, entropy_adapt_rate=0.5)
  state, seen = _run_steps(config, 3, seed=3)
  coefs = [m['entropy_coef'] for m in seen] + [float(state.entropy_coef)]
  np.testing.assert_allclose(coefs[0], 0.02, rtol=1e-6)
  for m, before, after in zip(seen, coefs, coefs[1:]):
    expected = before * np.exp(0.5 * (target - m['entropy']))
    bounded = np.clip(expected, config.entropy_coef_min, config.entropy_coef_max)
    np.testing.assert_allclose(after, bounded, rtol=1e-4)
  # A random tiny model's entropy is ~ln(V) = 4.85 nats: above 0.5, below 8.
  assert (coefs[-1] < 0.02) if target < 4 else (coefs[-1] > 0.02), coefs


@pytest.mark.parametrize('aggregation', ['token', 'sequence'])
def test_micro_batches_give_the_same_update(aggregation):
  mesh = small_mesh(dp=2, tp=1)
  graphdef, params = qwen2.init_model(CFG, mesh, seed=1)
  batch = _with_old_logprobs(graphdef, params, _batch(rows=8, mesh=mesh), mesh)
  # Plain SGD with lr 1 and no clipping: the parameter change *is* the gradient.
  opt = optax.sgd(1.0)
  config = losses.LossConfig(aggregation=aggregation)
  outs = []
  for micro in (1, 4):
    state = train_step.init_train_state(jax.tree.map(jnp.copy, params), opt)
    step = train_step.make_train_step(graphdef, opt, config, micro_batches=micro)
    with jax.set_mesh(mesh):
      state, m = step(state, batch)
    outs.append((state, m))
  (a, ma), (b, mb) = outs
  if aggregation == 'token':
    # Token aggregation is exact under micro-batching (weights by loss tokens).
    np.testing.assert_allclose(float(ma['loss']), float(mb['loss']), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
  else:
    # Sequence aggregation averages rows per micro-batch: equal when each micro-batch has rows.
    np.testing.assert_allclose(float(ma['loss']), float(mb['loss']), rtol=1e-5)


def test_non_finite_step_is_skipped_and_params_untouched():
  mesh = small_mesh(dp=2, tp=2)
  graphdef, params = qwen2.init_model(CFG, mesh, seed=2)
  batch = _with_old_logprobs(graphdef, params, _batch(mesh=mesh), mesh)
  bad = batch.replace(advantages=batch.advantages.at[0, 5].set(jnp.nan).at[0, 6].set(jnp.nan))
  bad = bad.replace(loss_mask=bad.loss_mask.at[0, 5].set(True))
  opt = train_step.make_optimizer(train_step.OptimConfig())
  config = losses.LossConfig(entropy_coef=0.01, entropy_target=0.5)
  state = train_step.init_train_state(params, opt, entropy_coef=0.01)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state, state.entropy_coef))
  step = train_step.make_train_step(graphdef, opt, config)
  with jax.set_mesh(mesh):
    state, m = step(state, bad)
  assert float(m['finite']) == 0.0
  assert int(state.skipped) == 1 and int(state.step) == 0
  after = (state.params, state.opt_state, state.entropy_coef)
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(x, np.asarray(y))
  with jax.set_mesh(mesh):
    state, m = step(state, batch)
  assert float(m['finite']) == 1.0 and int(state.step) == 1 and int(state.skipped) == 1


def test_an_update_that_overflows_the_params_is_skipped():
  """Finite loss and gradients, but an update that makes the parameters inf: the step is skipped
  and the parameters and moments stay as they were."""
  mesh = small_mesh(dp=2, tp=2)
  graphdef, params = qwen2.init_model(CFG, mesh, seed=3)
  batch = _with_old_logprobs(graphdef, params, _batch(mesh=mesh), mesh)
  overflowing = optax.chain(optax.adam(1e-3), optax.scale(3e38), optax.scale(3e38))
  state = train_step.init_train_state(params, overflowing)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  step = train_step.make_train_step(graphdef, overflowing, losses.LossConfig())
  with jax.set_mesh(mesh):
    state, m = step(state, batch)
  assert np.isfinite(float(m['loss'])) and np.isfinite(float(m['grad_norm']))
  assert float(m['finite']) == 0.0 and int(state.skipped) == 1 and int(state.step) == 0
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
    np.testing.assert_array_equal(x, np.asarray(y))


@pytest.mark.parametrize('rate', [float('inf'), float('nan'), 1e39, -float('inf')])
def test_a_non_finite_learning_rate_is_refused(rate):
  with pytest.raises(ValueError, match=r'learning_rate must be a finite number .*, got'):
    train_step.OptimConfig(learning_rate=rate)


@pytest.mark.parametrize(
  ('kwargs', 'expected'),
  [
    # (update count, learning rate) pairs.
    ({'decay_steps': 100}, [(0, 1.0), (50, 0.5), (100, 0.0), (300, 0.0)]),
    (
      {'warmup_steps': 10, 'decay_steps': 100, 'end_lr_fraction': 0.2},
      [(0, 0.0), (5, 0.5), (10, 1.0), (60, 0.6), (110, 0.2), (500, 0.2)],
    ),
    (
      {'decay_steps': 100, 'schedule': 'linear', 'end_lr_fraction': 0.1},
      [(0, 1.0), (25, 0.775), (100, 0.1), (200, 0.1)],
    ),
    ({'warmup_steps': 4}, [(0, 0.0), (2, 0.5), (4, 1.0), (1000, 1.0)]),
    (  # warmup-stable-decay: 4 up, 40 at the peak, 20 down to 0
      {'warmup_steps': 4, 'hold_steps': 40, 'decay_steps': 20, 'schedule': 'linear'},
      [(2, 0.5), (4, 1.0), (30, 1.0), (44, 1.0), (54, 0.5), (64, 0.0), (100, 0.0)],
    ),
    ({'hold_steps': 40, 'decay_steps': 20}, [(0, 1.0), (39, 1.0), (50, 0.5), (60, 0.0)]),
  ],
)
def test_learning_rate_schedule(kwargs, expected):
  schedule = train_step.learning_rate_schedule(train_step.OptimConfig(learning_rate=1.0, **kwargs))
  for count, lr in expected:
    np.testing.assert_allclose(float(schedule(count)), lr, atol=1e-6, err_msg=f'update {count}')


def test_decayed_rate_shrinks_the_updates():
  """The optimizer applies the schedule: the same gradient moves the params less once decayed."""
  params = {'w': jnp.zeros(3)}
  grads = {'w': jnp.array([1.0, -2.0, 0.5])}
  opt = train_step.make_optimizer(
    train_step.OptimConfig(learning_rate=0.1, decay_steps=4, schedule='linear')
  )
  state = opt.init(params)
  sizes = []
  for _ in range(5):
    updates, state = opt.update(grads, state, params)
    sizes.append(float(jnp.max(jnp.abs(updates['w']))))
  np.testing.assert_allclose(sizes, [0.1, 0.075, 0.05, 0.025, 0.0], atol=1e-6)
  # A constant rate keeps the plain float (no schedule counter in the optimizer state).
  assert train_step.learning_rate_schedule(train_step.OptimConfig(learning_rate=0.1)) == 0.1


@pytest.mark.parametrize(
  ('kwargs', 'message'),
  [
    ({'decay_steps': -1}, 'decay_steps must be an int >= 0, got -1'),
    ({'hold_steps': -1, 'decay_steps': 4}, 'hold_steps must be an int >= 0, got -1'),
    ({'hold_steps': 40}, r'hold_steps=40 holds the peak rate before a decay, but decay_steps=0'),
    ({'schedule': 'step'}, "schedule='step' is unknown"),
    ({'end_lr_fraction': 1.5}, r'end_lr_fraction must be in \[0, 1\], got 1.5'),
  ],
)
def test_bad_schedule_is_refused(kwargs, message):
  with unchecked(), pytest.raises(ValueError, match=message):
    train_step.OptimConfig(**kwargs)


def test_the_kl_adaptive_rate_follows_the_measured_kl_within_its_range():
  """rl_games' rule on the scaled updates: a measured KL over twice the target divides the
  multiple by the factor, one under half the target multiplies it, within the range; an
  unmeasured KL (a batch's first update) or one within the band leaves it."""
  rate = train_step.kl_adaptive_rate(0.01, 1.5, 0.25, 2.0)
  params = {'w': jnp.zeros(2)}
  state = rate.init(params)
  steps = [  # (KL, measured) -> the multiple the update uses
    ((0.5, False), 1.0),
    ((0.5, True), 1 / 1.5),
    ((0.5, True), 1 / 1.5**2),
    ((0.5, True), 1 / 1.5**3),
    ((0.5, True), 0.25),  # the floor
    ((0.01, True), 0.25),  # within [target / 2, 2 * target]
    ((0.001, True), 0.375),
    ((0.001, False), 0.375),
    ((0.001, True), 0.5625),
  ]
  for (kl, measured), want in steps:
    updates, state = rate.update(
      {'w': jnp.array([1.0, -2.0])},
      state,
      params,
      approx_kl_old=jnp.float32(kl),
      kl_measured=jnp.bool_(measured),
    )
    np.testing.assert_allclose(updates['w'], [want, -2 * want], rtol=1e-6, err_msg=str((kl, want)))
    assert float(train_step.rate_scale(state)) == pytest.approx(want, rel=1e-6)
  for _ in range(4):
    _, state = rate.update(
      {'w': jnp.ones(2)}, state, params, approx_kl_old=jnp.float32(0.0), kl_measured=True
    )
  assert float(train_step.rate_scale(state)) == 2.0  # the ceiling
  with pytest.raises(ValueError, match='needs approx_kl_old= and kl_measured='):
    rate.update({'w': jnp.ones(2)}, state, params)


@pytest.mark.parametrize(('target', 'factor'), [(1e-9, 1 / 1.5), (10.0, 1.5)])
def test_the_train_step_adapts_its_rate_on_a_batchs_later_updates(target, factor):
  """Two updates a batch, twice (on one fixed batch): the second update of each pair reads the first's move
  (KL above a 1e-9 target, below a target of 10) and scales itself and what follows; a batch's
  first update never adapts. The parameters move by exactly the multiple times the plain
  optimizer's update."""
  loss_config = losses.LossConfig()
  kw = {'seed': 4, 'update_epochs': 2}
  plain, adaptive = [], []
  _run_steps(loss_config, 4, params_seen=plain, **kw)
  optim = train_step.OptimConfig(learning_rate=3e-3, kl_target=target, kl_rate_range=(0.1, 4.0))
  state, seen = _run_steps(loss_config, 4, optim=optim, params_seen=adaptive, **kw)
  scales = [m['rate_scale'] for m in seen]
  np.testing.assert_allclose(scales, [1.0, factor, factor, factor**2], rtol=1e-6)
  assert 2e-9 < seen[1]['approx_kl_old'] < 5.0  # measured: above 2 x 1e-9, below 10 / 2
  assert float(train_step.rate_scale(state.opt_state)) == pytest.approx(factor**2, rel=1e-6)
  # Update 1 is the plain one; update 2 is the plain update 2 (same state before it) scaled.
  first = lambda p: np.asarray(p['layers'][0]['mlp']['up_proj'][...])  # noqa: E731
  np.testing.assert_array_equal(first(adaptive[0]), first(plain[0]))
  np.testing.assert_allclose(
    first(adaptive[1]) - first(adaptive[0]),
    factor * (first(plain[1]) - first(plain[0])),
    rtol=1e-4,
    atol=1e-8,
  )


@pytest.mark.parametrize(
  ('kwargs', 'message'),
  [
    ({'kl_target': -0.1}, r'kl_target must be >= 0 \(0: off\), got -0.1'),
    ({'kl_rate_factor': 1.0}, 'kl_rate_factor must be > 1, got 1.0'),
    ({'kl_rate_range': (0.5, 0.8)}, r'kl_rate_range=\(0.5, 0.8\): expected \(lowest, highest\)'),
    ({'kl_rate_range': (0.0, 1.0)}, r'kl_rate_range=\(0.0, 1.0\)'),
  ],
)
def test_a_bad_kl_adaptive_rate_is_refused(kwargs, message):
  with unchecked(), pytest.raises(ValueError, match=message):
    train_step.OptimConfig(**kwargs)


def test_a_context_parallel_layout_takes_the_same_steps():
  """Two PPO updates on dp2.cp4 (each row's tokens over a ring of 4 devices) and on dp8: the
  same losses, gradient norms and entropy, within f32 summation order."""
  results = []
  for mesh in (small_mesh(dp=8), small_mesh(dp=2, cp=4)):
    graphdef, params = qwen2.init_model(CFG, mesh, seed=3)
    batch = _with_old_logprobs(graphdef, params, _batch(mesh=mesh), mesh)
    opt = train_step.make_optimizer(train_step.OptimConfig(learning_rate=3e-3))
    state = train_step.init_train_state(params, opt, entropy_coef=0.01)
    step = train_step.make_train_step(graphdef, opt, losses.LossConfig(entropy_coef=0.01))
    with jax.set_mesh(mesh):
      state, first = step(state, batch)
      state, second = step(state, batch)
    results.append(([first, second], batch.tokens.sharding))
  (dp8, _), (cp4, split) = results
  assert split.spec[1] == 'context' and split.shard_shape((8, 32))[1] == 32 // 4
  for a, b in zip(dp8, cp4):
    for key in ('loss', 'grad_norm', 'entropy'):
      assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5, abs=1e-6), key
