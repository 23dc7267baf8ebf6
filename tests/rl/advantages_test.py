"""Advantages from collective group statistics match a dense numpy reference."""

import jax
import numpy as np
import pytest

from earl_jax.rl import advantages
from earl_jax.rl.batch import Batch
from earl_jax.testing import small_mesh
from earl_jax.testing.typecheck import unchecked


def _batch(rows=16, T=8, G=4, seed=0):
  """Rows in G groups of rows / G, the last three padding (so the last group has one valid
  row: alone in its group)."""
  rng = np.random.RandomState(seed)
  b = Batch.zeros(rows, T)
  valid = np.arange(rows) < rows - 3  # three padding rows
  mask = rng.rand(rows, T) < 0.5
  mask[~valid] = False
  return b.replace(
    rewards=np.where(valid, rng.randn(rows), 0).astype(np.float32),
    group_ids=np.where(valid, np.arange(rows) // (rows // G), 0).astype(np.int32),
    valid=valid,
    loss_mask=mask,
  )


def _reference(b, estimator, eps):
  """Each estimator from its definition, row by row (rloo: the mean of the group's others)."""
  r, g, v = b.rewards, b.group_ids, b.valid
  out = np.zeros_like(r)
  keys = g if estimator in ('grpo', 'dr_grpo', 'rloo') else np.zeros_like(g)
  for i in np.flatnonzero(v):
    group = v & (keys == keys[i])
    mean, std = r[group].mean(), r[group].std()
    others = group & (np.arange(len(r)) != i)
    out[i] = {
      'reinforce': r[i] - mean,
      'reinforce_pp': (r[i] - mean) / (std + eps),
      'grpo': (r[i] - mean) / (std + eps),
      'dr_grpo': r[i] - mean,
      'rloo': r[i] - r[others].mean() if others.any() else 0.0,
    }[estimator]
  return out


@pytest.mark.parametrize('estimator', advantages.ESTIMATORS)
@pytest.mark.parametrize('dp,fsdp,tp', [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_matches_dense_reference(estimator, dp, fsdp, tp):
  mesh = small_mesh(dp=dp, fsdp=fsdp, tp=tp)
  host = _batch()
  config = advantages.AdvantageConfig(estimator=estimator)
  batch = jax.device_put(host, Batch.shardings(mesh))
  with jax.set_mesh(mesh):
    out = advantages.advantage_fn(mesh, 4, config)(batch)
  expected = _reference(host, estimator, config.eps)
  np.testing.assert_allclose(
    np.asarray(out.advantages), np.where(host.loss_mask, expected[:, None], 0), atol=1e-5
  )
  assert out.advantages.sharding.is_equivalent_to(Batch.shardings(mesh).advantages, 2)


def test_grpo_advantages_have_zero_mean_per_group():
  mesh = small_mesh(dp=4, tp=2)
  host = _batch(seed=1)
  batch = jax.device_put(host, Batch.shardings(mesh))
  with jax.set_mesh(mesh):
    adv = advantages.row_advantages(
      batch, mesh=mesh, num_groups=4, config=advantages.AdvantageConfig(estimator='grpo')
    )
  adv = np.asarray(adv)
  for k in range(4):
    sel = host.valid & (host.group_ids == k)
    assert abs(adv[sel].mean()) < 1e-5
  assert (adv[~host.valid] == 0).all()


def test_move_credit_is_known_and_needs_turn_credit():
  with unchecked(), pytest.raises(ValueError, match=r"move_credit='own' is unknown"):
    advantages.AdvantageConfig(credit='turn', move_credit='own')
  with pytest.raises(ValueError, match=r"'own_turn' .* needs credit='turn', got credit='episode'"):
    advantages.AdvantageConfig(move_credit='own_turn')
  assert advantages.AdvantageConfig(credit='turn', move_credit='own_turn').gamma == 1.0


def test_unknown_estimator_and_rloo_without_episode_credit():
  with unchecked(), pytest.raises(ValueError, match=r"estimator='ppo' is unknown"):
    advantages.AdvantageConfig(estimator='ppo')
  with pytest.raises(ValueError, match=r"'rloo' .* needs credit='episode', got credit='turn'"):
    advantages.AdvantageConfig(estimator='rloo', credit='turn')
  with pytest.raises(ValueError, match=r'std_ddof=2: expected 0 \(the population std\) or 1'):
    advantages.AdvantageConfig(estimator='grpo', std_ddof=2)


@pytest.mark.parametrize('estimator', [e for e in advantages.ESTIMATORS if e != 'rloo'])
def test_turn_credit_matches_dense_reference_over_tokens(estimator):
  mesh = small_mesh(dp=4, tp=2)
  host = _batch(seed=2)
  rng = np.random.RandomState(3)
  host = host.replace(returns=np.where(host.loss_mask, rng.randn(16, 8), 0).astype(np.float32))
  config = advantages.AdvantageConfig(estimator=estimator, credit='turn')
  batch = jax.device_put(host, Batch.shardings(mesh))
  with jax.set_mesh(mesh):
    out = np.asarray(advantages.advantage_fn(mesh, 4, config)(batch).advantages)
  m = host.loss_mask & host.valid[:, None]
  grouped = estimator in advantages.GROUPED
  keys = np.repeat(host.group_ids if grouped else np.zeros(16, int), 8).reshape(16, 8)
  expected = np.zeros((16, 8), np.float32)
  for k in np.unique(keys[m]):
    sel = m & (keys == k)
    v = host.returns[sel]
    centred = estimator in ('reinforce', 'dr_grpo')
    expected[sel] = v - v.mean() if centred else (v - v.mean()) / (v.std() + 1e-6)
  np.testing.assert_allclose(out, expected, atol=1e-5)
