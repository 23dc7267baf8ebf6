"""Per-group reward statistics with collectives match a dense numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.dispatch import Layout, group_stats
from earl_jax.testing import dispatch_bodies as bodies


def _reference(rewards, groups, valid, num_groups, ddof):
  mean = np.zeros(num_groups)
  std = np.zeros(num_groups)
  count = np.zeros(num_groups)
  for g in range(num_groups):
    r = rewards[(groups == g) & valid].astype(np.float64)
    count[g] = len(r)
    if len(r):
      mean[g] = r.mean()
    if len(r) > ddof:
      std[g] = r.std(ddof=ddof)
  return mean[groups], std[groups], count[groups]


@pytest.mark.parametrize(
  ('layout_text', 'batch_axes'),
  [
    ('dp8', ('data', 'fsdp')),
    ('dp4.tp2', ('data', 'fsdp')),
    ('dp2.tp4:rows', ('data', 'fsdp', 'tensor')),
  ],
)
@pytest.mark.parametrize('ddof', [0, 1])
def test_group_stats_match_dense_reference(layout_text, batch_axes, ddof):
  rows, num_groups = 64, 6
  rng = np.random.default_rng(ddof)
  host = {
    'rewards': (rng.standard_normal(rows) * 3 + 1).astype(np.float32),
    'group_ids': rng.integers(0, num_groups, rows).astype(np.int32),
    'valid': rng.random(rows) > 0.2,
  }
  host['group_ids'][host['group_ids'] == 5] = 4  # group 5 is empty
  host['valid'][host['group_ids'] == 3] = False  # group 3 has only padding
  layout = Layout.parse(layout_text, host)
  batch = bodies.place(host, layout)
  with jax.transfer_guard('disallow'):
    mean, std, count = group_stats(
      batch['rewards'],
      batch['group_ids'],
      batch['valid'],
      num_groups=num_groups,
      mesh=layout.mesh,
      batch_axes=batch_axes,
      ddof=ddof,
    )
  assert mean.sharding.spec == layout.shardings()['rewards'].spec
  ref = _reference(host['rewards'], host['group_ids'], host['valid'], num_groups, ddof)
  for got, want in zip((mean, std, count), ref):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_grpo_advantages_have_zero_mean_per_group():
  rows, num_groups = 32, 4
  host = bodies.host_batch(rows, 4, num_groups=num_groups)
  layout = Layout.parse('dp4.tp2', host)
  batch = bodies.place(host, layout)
  mean, std, _ = group_stats(
    batch['rewards'], batch['group_ids'], batch['valid'], num_groups=num_groups, mesh=layout.mesh
  )
  adv = np.asarray((batch['rewards'] - mean) / (std + 1e-6))
  for g in range(num_groups):
    assert abs(adv[host['group_ids'] == g].mean()) < 1e-5
    assert abs(adv[host['group_ids'] == g].std() - 1) < 1e-3


def test_group_stats_rejects_rows_that_do_not_split():
  layout = Layout.parse('dp8', {'r': np.zeros(8, np.float32)})
  with pytest.raises(ValueError, match='do not split'):
    group_stats(
      jnp.zeros(12), jnp.zeros(12, jnp.int32), jnp.ones(12, bool), num_groups=2, mesh=layout.mesh
    )
