"""DAPO's dynamic sampling: the groups of a step whose episodes all returned the same are
replaced by groups of further rollouts of the step that did not, and the batch keeps its size.

A group-relative advantage ('grpo', 'dr_grpo', 'rloo') is 0 on every token of a group whose
returns are all equal, so such a group adds nothing to the update but its share of the batch
(DAPO, Yu et al. 2025, Sec. 3.2; verl's `algorithm.filter_groups`). Here a step rolls out its
`num_episodes` episodes (round 0); while some group slots of the batch hold flat groups and
rounds remain, it rolls out the step's episodes again with another seed (the same layout, so
every device holds the same rows in every round), and each flat slot takes the rows of a
group of the new round that is not flat and that the same devices hold row for row (`assign`).
No episode moves between devices, let alone processes, and the batch the experience stage
receives is laid out as one rollout's would be. What is still flat when the rounds run out
stays in the batch (its advantage is 0). Every process takes the same decisions, from the whole
batch's returns (`EpisodeStats.gather`) and the layout's rows per device, whatever the number
of processes: a run on 2 processes x 4 devices keeps the groups one on 8 devices keeps.

  filled = dynamic_sampling.fill(play, rounds=2, group_size=4, rows=batch_shardings.valid)
  filled.traj       # this process's rows of the batch that trains (Trajectories)
  filled.episodes   # its whole-batch statistics
  filled.record()   # {'sampling/rounds': ..., 'sampling/dropped_groups': ..., ...}
"""

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jaxtyping import Bool, Float

from earl_jax.rollout.trajectories import EpisodeStats, Trajectories


def flat_groups(returns: Float[np.ndarray, ' B'], group_size: int) -> Bool[np.ndarray, ' G']:
  """Per group of `group_size` consecutive rows: whether its returns are all equal."""
  by_group = np.asarray(returns).reshape(-1, group_size)
  return np.ptp(by_group, axis=1) == 0


def signatures(holders: Bool[np.ndarray, 'D B'], group_size: int) -> list[bytes]:
  """Per group: which devices hold each of its rows (two groups with the same signature can
  take each other's place without moving a row between devices)."""
  D, B = holders.shape
  by_group = np.asarray(holders, bool).reshape(D, B // group_size, group_size)
  return [by_group[:, g].tobytes() for g in range(B // group_size)]


def row_devices(rows: jax.sharding.NamedSharding, num_rows: int) -> Bool[np.ndarray, 'D B']:
  """Which devices of the mesh (in its order) hold each row of a [num_rows] array on `rows`,
  the same on every process (every device's, not only this process's)."""
  position = {d: i for i, d in enumerate(rows.mesh.devices.flat)}
  holders = np.zeros((len(position), num_rows), bool)
  for device, index in rows.devices_indices_map((num_rows,)).items():
    start, stop, _ = index[0].indices(num_rows)
    holders[position[device], start:stop] = True
  return holders


def assign(
  open_slots: Sequence[int], flat: Bool[np.ndarray, ' G'], sigs: Sequence[bytes]
) -> tuple[dict[int, int], list[int]]:
  """Fills the flat group slots `open_slots` (in order) with the groups of a new round that are
  not flat (in order), each from a group with the slot's signature. Returns ({slot: group of
  the new round}, the slots left open)."""
  free: dict[bytes, collections.deque] = collections.defaultdict(collections.deque)
  for g, is_flat in enumerate(flat):
    if not is_flat:
      free[sigs[g]].append(g)
  filled, left = {}, []
  for slot in open_slots:
    if free[sigs[slot]]:
      filled[slot] = free[sigs[slot]].popleft()
    else:
      left.append(slot)
  return filled, left


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
    extra_s: the seconds of the rounds after the first.
  """

  traj: Trajectories
  episodes: EpisodeStats
  rounds: int
  dropped: int
  flat_left: int
  groups: int
  sampled_flat: int
  extra_s: float

  def record(self) -> dict[str, float]:
    """The step's `sampling/...` metrics."""
    return {
      'sampling/rounds': float(self.rounds),
      'sampling/dropped_groups': float(self.dropped),
      'sampling/flat_left': float(self.flat_left),
      'sampling/sampled_flat_rate': self.sampled_flat / self.groups,
      'sampling/extra_rollout_s': self.extra_s,
    }


def fill(
  play: Callable[[int], Trajectories],
  *,
  rounds: int,
  group_size: int,
  rows: jax.sharding.NamedSharding,
  shaping: Callable[[np.ndarray], np.ndarray | None] | None = None,
) -> Filled:
  """Plays round 0 (`play(0)`, this process's episodes of the step), then up to `rounds` more
  while the batch holds flat groups, and takes the batch that trains (see the module
  docstring). A collective: every process calls it, and `play` must be one too (the engine's
  run). `rows`: how the batch's rows lie on the rollout layout (a [B] array's sharding, e.g.
  `Batch.valid`'s). `shaping`: per episode, a reward added to its return (e.g. the overlong
  penalty, from the lengths), so that a group is flat by what its advantage sees."""
  first = play(0)
  sources = [first]
  episodes = EpisodeStats.gather(first)

  def flat_of(stats: EpisodeStats) -> np.ndarray:
    bonus = None if shaping is None else shaping(stats.lengths)
    returns = stats.returns if bonus is None else stats.returns + bonus
    return flat_groups(returns, group_size)

  flat = flat_of(episodes)
  groups = len(flat)
  sigs = signatures(row_devices(rows, first.batch_rows), group_size)
  source = np.stack([np.zeros(groups, np.int64), np.arange(groups)], axis=1)  # (round, group)
  open_slots = np.flatnonzero(flat).tolist()
  t0 = time.perf_counter()
  for k in range(1, rounds + 1):
    if not open_slots:
      break
    sources.append(play(k))
    filled, open_slots = assign(open_slots, flat_of(EpisodeStats.gather(sources[-1])), sigs)
    for slot, group in filled.items():
      source[slot] = (k, group)
  extra_s = time.perf_counter() - t0
  if len(sources) == 1:
    traj = first
  else:
    local = {int(r): i for i, r in enumerate(first.row_ids)}
    picks = []
    for r in first.row_ids:
      k, group = source[r // group_size]
      picks.append((k, local[group * group_size + r % group_size]))
    traj = Trajectories.pick(sources, np.array(picks, np.int64), group_size=group_size)
    episodes = EpisodeStats.gather(traj)
  sampled_flat = int(flat.sum())
  return Filled(
    traj=traj,
    episodes=episodes,
    rounds=len(sources),
    dropped=sampled_flat - len(open_slots),
    flat_left=len(open_slots),
    groups=groups,
    sampled_flat=sampled_flat,
    extra_s=extra_s,
  )


def round_seed(step_seed: int, k: int) -> int:
  """The seed of a step's round `k` (round 0: the step's own seed)."""
  if k == 0:
    return step_seed
  return int(np.random.SeedSequence([step_seed, k]).generate_state(1)[0]) % (2**31 - 1)


__all__ = ['Filled', 'assign', 'fill', 'flat_groups', 'round_seed', 'row_devices', 'signatures']
