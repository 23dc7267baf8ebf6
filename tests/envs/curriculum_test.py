"""The online task curriculum: pass rates from decayed counts, weights by the reward's variance."""

import numpy as np
import pytest

from earl_jax.envs.curriculum import Curriculum, CurriculumConfig
from earl_jax.errors import ConfigError


def test_weights_follow_the_pass_rate_and_memory_decays_the_counts():
  c = Curriculum(CurriculumConfig(enabled=True, memory=0.5, prior=1.0, floor=0.1), num_tasks=4)
  np.testing.assert_allclose(c.weights(), [1, 1, 1, 1])  # unseen: p = 1/2, the most weight
  # Task 0: 4 of 4 pass; task 1: 0 of 4; task 2: 2 of 4; task 3 unseen.
  c.update(np.array([0] * 4 + [1] * 4 + [2] * 4), np.array([1] * 4 + [0] * 4 + [1, 0, 1, 0], bool))
  np.testing.assert_allclose(c.pass_rates(), [5 / 6, 1 / 6, 1 / 2, 1 / 2])
  p = np.array([5 / 6, 1 / 6, 1 / 2, 1 / 2])
  np.testing.assert_allclose(c.weights(), 0.1 + 0.9 * 4 * p * (1 - p))
  w = c.weights()
  assert w[0] == pytest.approx(w[1]) and w[1] < w[2] == w[3]
  # One step later task 0 fails twice: its old counts weigh half; task 1, not played, keeps its.
  c.update(np.array([0, 0]), np.array([False, False]))
  np.testing.assert_allclose(c.episodes[:3], [4, 4, 4])
  np.testing.assert_allclose(c.passes[:3], [2, 0, 2])
  assert c.pass_rates()[0] == pytest.approx(3 / 6)
  record = c.record()
  assert record['curriculum/tasks_seen'] == 3.0
  assert record['curriculum/solved_share'] == 0.0
  assert record['curriculum/unsolved_share'] == 0.0  # task 1: p = 1/6
  assert 1 < record['curriculum/effective_tasks'] <= 4
  # A task solved every time is drawn at the floor, never left out.
  solved = Curriculum(CurriculumConfig(enabled=True, memory=1.0, floor=0.05), num_tasks=2)
  solved.update(np.zeros(1000, int), np.ones(1000, bool))
  assert solved.weights()[0] == pytest.approx(0.05, abs=0.01)
  assert solved.record()['curriculum/solved_share'] == 1.0


def test_state_round_trips_and_bad_input_is_refused():
  c = Curriculum(CurriculumConfig(enabled=True), num_tasks=3)
  c.update(np.array([0, 2, 2]), np.array([True, False, True]))
  other = Curriculum(CurriculumConfig(enabled=True), num_tasks=3)
  other.load_state_dict(c.state_dict())
  np.testing.assert_array_equal(other.weights(), c.weights())
  with pytest.raises(
    ValueError, match="checkpoint's curriculum has 3 tasks, this run's environment 5"
  ):
    Curriculum(CurriculumConfig(enabled=True), num_tasks=5).load_state_dict(c.state_dict())
  with pytest.raises(ValueError, match=r'task ids in \[0, 7\], expected ids of the 3 tasks'):
    c.update(np.array([0, 7]), np.array([True, True]))
  for field, value in (('memory', 0.0), ('prior', 0.0), ('floor', 1.5)):
    with pytest.raises(ConfigError, match=f'CurriculumConfig.{field} must be'):
      CurriculumConfig(**{field: value})
