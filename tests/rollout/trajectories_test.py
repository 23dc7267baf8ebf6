"""Trajectories: discounted returns per turn, padding to a bucket, context statistics."""

import dataclasses

import numpy as np
import pytest

from earl_jax.rollout.trajectories import Trajectories, overlong_penalties


def _trajectories():
  # Two episodes: [p p r | p r] (two turns) and [p p r] (one turn, then padding).
  tokens = np.array([[5, 6, 1, 7, 2], [5, 6, 3, 0, 0]], np.int32)
  mask = np.array([[0, 0, 1, 0, 1], [0, 0, 1, 0, 0]], bool)
  return Trajectories(
    tokens=tokens,
    loss_mask=mask,
    logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
    lengths=np.array([5, 3], np.int32),
    returns=np.array([1.5, -1.0], np.float32),
    group_ids=np.array([0, 1], np.int32),
    turn_rewards=[[0.5, 1.0], [-1.0]],
    turn_starts=[[0, 3], [0]],
    turn_tokens=[[3, 2], [3]],
    outcomes=['win', 'loss'],
    generated_tokens=3,
    cache_buckets=[8],
    timings={},
  )


def test_token_returns_are_rewards_to_go_on_generated_tokens_only():
  r = _trajectories().token_returns(gamma=0.5)
  np.testing.assert_allclose(r[0], [0, 0, 0.5 + 0.5 * 1.0, 0, 1.0])
  np.testing.assert_allclose(r[1], [0, 0, -1.0, 0, 0])


def test_a_move_reward_credited_to_its_own_turn_leaves_the_turns_before_it():
  # Episode 0: a legal move (bonus 0.5) then an invalid one (penalty -1, the whole reward).
  traj = dataclasses.replace(
    _trajectories(), turn_rewards=[[0.5, -1.0], [-1.0]], turn_move_rewards=[[0.5, -1.0], [0.0]]
  )
  to_go = traj.token_returns(gamma=0.5)
  np.testing.assert_allclose(to_go[0], [0, 0, 0.5 + 0.5 * -1.0, 0, -1.0])
  own = traj.token_returns(gamma=0.5, move_credit='own_turn')
  np.testing.assert_allclose(own[0], [0, 0, 0.5, 0, -1.0])
  np.testing.assert_allclose(own[1], [0, 0, -1.0, 0, 0])  # an outcome reward: discounted as ever
  batch = traj.to_batch(bucket=8, rows=4, gamma=0.5, move_credit='own_turn')
  np.testing.assert_allclose(batch.returns[0, :5], own[0])
  np.testing.assert_allclose(batch.rewards[:2], traj.returns)  # the episode's return: unchanged
  with pytest.raises(ValueError, match="move_credit='own'"):
    traj.token_returns(gamma=0.5, move_credit='own')


def test_to_batch_pads_rows_and_tokens_and_marks_padding_invalid():
  traj = _trajectories()
  batch = traj.to_batch(bucket=8, rows=4, gamma=1.0)
  assert batch.tokens.shape == (4, 8) and batch.valid.tolist() == [True, True, False, False]
  np.testing.assert_array_equal(batch.tokens[:2, :5], traj.tokens)
  assert not batch.loss_mask[2:].any() and not batch.tokens[:, 5:].any()
  np.testing.assert_allclose(batch.returns[0, :5], [0, 0, 1.5, 0, 1.0])
  assert batch.rewards.tolist() == [1.5, -1.0, 0.0, 0.0]
  with pytest.raises(ValueError, match='bucket 4 is shorter than the longest episode \\(5\\)'):
    traj.to_batch(bucket=4, rows=4)
  with pytest.raises(ValueError, match='rows=1 is fewer than the 2 episodes'):
    traj.to_batch(bucket=8, rows=1)


def test_overlong_penalties_shape_the_return_and_the_last_turn():
  """DAPO's soft punishment: 0 up to cap - buffer, then linear to -penalty at the cap and
  beyond; added to the episode's return and to its last turn's reward."""
  lengths = np.array([5, 3, 8, 9], np.int32)
  np.testing.assert_allclose(
    overlong_penalties(lengths, cap=8, buffer=4, penalty=2.0), [-0.5, 0.0, -2.0, -2.0]
  )
  assert not overlong_penalties(lengths, cap=8, buffer=0, penalty=2.0).any()
  traj = _trajectories()  # lengths 5 and 3
  bonus = overlong_penalties(traj.lengths, cap=8, buffer=4, penalty=1.0)
  batch = traj.to_batch(bucket=8, rows=4, gamma=0.5, bonus=bonus)
  assert batch.rewards.tolist() == [1.25, -1.0, 0.0, 0.0]
  # Turn rewards [0.5, 1.0 - 0.25]: the second turn 0.75, the first 0.5 + 0.5 x 0.75.
  np.testing.assert_allclose(batch.returns[0, :5], [0, 0, 0.875, 0, 0.75])
  np.testing.assert_allclose(batch.returns[1, :3], [0, 0, -1.0])


def test_excluded_outcomes_stay_out_of_the_update():
  """Overlong filtering: an excluded episode keeps its tokens, but its row is invalid with an
  empty loss mask, like a padding row; the other episodes' rows are unchanged."""
  traj = _trajectories()
  traj.outcomes = ['overflow', 'loss']
  kept = traj.to_batch(bucket=8, rows=4)
  batch = traj.to_batch(bucket=8, rows=4, exclude=('overflow',))
  assert batch.valid.tolist() == [False, True, False, False]
  assert not batch.loss_mask[0].any()
  np.testing.assert_array_equal(batch.tokens, kept.tokens)
  np.testing.assert_array_equal(batch.loss_mask[1:], kept.loss_mask[1:])
  assert kept.valid.tolist() == [True, True, False, False] and kept.loss_mask[0].any()
  with pytest.raises(ValueError, match="unknown outcomes \\['overlong'\\] in exclude"):
    traj.to_batch(bucket=8, rows=4, exclude=('overlong',))


def test_context_and_outcome_statistics():
  traj = _trajectories()
  stats = traj.context_stats()
  assert stats['episode_len_mean'] == 4.0 and stats['episode_len_max'] == 5.0
  assert stats['turn_len_mean'] == pytest.approx(8 / 3) and stats['turns_mean'] == 1.5
  assert traj.win_rate() == 0.5 and traj.outcome_rates() == {'loss': 0.5, 'win': 0.5}


def test_a_thinking_turn_counts_toward_the_move_it_prepared():
  traj = _trajectories()
  assert traj.context_stats()['move_len_mean'] == pytest.approx(8 / 3)  # no thinking: per turn
  traj.thoughts = np.array([1, 0], np.int32)  # episode 0 thought once, then moved
  stats = traj.context_stats()
  assert stats['turn_len_mean'] == pytest.approx(8 / 3) and stats['turns_mean'] == 1.5
  assert stats['move_len_mean'] == pytest.approx(8 / 2) and stats['thoughts_per_move'] == 0.5
