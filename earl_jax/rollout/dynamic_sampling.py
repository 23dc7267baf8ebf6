"""DAPO's dynamic sampling: the groups of a step whose episodes all returned the same are
replaced by groups of further rollouts of the step that did not, and the batch keeps its size.

A group-relative advantage ('grpo', 'dr_grpo', 'rloo') is 0 on every token of a group whose
returns are all equal, so such a group adds nothing to the update but its share of the batch
(DAPO, Yu et al. 2025, Sec. 3.2; verl's `algorithm.filter_groups`). Here a step rolls out its
`num_episodes` episodes (round 0); while some group slots of the batch hold flat groups and
rounds remain, it rolls out the step's episodes again with another seed, and the flat slots, in
order, take the groups of the new round that are not flat, in order (`assign`): the plan is
the whole batch's, the same whatever the layout and the number of processes. A process whose
rows a group from elsewhere fills receives its episodes from the process that played them (one
exchange of the episodes that move, `distributed.allgather_bytes`), so the batch the
experience stage receives is laid out as one rollout's would be, and a run on 2 processes x 4
devices trains on the batch one on 8 devices does. What is still flat when the rounds run out
stays in the batch (its advantage is 0). Every process takes the same decisions, from the whole
batch's returns (`EpisodeStats.gather`).

  filled = dynamic_sampling.fill(play, rounds=2, group_size=4)
  filled.traj       # this process's rows of the batch that trains (Trajectories)
  filled.episodes   # its whole-batch statistics
  filled.record()   # {'sampling/rounds': ..., 'sampling/dropped_groups': ..., ...}
"""

import dataclasses
import pickle
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jaxtyping import Bool, Float, Int

from earl_jax import distributed
from earl_jax.rollout.trajectories import EpisodeStats, Trajectories


def flat_groups(returns: Float[np.ndarray, ' B'], group_size: int) -> Bool[np.ndarray, ' G']:
  """Per group of `group_size` consecutive rows: whether its returns are all equal."""
  by_group = np.asarray(returns).reshape(-1, group_size)
  return np.ptp(by_group, axis=1) == 0


def assign(
  open_slots: Sequence[int], flat: Bool[np.ndarray, ' G']
) -> tuple[dict[int, int], list[int]]:
  """Fills the flat group slots `open_slots` (in order) with the groups of a new round that are
  not flat (in order). Returns ({slot: group of the new round}, the slots left open)."""
  informative = np.flatnonzero(~np.asarray(flat)).tolist()
  filled = dict(zip(open_slots, informative))
  return filled, list(open_slots[len(filled) :])


def sources(
  plan: Int[np.ndarray, 'G 2'], row_ids: Sequence[int] | np.ndarray, group_size: int
) -> list[tuple[int, int]]:
  """Per row of `row_ids`: the (round, row of the whole batch) whose episode it takes, by the
  plan's (round, group) of its group slot."""
  out = []
  for r in row_ids:
    k, group = plan[int(r) // group_size]
    out.append((int(k), int(group) * group_size + int(r) % group_size))
  return out


@dataclasses.dataclass(frozen=True)
class Filled:
  """A step's batch after dynamic sampling.

  Attributes:
    traj: this process's rows of the batch that trains.
    episodes: the whole batch's statistics (every process alike).
    rounds: the rollouts played (1: the first had no flat group, or no round was allowed).
    dropped: the first round's flat groups left out (replaced by a later round's).
    flat_left: flat groups still in the batch when the rounds ran out.
    groups: the batch's groups.
    sampled_flat: flat groups among the first round's.
    extra_s: the seconds of the rounds after the first, the exchange included.
    moved: episodes a process received from another, over every process (0 on one process).
  """

  traj: Trajectories
  episodes: EpisodeStats
  rounds: int
  dropped: int
  flat_left: int
  groups: int
  sampled_flat: int
  extra_s: float
  moved: int = 0

  def record(self) -> dict[str, float]:
    """The step's `sampling/...` metrics."""
    return {
      'sampling/rounds': float(self.rounds),
      'sampling/dropped_groups': float(self.dropped),
      'sampling/flat_left': float(self.flat_left),
      'sampling/sampled_flat_rate': self.sampled_flat / self.groups,
      'sampling/extra_rollout_s': self.extra_s,
      'sampling/moved_episodes': float(self.moved),
    }


def fill(
  play: Callable[[int], Trajectories],
  *,
  rounds: int,
  group_size: int,
  shaping: Callable[[np.ndarray], np.ndarray | None] | None = None,
) -> Filled:
  """Plays round 0 (`play(0)`, this process's episodes of the step), then up to `rounds` more
  while the batch holds flat groups, and takes the batch that trains (see the module
  docstring). A collective: every process calls it, and `play` must be one too (the engine's
  run, which gives every process the same rows in every round). `shaping`: per episode, a
  reward added to its return (e.g. the overlong penalty, from the lengths), so that a group is
  flat by what its advantage sees."""
  first = play(0)
  played = [first]
  episodes = EpisodeStats.gather(first)

  def flat_of(stats: EpisodeStats) -> np.ndarray:
    bonus = None if shaping is None else shaping(stats.lengths)
    returns = stats.returns if bonus is None else stats.returns + bonus
    return flat_groups(returns, group_size)

  flat = flat_of(episodes)
  groups = len(flat)
  plan = np.stack([np.zeros(groups, np.int64), np.arange(groups)], axis=1)  # (round, group)
  open_slots = np.flatnonzero(flat).tolist()
  t0 = time.perf_counter()
  for k in range(1, rounds + 1):
    if not open_slots:
      break
    played.append(play(k))
    filled, open_slots = assign(open_slots, flat_of(EpisodeStats.gather(played[-1])))
    for slot, group in filled.items():
      plan[slot] = (k, group)
  moved = 0
  if len(played) == 1:
    traj = first
  else:
    taken, moved = _take(played, plan, group_size)
    traj = Trajectories.assemble(taken, played, group_size=group_size)
    episodes = EpisodeStats.gather(traj)
  sampled_flat = int(flat.sum())
  return Filled(
    traj=traj,
    episodes=episodes,
    rounds=len(played),
    dropped=sampled_flat - len(open_slots),
    flat_left=len(open_slots),
    groups=groups,
    sampled_flat=sampled_flat,
    extra_s=time.perf_counter() - t0,
    moved=moved,
  )


def _take(
  played: list[Trajectories], plan: Int[np.ndarray, 'G 2'], group_size: int
) -> tuple[list[dict], int]:
  """This process's episodes of the planned batch (`Trajectories.episode` records, in its rows'
  order), those another process played received from it; and how many episodes every process
  together received. The exchange is skipped when no process needs a row it does not hold
  (always on one process)."""
  first = played[0]
  if any(not np.array_equal(t.row_ids, first.row_ids) for t in played):
    raise ValueError("dynamic sampling: the step's rounds hold different rows of the batch.")
  local = {int(r): i for i, r in enumerate(first.row_ids)}
  mine = sources(plan, first.row_ids, group_size)
  held = np.zeros(first.batch_rows, bool)
  held[first.row_ids] = True
  holders = distributed.row_holders(held)  # [P, B], the same on every process
  needs = [
    src
    for p in range(len(holders))
    for src in sources(plan, np.flatnonzero(holders[p]), group_size)
    if not holders[p, src[1]]
  ]
  wanted = set(needs)
  received: dict[tuple[int, int], dict] = {}
  if wanted:
    # Each row another process needs is sent by the first process that holds it.
    sent = {
      (k, r): played[k].episode(local[r])
      for k, r in sorted(wanted)
      if int(np.argmax(holders[:, r])) == jax.process_index()
    }
    for data in distributed.allgather_bytes(pickle.dumps(sent)):
      received.update(pickle.loads(data))  # our own processes' episodes
  taken = [played[k].episode(local[r]) if r in local else received[(k, r)] for k, r in mine]
  return taken, len(needs)


def round_seed(step_seed: int, k: int) -> int:
  """The seed of a step's round `k` (round 0: the step's own seed)."""
  if k == 0:
    return step_seed
  return int(np.random.SeedSequence([step_seed, k]).generate_state(1)[0]) % (2**31 - 1)


__all__ = ['Filled', 'assign', 'fill', 'flat_groups', 'round_seed', 'sources']
