"""PPO-clip and KL against direct numpy formulas."""

import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.rl import losses
from earl_jax.testing.typecheck import unchecked


def _inputs(seed=0):
  rng = np.random.RandomState(seed)
  logp = -rng.rand(3, 6).astype(np.float32)
  old = logp + 0.3 * rng.randn(3, 6).astype(np.float32)
  ref = logp + 0.2 * rng.randn(3, 6).astype(np.float32)
  adv = rng.randn(3, 6).astype(np.float32)
  mask = rng.rand(3, 6) < 0.7
  mask[2] = False  # a row with no generated tokens
  return logp, old, ref, adv, mask


@pytest.mark.parametrize('aggregation', ['token', 'sequence'])
def test_ppo_loss_matches_numpy(aggregation):
  logp, old, ref, adv, mask = _inputs()
  config = losses.LossConfig(clip_eps=0.2, kl_coef=0.1, aggregation=aggregation)
  loss, m = losses.ppo_loss(*map(jnp.asarray, (logp, old, ref, adv, mask)), config)
  ratio = np.exp(logp - old)
  surr = np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv)
  r = ref - logp
  kl = np.exp(r) - r - 1
  if aggregation == 'token':
    agg = lambda v: (v * mask).sum() / mask.sum()  # noqa: E731
  else:
    agg = lambda v: np.mean([(v[i] * mask[i]).sum() / mask[i].sum() for i in range(2)])  # noqa: E731
  np.testing.assert_allclose(float(loss), -agg(surr) + 0.1 * agg(kl), rtol=1e-5)
  np.testing.assert_allclose(float(m['kl_ref']), agg(kl), rtol=1e-5)
  clipped = (np.abs(ratio - np.clip(ratio, 0.8, 1.2)) > 0) & mask
  np.testing.assert_allclose(float(m['clip_frac']), clipped.sum() / mask.sum(), rtol=1e-6)


@pytest.mark.parametrize('aggregation', ['token', 'sequence'])
def test_entropy_bonus_is_subtracted(aggregation):
  logp, old, ref, adv, mask = _inputs(1)
  entropy = np.random.RandomState(2).rand(3, 6).astype(np.float32)
  args = tuple(map(jnp.asarray, (logp, old, ref, adv, mask)))
  base_loss, _ = losses.ppo_loss(*args, losses.LossConfig(aggregation=aggregation))
  config = losses.LossConfig(entropy_coef=0.05, aggregation=aggregation)
  loss, m = losses.ppo_loss(*args, config, entropy=jnp.asarray(entropy))
  agg = float(losses.aggregate(jnp.asarray(entropy), jnp.asarray(mask), aggregation))
  if aggregation == 'token':
    np.testing.assert_allclose(agg, (entropy * mask).sum() / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(float(m['entropy']), agg, rtol=1e-6)
  np.testing.assert_allclose(float(loss), float(base_loss) - 0.05 * agg, rtol=1e-5)
  with pytest.raises(ValueError, match='entropy_coef > 0 needs the per-token entropy'):
    losses.ppo_loss(*args, config)


@pytest.mark.parametrize('aggregation', ['token', 'sequence'])
def test_unlikelihood_of_negative_advantage_tokens_matches_numpy(aggregation):
  logp, old, ref, adv, mask = _inputs(3)
  args = tuple(map(jnp.asarray, (logp, old, ref, adv, mask)))
  base_loss, _ = losses.ppo_loss(*args, losses.LossConfig(aggregation=aggregation))
  config = losses.LossConfig(unlikelihood_coef=0.5, aggregation=aggregation)
  loss, m = losses.ppo_loss(*args, config)
  term = np.maximum(-adv, 0.0) * -np.log(1.0 - np.exp(logp))
  if aggregation == 'token':
    want = (term * mask).sum() / mask.sum()
  else:
    want = np.mean([(term[i] * mask[i]).sum() / mask[i].sum() for i in range(2)])
  np.testing.assert_allclose(float(m['unlikelihood']), want, rtol=1e-5)
  np.testing.assert_allclose(float(loss), float(base_loss) + 0.5 * want, rtol=1e-5)


@pytest.mark.parametrize('aggregation', ['token', 'sequence'])
def test_legal_move_loss_matches_numpy_on_the_replies_only(aggregation):
  """-log p(legal) at generated tokens that start a reply, 0 at the other generated tokens,
  aggregated over all of them; 1 - p(legal) averaged over the replies with an illegal move."""
  rng = np.random.RandomState(4)
  _, _, _, _, mask = _inputs(4)
  legal_logp = np.log(rng.uniform(0.01, 0.99, (3, 6))).astype(np.float32)
  bits = rng.choice([0, 0, 127, 127, 0b1011111, 0b0000101], (3, 6)).astype(np.int32)
  legal_logp = np.where(bits > 0, legal_logp, 0.0).astype(np.float32)  # as token_stats gives
  value, m = losses.legal_move_loss(
    jnp.asarray(legal_logp), jnp.asarray(bits), jnp.asarray(mask), aggregation, 7
  )
  replies = mask & (bits > 0)
  term = np.where(replies, -legal_logp.astype(np.float64), 0.0)
  if aggregation == 'token':
    want = (term * mask).sum() / mask.sum()
  else:
    want = np.mean([(term[i] * mask[i]).sum() / mask[i].sum() for i in range(2)])
  some_illegal = replies & (bits != 127)
  assert some_illegal.any() and (replies & ~some_illegal).any() and (mask & ~replies).any()
  np.testing.assert_allclose(float(value), want, rtol=1e-5)
  np.testing.assert_allclose(float(m['legal_move_loss']), want, rtol=1e-5)
  want_prob = (1 - np.exp(legal_logp))[some_illegal].mean()
  np.testing.assert_allclose(float(m['illegal_move_prob']), want_prob, rtol=1e-5)
  np.testing.assert_allclose(
    float(m['illegal_move_frac']), some_illegal.sum() / mask.sum(), rtol=1e-6
  )


def test_unlikelihood_pushes_a_sure_bad_token_down_where_the_policy_gradient_vanishes():
  """A token at p = 0.999 with advantage -1: the policy gradient on its log-prob is -A x 1
  (on its logit, x (1 - p) ~ 0.001); the unlikelihood term's on the log-prob is -A x p / (1 - p),
  about 1000 times larger, and nothing for a token with a positive advantage."""
  import jax

  logp = jnp.log(jnp.asarray([[0.999, 0.999]]))
  adv = jnp.asarray([[-1.0, 1.0]])
  mask = jnp.ones((1, 2), bool)

  def grad(coef):
    config = losses.LossConfig(unlikelihood_coef=coef)
    return jax.grad(lambda lp: losses.ppo_loss(lp, logp, logp, adv, mask, config)[0])(logp)

  base, with_ul = grad(0.0), grad(1.0)
  np.testing.assert_allclose(float(base[0, 0]), 0.5, rtol=1e-5)  # -A / N tokens
  np.testing.assert_allclose(float(with_ul[0, 0] - base[0, 0]), 0.5 * 999.0, rtol=1e-2)
  assert float(with_ul[0, 1]) == float(base[0, 1])


def test_gradient_is_zero_outside_the_clip_region_for_positive_advantage():
  import jax

  old = jnp.zeros((1, 2))
  adv = jnp.ones((1, 2))
  mask = jnp.ones((1, 2), bool)
  config = losses.LossConfig(clip_eps=0.2)
  g = jax.grad(lambda lp: losses.ppo_loss(lp, old, old, adv, mask, config)[0])(
    jnp.asarray([[0.5, 0.0]])
  )
  assert float(g[0, 0]) == 0.0  # ratio e^0.5 > 1.2: clipped, no gradient
  assert float(g[0, 1]) < 0.0  # inside: pushes log-prob up


def test_kl_k3_is_nonnegative_and_zero_at_equality():
  lp = jnp.asarray([[-1.0, -2.0, -0.5]])
  assert float(jnp.abs(losses.kl_k3(lp, lp)).max()) == 0.0
  assert float(losses.kl_k3(lp, lp + jnp.asarray([[0.3, -0.7, 1.1]])).min()) > 0.0


def test_bad_config():
  with pytest.raises(ValueError, match='clip_eps must be in'):
    losses.LossConfig(clip_eps=1.5)
  with pytest.raises(ValueError, match='kl_coef must be >= 0'):
    losses.LossConfig(kl_coef=-1.0)
  with pytest.raises(ValueError, match=r'unlikelihood_coef must be >= 0, got -1\.0'):
    losses.LossConfig(unlikelihood_coef=-1.0)
  with pytest.raises(ValueError, match=r'entropy_coef must be >= 0, got -0\.1'):
    losses.LossConfig(entropy_coef=-0.1)
  with pytest.raises(ValueError, match=r'\[0\.0001, 0\.5\], which must hold entropy_coef'):
    losses.LossConfig(entropy_target=0.3)
  with pytest.raises(ValueError, match='must hold entropy_coef and be positive'):
    losses.LossConfig(entropy_coef=0.01, entropy_target=0.3, entropy_coef_min=0.0)
  with pytest.raises(ValueError, match='entropy_target must be > 0'):
    losses.LossConfig(entropy_coef=0.01, entropy_target=0.0)
  with pytest.raises(ValueError, match='entropy_adapt_rate must be > 0'):
    losses.LossConfig(entropy_coef=0.01, entropy_target=0.3, entropy_adapt_rate=0.0)


def test_adapt_entropy_coef():
  config = losses.LossConfig(entropy_coef=0.01, entropy_target=0.5, entropy_coef_max=0.05)
  coef = jnp.float32(0.01)
  up = float(losses.adapt_entropy_coef(coef, jnp.float32(0.1), config))
  down = float(losses.adapt_entropy_coef(coef, jnp.float32(1.5), config))
  np.testing.assert_allclose(up, 0.01 * np.exp(0.4), rtol=1e-6)
  np.testing.assert_allclose(down, 0.01 * np.exp(-1.0), rtol=1e-6)
  assert losses.adapt_entropy_coef(jnp.float32(0.04), jnp.float32(0.0), config) == np.float32(0.05)
  floor = losses.adapt_entropy_coef(jnp.float32(0.01), jnp.float32(30.0), config)
  assert floor == np.float32(config.entropy_coef_min)
  fixed = losses.LossConfig(entropy_coef=0.01)
  assert float(losses.adapt_entropy_coef(coef, jnp.float32(0.1), fixed)) == np.float32(0.01)


def test_unknown_aggregation_is_rejected_by_the_config_itself():
  # The tests' runtime type checker would reject the Literal first; production meets __post_init__.
  config = losses.LossConfig()
  object.__setattr__(config, 'aggregation', 'per_batch')
  with pytest.raises(ValueError, match=r"aggregation must be one of \('token', 'sequence'\)"):
    config.__post_init__()


def _episodes():
  """Three episodes: A (4 generated tokens) and B (2) packed side by side in row 0, C (3) alone
  in row 1; each episode's advantage constant over its tokens (as GRPO's and RLOO's are)."""
  rng = np.random.RandomState(3)
  segments = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0]], np.int32)
  mask = np.array(
    [[0, 1, 1, 1, 1, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0, 0, 0]], bool
  )  # each episode's first token is its prompt
  logp = np.where(mask, -rng.rand(2, 9), 0.0).astype(np.float32)
  old = np.where(mask, logp + 0.05 * rng.randn(2, 9), 0.0).astype(np.float32)
  adv = np.where(segments == 1, 0.7, -1.3).astype(np.float32)
  adv[1] = -0.4
  return logp, old, adv, mask, segments


def _gspo_reference(logp, old, adv, mask, segments, low, high):
  """-(1/N) sum_i n_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_i(logp - old)), episode by
  episode (a jnp function of logp, so that its gradient can be taken)."""
  total, n = 0.0, mask.sum()
  for row in range(mask.shape[0]):
    for seg in set(segments[row][mask[row]].tolist()):
      tokens = (segments[row] == seg) & mask[row]
      s = jnp.exp(jnp.mean((logp[row] - old[row])[tokens]))
      a = adv[row][tokens][0]
      total += tokens.sum() * jnp.minimum(s * a, jnp.clip(s, 1 - low, 1 + high) * a)
  return -total / n


@pytest.mark.parametrize('clip', [(0.2, 0.2), (0.004, 0.005)])
def test_gspo_per_episode_ratio_in_packed_rows_matches_the_reference(clip):
  """GSPO's loss and its gradient equal the per-episode objective's, with two episodes packed
  in one row; with tight clips some episodes' ratios are clipped (their tokens' gradient is 0)."""
  import jax

  logp, old, adv, mask, segments = _episodes()
  config = losses.LossConfig(ratio='sequence', clip_eps=clip[0], clip_eps_high=clip[1])

  def ours(lp):
    args = (lp, jnp.asarray(old), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask))
    return losses.ppo_loss(*args, config, segments=jnp.asarray(segments))

  (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logp))
  ref = lambda lp: _gspo_reference(lp, old, adv, mask, segments, *clip)  # noqa: E731
  np.testing.assert_allclose(loss, ref(jnp.asarray(logp)), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, jax.grad(ref)(jnp.asarray(logp)), rtol=1e-5, atol=1e-7)
  clipped = float(metrics['clip_frac'])
  assert (clipped > 0) == (clip[0] < 0.01), clipped
  # Token ratios give another loss: the ratio is the episode's, not the token's.
  token, _ = losses.ppo_loss(
    jnp.asarray(logp), jnp.asarray(old), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
    losses.LossConfig(clip_eps=clip[0], clip_eps_high=clip[1]),
  )  # fmt: skip
  assert abs(float(token) - float(loss)) > 1e-6


def test_gspo_packed_equals_unpacked_and_needs_segments():
  """The same three episodes one per row (unpacked) give the packed rows' loss and gradients."""
  import jax

  logp, old, adv, mask, segments = _episodes()
  rows = []  # (row, segment) of each episode -> its own row of 9 tokens
  for row, seg in ((0, 1), (0, 2), (1, 1)):
    keep = segments[row] == seg
    rows.append([np.where(keep, x[row], 0) for x in (logp, old, adv, mask)])
  u_logp, u_old, u_adv, u_mask = (np.stack([r[i] for r in rows]) for i in range(4))
  u_mask = u_mask.astype(bool)
  u_segments = np.ones_like(u_mask, np.int32)
  config = losses.LossConfig(ratio='sequence')

  def loss(lp, o, a, m, s):
    return losses.ppo_loss(lp, o, o, a, m, config, segments=s)[0]

  packed = jax.value_and_grad(loss)(*map(jnp.asarray, (logp, old, adv, mask, segments)))
  unpacked = jax.value_and_grad(loss)(*map(jnp.asarray, (u_logp, u_old, u_adv, u_mask, u_segments)))
  np.testing.assert_allclose(packed[0], unpacked[0], rtol=1e-6)
  for i, (row, seg) in enumerate(((0, 1), (0, 2), (1, 1))):
    keep = segments[row] == seg
    np.testing.assert_allclose(packed[1][row][keep], unpacked[1][i][keep], rtol=1e-6)
  with pytest.raises(ValueError, match="ratio='sequence' needs the tokens' segment ids"):
    losses.ppo_loss(*map(jnp.asarray, (logp, old, old, adv, mask)), config)
  with unchecked(), pytest.raises(ValueError, match=r"ratio must be one of \('token', 'seq"):
    losses.LossConfig(ratio='episode')
