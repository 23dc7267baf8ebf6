"""Every advantage estimator and policy loss of the loop against verl's own functions.

tests/fixtures/rl_reference.json holds shared inputs and what verl 0.9.1's
`verl.trainer.ppo.core_algos` computes from them in float64 torch (made by
scripts/make_rl_reference.py in an environment of its own). Ours, in float32 JAX on 8 fake
devices, must agree within 1e-5: GRPO (with verl's sample std, `std_ddof=1`), Dr. GRPO, RLOO;
PPO-clip with clip-higher and GSPO's sequence ratio, under token and sequence aggregation,
loss and gradient with respect to the policy's log-probs; the k3 KL to the reference.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.rl import advantages, losses
from earl_jax.rl.batch import Batch
from earl_jax.testing import fixture_path, small_mesh

with open(fixture_path('rl_reference.json')) as _f:
  GOLDEN = json.load(_f)
DATA = {k: np.asarray(v) for k, v in GOLDEN['inputs'].items()}
MASK = DATA['mask'].astype(bool)
B, T = MASK.shape


def _advantages(estimator: str, **config) -> np.ndarray:
  """Our per-token advantages of the golden's rewards and groups, on a dp2.fsdp2.tp2 mesh."""
  mesh = small_mesh(dp=2, fsdp=2, tp=2)
  host = Batch.zeros(B, T).replace(
    rewards=DATA['rewards'].astype(np.float32),
    group_ids=DATA['groups'].astype(np.int32),
    valid=np.ones(B, bool),
    loss_mask=MASK,
  )
  cfg = advantages.AdvantageConfig(estimator=estimator, **config)
  batch = jax.device_put(host, Batch.shardings(mesh))
  with jax.set_mesh(mesh):
    out = advantages.advantage_fn(mesh, int(DATA['groups'].max()) + 1, cfg)(batch)
  return np.asarray(out.advantages)


@pytest.mark.parametrize('case', GOLDEN['advantages'], ids=lambda c: c['estimator'])
def test_advantages_match_verl(case):
  config = {'std_ddof': 1} if case['estimator'] == 'grpo' else {}
  ours = _advantages(case['estimator'], **config)
  np.testing.assert_allclose(ours, np.asarray(case['advantages']), atol=1e-5, rtol=1e-5)


def test_grpo_by_default_divides_by_the_population_std():
  """Our default GRPO divides by the group's population std (ddof 0); verl and TRL by the
  sample std: for groups of n the two differ by sqrt(n / (n - 1)) exactly (up to eps)."""
  verl = np.asarray(next(c for c in GOLDEN['advantages'] if c['estimator'] == 'grpo')['advantages'])
  ours = _advantages('grpo')
  n = 4
  flat = np.asarray(DATA['rewards']).reshape(-1, n).std(axis=1) < 1e-9  # the all-equal group
  rows = ~np.repeat(flat, n)
  np.testing.assert_allclose(ours[rows], verl[rows] * np.sqrt(n / (n - 1)), rtol=1e-4, atol=1e-5)
  assert not ours[~rows].any() and not verl[~rows].any()


def _loss(ratio: str, aggregation: str):
  config = losses.LossConfig(
    clip_eps=GOLDEN['clip_low'],
    clip_eps_high=GOLDEN['clip_high'],
    kl_coef=0.0,
    aggregation=aggregation,
    ratio=ratio,
  )
  adv = jnp.asarray(np.where(MASK, DATA['advantages'][:, None], 0.0), jnp.float32)
  old = jnp.asarray(DATA['old_logp'], jnp.float32)
  ref = jnp.asarray(DATA['ref_logp'], jnp.float32)
  segments = jnp.asarray(MASK.astype(np.int32))  # one episode a row

  def loss(logp):
    return losses.ppo_loss(logp, old, ref, adv, jnp.asarray(MASK), config, segments=segments)[0]

  return jax.value_and_grad(loss)(jnp.asarray(DATA['logp'], jnp.float32))


@pytest.mark.parametrize(
  'case', [c for c in GOLDEN['losses'] if 'loss' in c], ids=lambda c: c['verl']
)
def test_policy_losses_and_their_gradients_match_verl(case):
  value, grad = _loss(case['ratio'], case['aggregation'])
  np.testing.assert_allclose(float(value), case['loss'], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(case['grad_logp']), atol=1e-5, rtol=1e-5)


def test_the_k3_kl_matches_verl():
  case = next(c for c in GOLDEN['losses'] if 'kl' in c)
  ours = losses.kl_k3(
    jnp.asarray(DATA['logp'], jnp.float32), jnp.asarray(DATA['ref_logp'], jnp.float32)
  )
  np.testing.assert_allclose(np.asarray(ours), np.asarray(case['kl_per_token']), atol=1e-6)
