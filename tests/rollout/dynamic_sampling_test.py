"""Dynamic sampling: which groups are flat, which rows replace them, the batch that results."""

import numpy as np
import pytest

from earl_jax.rollout import dynamic_sampling
from earl_jax.rollout.trajectories import Trajectories


def _round(returns, *, seed: int, group_size: int = 2, env_stats: bool = True) -> Trajectories:
  """One rollout round of len(returns) episodes: episode i of round `seed` has the tokens
  [100 * seed + i] * length with length 2 + (i + seed) % 3, its last token generated."""
  B = len(returns)
  lengths = np.array([2 + (i + seed) % 3 for i in range(B)], np.int32)
  T = int(lengths.max())
  tokens = np.zeros((B, T), np.int32)
  mask = np.zeros((B, T), bool)
  for i, n in enumerate(lengths):
    tokens[i, :n] = 100 * seed + i
    mask[i, n - 1] = True
  return Trajectories(
    tokens=tokens,
    loss_mask=mask,
    logprobs=np.where(mask, -0.25 * (seed + 1), 0.0).astype(np.float32),
    lengths=lengths,
    returns=np.asarray(returns, np.float32),
    group_ids=np.arange(B, dtype=np.int32) // group_size,
    turn_rewards=[[float(r)] for r in returns],
    turn_starts=[[0] for _ in range(B)],
    turn_tokens=[[int(n)] for n in lengths],
    outcomes=['win' if r > 0 else 'loss' for r in returns],
    generated_tokens=B,
    cache_buckets=[8 * (seed + 1)],
    timings={'generate_s': 1.0, 'env_s': 0.5, 'host_s': 0.0},
    rollout_stats={'slot_occupancy': 0.5 + 0.1 * seed},
    env_stats={'passed': np.full(B, float(seed))} if env_stats else {},
  )


def test_flat_groups_assign_and_sources():
  assert dynamic_sampling.flat_groups(np.array([1, 1, 0, 1, 0.5, 0.5]), 2).tolist() == [
    True,
    False,
    True,
  ]
  # Slots 0, 2 and 3 are flat; the new round's groups 1 and 3 are not: slot 0 takes group 1,
  # slot 2 group 3, slot 3 stays open.
  filled, left = dynamic_sampling.assign([0, 2, 3], np.array([True, False, True, False]))
  assert filled == {0: 1, 2: 3} and left == [3]
  assert dynamic_sampling.assign([1], np.array([True, True])) == ({}, [1])
  # Rows 4-7 (slots 2 and 3, groups of 2): slot 2 takes round 1's group 0.
  plan = np.array([[0, 0], [0, 1], [1, 0], [0, 3]])
  assert dynamic_sampling.sources(plan, [4, 5, 6, 7], 2) == [(1, 0), (1, 1), (0, 6), (0, 7)]


def test_assemble_takes_episodes_from_several_rounds_in_place():
  first, second = _round([1, 1, 0, 1], seed=0), _round([0, 1, 1, 1], seed=1)
  # Rows 0 and 1 (group 0, flat) from the second round's rows 0 and 1; rows 2, 3 kept.
  taken = [second.episode(0), second.episode(1), first.episode(2), first.episode(3)]
  out = Trajectories.assemble(taken, [first, second], group_size=2)
  assert out.lengths.tolist() == [3, 4, 4, 2]
  assert out.tokens.shape == (4, 4)
  assert out.tokens[0].tolist() == [100, 100, 100, 0] and out.tokens[2].tolist() == [2] * 4
  assert out.tokens[3].tolist() == [3, 3, 0, 0]
  assert out.loss_mask.sum(axis=1).tolist() == [1, 1, 1, 1] and out.loss_mask[1, 3]
  np.testing.assert_allclose(out.logprobs[0, 2], -0.5)
  assert out.returns.tolist() == [0, 1, 0, 1] and out.outcomes == ['loss', 'win', 'loss', 'win']
  assert out.group_ids.tolist() == [0, 0, 1, 1] and out.row_ids.tolist() == [0, 1, 2, 3]
  assert out.turn_rewards == [[0.0], [1.0], [0.0], [1.0]]
  assert out.turn_move_rewards == [[0.0]] * 4
  assert out.env_stats['passed'].tolist() == [1, 1, 0, 0]
  assert out.generated_tokens == 4 and out.cache_buckets == [8, 16]
  assert out.timings == {'generate_s': 2.0, 'env_s': 1.0, 'host_s': 0.0}
  assert out.rollout_stats == {'slot_occupancy': pytest.approx(0.55)}
  with pytest.raises(ValueError, match='3 episodes for 4 rows'):
    Trajectories.assemble(taken[:3], [first, second], group_size=2)


def test_fill_replaces_flat_groups_until_the_rounds_run_out():
  """Four groups of 2: round 0 has groups 0 and 2 flat; round 1 has only group 1 informative
  (-> slot 0), round 2 has groups 0 and 3 informative (-> slot 2). The batch keeps 8 rows."""
  rounds = {0: [1, 1, 0, 1, 0, 0, 1, 0], 1: [1, 1, 0, 1, 0, 0, 1, 1], 2: [0, 1, 1, 1, 0, 0, 1, 0]}
  played = []

  def play(k):
    played.append(k)
    return _round(rounds[k], seed=k)

  filled = dynamic_sampling.fill(play, rounds=3, group_size=2)
  assert played == [0, 1, 2]  # no fourth round: nothing is flat after the third
  traj = filled.traj
  assert traj.returns.tolist() == [0, 1, 0, 1, 0, 1, 1, 0]
  assert traj.tokens[:, 0].tolist() == [102, 103, 2, 3, 200, 201, 6, 7]
  assert filled.episodes.returns.tolist() == traj.returns.tolist()
  assert filled.episodes.group_stats() == {'count': 4.0, 'flat_rate': 0.0}
  assert (filled.rounds, filled.dropped, filled.flat_left, filled.groups) == (3, 2, 0, 4)
  record = filled.record()
  assert record['sampling/sampled_flat_rate'] == 0.5 and record['sampling/rounds'] == 3.0

  # One extra round allowed: slot 2 stays flat in the batch.
  played.clear()
  filled = dynamic_sampling.fill(play, rounds=1, group_size=2)
  assert played == [0, 1] and (filled.dropped, filled.flat_left) == (1, 1)
  assert filled.episodes.group_stats()['flat_rate'] == 0.25

  # Nothing flat: one round, the rollout's own trajectories.
  played.clear()
  only = dynamic_sampling.fill(lambda k: _round([0, 1, 1, 0], seed=k), rounds=3, group_size=2)
  assert only.rounds == 1 and only.dropped == only.flat_left == 0


def test_shaping_decides_flatness():
  """Equal returns but unequal lengths: with a length penalty the group is no longer flat."""
  first = _round([1, 1], seed=0)  # lengths 2 and 3
  filled = dynamic_sampling.fill(
    lambda k: first,
    rounds=2,
    group_size=2,
    shaping=lambda lengths: -0.1 * lengths,
  )
  assert filled.rounds == 1 and filled.sampled_flat == 0


def test_round_seeds_are_distinct_and_reproducible():
  seeds = [dynamic_sampling.round_seed(12345, k) for k in range(4)]
  assert seeds[0] == 12345 and len(set(seeds)) == 4
  assert seeds == [dynamic_sampling.round_seed(12345, k) for k in range(4)]
  assert all(0 <= s < 2**31 - 1 for s in seeds)
