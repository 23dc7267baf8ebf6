"""An online task curriculum: each step's tasks drawn by how informative their recent episodes
were, so that the batch goes to the tasks the policy sometimes solves.

A group-relative advantage teaches nothing on a task whose episodes all pass or all fail (the
warm start's memorised tasks, the tasks out of its reach). Per task, the curriculum keeps counts
of its episodes and of those that passed (outcome 'win'), decayed by `memory` each time the task
is played again (a task comes back after dozens of steps when there are hundreds: a decay per
step would forget it in between), and its pass rate p = (passes + prior) / (episodes + 2 prior)
(a task never played reads 1/2). A task is
drawn with weight floor + (1 - floor) x 4 p (1 - p): the Bernoulli variance of its reward,
largest at p = 1/2, the online difficulty filtering of PRIME and Polaris made soft, so that a
task the policy solves every time is still drawn now and then (and re-weighed if it regresses).

The draw is the environment's (`code_env.assign`: the groups' tasks without replacement, by
these weights, from the step's seed); the counts are updated from the whole batch's episodes
(`EpisodeStats`, the same on every process) after each step, and saved with the checkpoint.

  curriculum = Curriculum(CurriculumConfig(enabled=True), num_tasks=len(tasks))
  engine.run(params, mesh, seed=s, task_weights=curriculum.weights())
  curriculum.update(task_ids, passed)      # per episode of the step
  curriculum.record()                      # {'curriculum/...': ...}
"""

import dataclasses
import math

import numpy as np
from jaxtyping import Bool, Float, Int

from earl_jax.config import check_float32
from earl_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
  """The online task curriculum of the code tasks ('functions', 'humaneval').

  Attributes:
    enabled: draw each step's tasks by their recent pass rate (off: the seed's shuffle plays
      every task in turn).
    memory: what a task's counts keep of its earlier episodes each time it is played again, in
      (0, 1] (1: every episode alike): the policy moves, so its latest episodes count more.
    prior: the pseudo-episodes that pass, and that fail, of every task (> 0): a task never
      played reads 1/2, one whose 4 episodes all passed 0.9 (with 0.5).
    floor: the least weight of a task, relative to one that passes half the time, in (0, 1].
  """

  enabled: bool = False
  memory: float = 0.5
  prior: float = 0.5
  floor: float = 0.05

  def __post_init__(self):
    check_float32(self, 'memory', 'prior', 'floor')
    if not 0 < self.memory <= 1:
      raise ConfigError(f'CurriculumConfig.memory must be in (0, 1], got {self.memory}.')
    if not self.prior > 0:
      raise ConfigError(f'CurriculumConfig.prior must be > 0, got {self.prior}.')
    if not 0 < self.floor <= 1:
      raise ConfigError(f'CurriculumConfig.floor must be in (0, 1], got {self.floor}.')


class Curriculum:
  """Per task, decayed counts of its episodes and passes, and the weights they give."""

  def __init__(self, config: CurriculumConfig, num_tasks: int):
    self.config = config
    self.episodes = np.zeros(num_tasks, np.float64)
    self.passes = np.zeros(num_tasks, np.float64)

  @property
  def num_tasks(self) -> int:
    return len(self.episodes)

  def pass_rates(self) -> Float[np.ndarray, ' N']:
    prior = self.config.prior
    return (self.passes + prior) / (self.episodes + 2 * prior)

  def weights(self) -> Float[np.ndarray, ' N']:
    """Each task's draw weight (unnormalised): floor + (1 - floor) x 4 p (1 - p)."""
    p = self.pass_rates()
    floor = self.config.floor
    return floor + (1 - floor) * 4 * p * (1 - p)

  def update(self, task_ids: Int[np.ndarray, ' B'], passed: Bool[np.ndarray, ' B']) -> None:
    """Decays the counts of the tasks the step played by `memory`, then counts its episodes."""
    task_ids = np.asarray(task_ids, np.int64)
    if task_ids.size and not 0 <= task_ids.min() <= task_ids.max() < self.num_tasks:
      raise ValueError(
        f'Curriculum.update: task ids in [{task_ids.min()}, {task_ids.max()}], expected ids '
        f'of the {self.num_tasks} tasks.'
      )
    played = np.unique(task_ids)
    self.episodes[played] *= self.config.memory
    self.passes[played] *= self.config.memory
    np.add.at(self.episodes, task_ids, 1.0)
    np.add.at(self.passes, task_ids, np.asarray(passed, np.float64))

  def record(self) -> dict[str, float]:
    """`curriculum/...`: the tasks played so far, the share of them the policy solves (p > 0.9)
    or never does (p < 0.1), and the effective number of tasks the weights draw from (the
    exponential of their entropy)."""
    seen = self.episodes > 0
    p = self.pass_rates()
    w = self.weights()
    w = w / w.sum()
    entropy = -float(np.sum(w * np.log(w)))
    n = max(int(seen.sum()), 1)
    return {
      'curriculum/tasks_seen': float(seen.sum()),
      'curriculum/solved_share': float(np.sum(seen & (p > 0.9)) / n),
      'curriculum/unsolved_share': float(np.sum(seen & (p < 0.1)) / n),
      'curriculum/effective_tasks': math.exp(entropy),
    }

  def state_dict(self) -> dict:
    return {'episodes': self.episodes.tolist(), 'passes': self.passes.tolist()}

  def load_state_dict(self, state: dict) -> None:
    if len(state['episodes']) != self.num_tasks:
      raise ValueError(
        f"The checkpoint's curriculum has {len(state['episodes'])} tasks, this run's "
        f'environment {self.num_tasks}.'
      )
    self.episodes = np.asarray(state['episodes'], np.float64)
    self.passes = np.asarray(state['passes'], np.float64)
