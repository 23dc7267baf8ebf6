"""Token balancing: equal rows per rank, lower max tokens per rank, rows kept where they are."""

import numpy as np
import pytest

from earl_jax.dispatch import (
  Layout,
  LayoutError,
  balance,
  balanced_permutation,
  check_permutation,
  kk_bins,
  lpt_bins,
  rank_loads,
)
from earl_jax.testing import dispatch_bodies as bodies


def _skewed_lengths(rows, seed):
  # Rollouts come back grouped: long episodes cluster on a few ranks.
  rng = np.random.default_rng(seed)
  return np.sort(rng.integers(1, 4096, rows))[::-1].copy()


@pytest.mark.parametrize('method', ['lpt', 'kk', 'local'])
@pytest.mark.parametrize(('src_text', 'dst_text'), [('dp8', 'dp8'), ('dp2.tp4', 'dp4.tp2')])
def test_balancing_lowers_max_tokens_per_rank(method, src_text, dst_text):
  rows = 64
  host = bodies.host_batch(rows, 8)
  src, dst = Layout.parse(src_text, host), Layout.parse(dst_text, host)
  ranks = 8 if dst_text == 'dp8' else 4
  for seed in range(3):
    lengths = _skewed_lengths(rows, seed)
    perm = balanced_permutation(lengths, src, dst, like=host, method=method)
    check_permutation(perm, rows)
    before = rank_loads(lengths, None, ranks)
    after = rank_loads(lengths, perm, ranks)
    assert after.sum() == before.sum()
    assert after.max() < before.max()
    # Close to the ideal: within one longest row of the mean.
    assert after.max() - lengths.sum() / ranks <= lengths.max()


def test_kk_is_at_least_as_good_as_lpt_on_these_inputs_and_near_optimal():
  for seed in range(5):
    lengths = np.random.default_rng(seed).integers(1, 1000, 128)
    lpt = max(lengths[b].sum() for b in lpt_bins(lengths, 8))
    kk = max(lengths[b].sum() for b in kk_bins(lengths, 8))
    assert kk <= lpt
    assert kk - lengths.sum() / 8 <= 40


@pytest.mark.parametrize('bins_fn', [lpt_bins, kk_bins])
def test_bins_have_equal_cardinality_and_partition_rows(bins_fn):
  lengths = np.random.default_rng(0).integers(0, 100, 48)
  bins = bins_fn(lengths, 6)
  assert [len(b) for b in bins] == [8] * 6
  np.testing.assert_array_equal(np.sort(np.concatenate(bins)), np.arange(48))


def _moved_rows(perm, ranks):
  per = len(perm) // ranks
  return int(sum((perm[k * per : (k + 1) * per] // per != k).sum() for k in range(ranks)))


def test_local_balancing_matches_kk_and_moves_far_fewer_rows():
  rows, ranks = 256, 8
  host = bodies.host_batch(rows, 8)
  src = dst = Layout.parse('dp8', host)
  for seed in range(3):
    lengths = np.random.default_rng(seed).integers(1, 4096, rows)
    local = balanced_permutation(lengths, src, dst, like=host, method='local')
    kk = balanced_permutation(lengths, src, dst, like=host, method='kk')
    check_permutation(local, rows)
    assert rank_loads(lengths, local, ranks).max() <= rank_loads(lengths, kk, ranks).max() * 1.01
    assert _moved_rows(local, ranks) * 4 < _moved_rows(kk, ranks)
  # Already balanced: nothing moves.
  perm = balanced_permutation(np.ones(rows, np.int64), src, dst, like=host)
  np.testing.assert_array_equal(perm, np.arange(rows))


def test_kk_bins_are_matched_to_the_ranks_that_hold_most_of_their_rows():
  rows = 32
  host = bodies.host_batch(rows, 8)
  src = dst = Layout.parse('dp8', host)
  # Rank k's rows are all longer than rank k+1's: KK's bins mix them, and the matching keeps at
  # least as many rows in place as the identity matching would.
  lengths = np.repeat(np.arange(8, 0, -1) * 100, 4) + np.tile(np.arange(4), 8)
  perm = balanced_permutation(lengths, src, dst, like=host, method='kk')
  from earl_jax.dispatch import kk_bins as bins_fn

  identity = np.concatenate(bins_fn(lengths, 8))
  assert _moved_rows(perm, 8) <= _moved_rows(identity, 8)


def test_balancing_rejects_rows_that_do_not_split():
  with pytest.raises(LayoutError, match='pad_rows'):
    kk_bins(np.ones(10), 4)


def test_rows_that_stay_on_their_rank_keep_their_slot():
  rng = np.random.default_rng(3)
  lengths = rng.integers(1, 200, 64)
  for rows_by_rank in (
    [np.arange(8 * k, 8 * k + 8) for k in range(8)],  # nothing moves: the identity
    balance.local_bins(lengths, 8, target=max(int(lengths[b].sum()) for b in kk_bins(lengths, 8))),
  ):
    perm = balance.in_slots(rows_by_rank)
    assert sorted(perm.tolist()) == list(range(64))
    for k, rows in enumerate(rows_by_rank):
      block = perm[8 * k : 8 * k + 8]
      assert set(block.tolist()) == set(np.asarray(rows).tolist())
      stay = [r for r in rows if 8 * k <= r < 8 * k + 8]
      assert all(perm[r] == r for r in stay)
