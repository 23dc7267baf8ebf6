"""Token balancing: a row permutation that evens out real tokens across data-parallel ranks.

Rows of an agentic RL batch have very different real (unpadded) lengths, and the train step's
cost on a data-parallel rank grows with the tokens it holds. The rollout is host-driven, so the
lengths are known on the host of every process; the permutation is computed there, identically
everywhere (pure numpy, deterministic tie-breaks), and the dispatcher applies it inside the same
collectives that change the layout (no second pass).

Every rank holds exactly B / ranks rows (arrays are evenly sharded), so this is balanced number
partitioning with equal cardinality:
  lpt  greedy longest-processing-time: rows by length, descending, each to the least-loaded rank
       that still has room. Fast; within 4/3 of optimal.
  kk   Karmarkar-Karp's largest differencing method for k equal-cardinality subsets (BLDM):
       sorted rows are cut into B/k tuples of k rows; repeatedly the two partial partitions with
       the largest spread are merged, largest subset of one with smallest of the other. Usually
       much tighter than LPT.
Then the subsets (bins) are matched to ranks so as to keep as many rows as possible where they
already are (`scipy.optimize.linear_sum_assignment` on rows already held by a rank's devices).
Within a rank, a row whose own index falls in the rank's block keeps that slot (perm[r] = r),
and the rows that arrive fill the vacated slots in source order: where the source and target
blocks are the same devices' (e.g. dp8 -> dp8), the dispatch then writes only the arriving rows
into the block (`OutOp('update')`) instead of copying all of it.

A balanced partition found from scratch moves almost every row (each bin mixes rows from every
rank), while a dispatch only needs to move what the layouts and the balance require. So:
  local  (the default) starts from the placement without a permutation (row r on the rank that
         would hold it anyway) and swaps pairs of rows between the most and a less loaded rank,
         each swap chosen to halve their gap as closely as possible, until the maximum load is
         no worse than KK's (or no swap helps). Every swap strictly lowers the sum of squared
         loads, so it ends. If it ends above KK's maximum by more than 1%, KK's partition is
         used instead. It reaches KK's balance while moving a small fraction of the rows.
  ring   (the main job's, where every row already is on a device of the rank the identity
         placement gives it: the layouts alone move nothing) every rank sends exactly j rows to
         the next rank (k -> k + 1 mod ranks) and takes j from the previous one, the j rows
         chosen so that the ranks' loads come closest to the mean (`ring_bins`). The moves of
         every step then are one ring shift of j rows on every pair: a dispatch kernel per j,
         whose wire carries exactly the rows that move (a 'local' move's few rows over pairs
         that change every step cannot be sent that tightly by a kernel that serves every move).
         j (0 or a power of two up to b/2) is the one of least `cost` (e.g. the packed rows:
         `packing.rows_needed`), then the smallest; 'local' is used instead where it costs
         strictly less.

  perm = balanced_permutation(lengths_B, src, dst, like=batch)       # int64 [B]
  batch_t, report = dispatcher.dispatch(batch, dst, perm=perm)
  rank_loads(lengths_B, perm, dst_ranks)                             # tokens per rank
"""

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jaxtyping import Int, Real
from scipy.optimize import linear_sum_assignment

from earl_jax.dispatch.layout import Layout, LayoutError

Method = Literal['lpt', 'kk', 'local', 'ring']
# 'ring': the j-row subsets of a rank are enumerated up to this many (else the windows of j
# consecutive rows in length order stand in: a coarser but even spread of sums).
_RING_SUBSETS = 4096
# Real tokens per row: any integer (or float) array or sequence [B].
Lengths = Real[np.ndarray, ' B'] | Sequence[int]
# 'local' falls back to KK when its max load is above KK's by more than this fraction.
_LOCAL_SLACK = 0.01


def _check_lengths(lengths: Lengths, num_ranks: int) -> np.ndarray:
  lengths = np.asarray(lengths)
  if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.number):
    raise ValueError(f'lengths must be a 1-D numeric array, got {lengths.dtype} {lengths.shape}.')
  if num_ranks < 1 or len(lengths) % num_ranks:
    raise LayoutError(
      f'{len(lengths)} rows do not split evenly over {num_ranks} ranks; pad the batch with '
      f'earl_jax.dispatch.pad_rows (padded rows have length 0).'
    )
  return lengths.astype(np.int64)


def _order(lengths: np.ndarray) -> np.ndarray:
  """Rows by length, descending, ties by row index (deterministic everywhere)."""
  return np.lexsort((np.arange(len(lengths)), -lengths))


def lpt_bins(lengths: Lengths, num_ranks: int) -> list[Int[np.ndarray, ' b']]:
  """Greedy LPT with equal cardinality: `num_ranks` bins of B / num_ranks row indices."""
  lengths = _check_lengths(lengths, num_ranks)
  cap = len(lengths) // num_ranks
  heap = [(0, k) for k in range(num_ranks)]
  bins: list[list[int]] = [[] for _ in range(num_ranks)]
  for row in _order(lengths):
    load, k = heapq.heappop(heap)
    bins[k].append(int(row))
    if len(bins[k]) < cap:
      heapq.heappush(heap, (load + int(lengths[row]), k))
  return [np.array(sorted(b), np.int64) for b in bins]


def kk_bins(lengths: Lengths, num_ranks: int) -> list[Int[np.ndarray, ' b']]:
  """Balanced largest differencing (Karmarkar-Karp for equal-cardinality k-partitioning)."""
  lengths = _check_lengths(lengths, num_ranks)
  k = num_ranks
  order = _order(lengths)
  # A partial partition: k subsets, each (sum, rows); kept sorted by sum, descending.
  heap = []
  for t, start in enumerate(range(0, len(order), k)):
    rows = order[start : start + k]
    subsets = sorted(((int(lengths[r]), [int(r)]) for r in rows), key=lambda s: -s[0])
    spread = subsets[0][0] - subsets[-1][0]
    heapq.heappush(heap, (-spread, t, subsets))
  tie = len(order)
  while len(heap) > 1:
    _, _, a = heapq.heappop(heap)
    _, _, b = heapq.heappop(heap)
    merged = [(a[i][0] + b[k - 1 - i][0], a[i][1] + b[k - 1 - i][1]) for i in range(k)]
    merged.sort(key=lambda s: -s[0])
    tie += 1
    heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
  subsets = heap[0][2] if heap else [(0, []) for _ in range(k)]
  return [np.array(sorted(rows), np.int64) for _, rows in subsets]


def local_bins(
  lengths: Lengths, num_ranks: int, *, target: float | None = None
) -> list[Int[np.ndarray, ' b']]:
  """Swap refinement of the identity placement (rank k holds rows k*b..(k+1)*b-1).

  Args:
    lengths: real tokens per row.
    num_ranks: ranks (equal row counts).
    target: stop once the maximum load is <= target (default: KK's maximum load).
  """
  lengths = _check_lengths(lengths, num_ranks)
  per = len(lengths) // num_ranks
  if target is None:
    target = max(int(lengths[b].sum()) for b in kk_bins(lengths, num_ranks))
  rows = [np.arange(k * per, (k + 1) * per) for k in range(num_ranks)]
  loads = np.array([int(lengths[r].sum()) for r in rows], np.int64)
  for _ in range(len(lengths) * 4):
    h = int(np.argmax(loads))
    if loads[h] <= target:
      break
    lens_h = lengths[rows[h]]
    for low in np.argsort(loads, kind='stable'):
      low = int(low)
      gap = int(loads[h] - loads[low])
      if gap <= 0:
        low = -1
        break
      order = np.argsort(lengths[rows[low]], kind='stable')
      lens_l = lengths[rows[low]][order]
      want = lens_h - gap / 2
      j = np.clip(np.searchsorted(lens_l, want), 1, max(1, len(lens_l) - 1))
      best = None
      for cand in (j - 1, j):
        cand = np.minimum(cand, len(lens_l) - 1)
        delta = lens_h - lens_l[cand]
        ok = (delta > 0) & (delta < gap)
        if ok.any():
          score = np.where(ok, np.abs(delta - gap / 2), np.inf)
          a = int(np.argmin(score))
          if best is None or score[a] < best[0]:
            best = (score[a], a, int(order[cand[a]]), int(delta[a]))
      if best is not None:
        _, a, b, delta = best
        rows[h][a], rows[low][b] = rows[low][b], rows[h][a]
        loads[h] -= delta
        loads[low] += delta
        break
    else:
      low = -1
    if low < 0:
      break
  return [np.sort(r) for r in rows]


def _subset_sums(lengths: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
  """The j-row subsets of a rank's rows ([n, j] row indices, local to the rank) and their sums,
  by sum ascending (ties in enumeration order): every subset when there are at most
  `_RING_SUBSETS`, else the windows of j consecutive rows in length order."""
  if math.comb(len(lengths), j) <= _RING_SUBSETS:
    subsets = np.array(list(itertools.combinations(range(len(lengths)), j)), np.int64)
  else:
    order = np.argsort(lengths, kind='stable')
    subsets = np.stack([order[i : i + j] for i in range(len(lengths) - j + 1)])
  subsets = subsets.reshape(-1, j)
  sums = lengths[subsets].sum(axis=1)
  by_sum = np.argsort(sums, kind='stable')
  return subsets[by_sum], sums[by_sum]


def ring_bins(lengths: Lengths, num_ranks: int, rows_sent: int) -> list[Int[np.ndarray, ' b']]:
  """The identity placement (rank k holds rows k*b..(k+1)*b-1) after every rank sends
  `rows_sent` (j) of its rows to rank k + 1 (mod ranks) and takes j from rank k - 1.

  Rank k's load becomes L_k - S_k + S_{k-1}, S_k the sum of the rows it sends, which is the mean
  when S_k = c + D_k, D_k the running sum of the ranks' excess over the mean. For every c that
  puts some rank's subset exactly on its target, each rank takes the subset whose sum is nearest
  its own; the c of the lowest maximum load (then the lowest sum of squares) is kept.
  Deterministic: the same bins on every process.
  """
  lengths = _check_lengths(lengths, num_ranks)
  per = len(lengths) // num_ranks
  j = int(rows_sent)
  if not 0 <= j <= per:
    raise ValueError(f'rows_sent must be in [0, {per}] (the rows of a rank), got {rows_sent}.')
  blocks = lengths.reshape(num_ranks, per)
  if j == 0 or j == per or num_ranks == 1:
    return [np.arange(k * per, (k + 1) * per) for k in range(num_ranks)]
  loads = blocks.sum(axis=1)
  excess = np.cumsum(loads * num_ranks - loads.sum())  # num_ranks * D_k: exact integers
  tables = [_subset_sums(blocks[k], j) for k in range(num_ranks)]
  offsets = np.unique(
    np.concatenate([sums * num_ranks - excess[k] for k, (_, sums) in enumerate(tables)])
  )
  picks = np.empty((num_ranks, len(offsets)), np.int64)  # subset index per rank, per offset
  sent = np.empty((num_ranks, len(offsets)), np.int64)
  for k, (_, sums) in enumerate(tables):
    want = offsets + excess[k]  # num_ranks * the sum rank k should send
    hi = np.clip(np.searchsorted(sums * num_ranks, want), 0, len(sums) - 1)
    lo = np.maximum(hi - 1, 0)
    nearer = np.abs(sums[lo] * num_ranks - want) <= np.abs(sums[hi] * num_ranks - want)
    picks[k] = np.where(nearer, lo, hi)
    sent[k] = sums[picks[k]]
  after = loads[:, None] - sent + np.roll(sent, 1, axis=0)  # [ranks, offsets]
  best = int(np.lexsort(((after.astype(np.float64) ** 2).sum(axis=0), after.max(axis=0)))[0])
  bins = []
  for k in range(num_ranks):
    prev = (k - 1) % num_ranks
    gone = set(tables[k][0][picks[k, best]].tolist())
    keep = [k * per + i for i in range(per) if i not in gone]
    came = [prev * per + int(i) for i in tables[prev][0][picks[prev, best]]]
    bins.append(np.sort(np.array(keep + came, np.int64)))
  return bins


def ring_rows(perm: Int[np.ndarray, ' B'], num_ranks: int) -> int | None:
  """j when `perm` is a ring shift of j >= 1 rows (every rank's block takes exactly j rows, all
  from the previous rank's block, and keeps the others in place: what 'ring' gives), else None."""
  perm = np.asarray(perm)
  rows = len(perm)
  if num_ranks < 2 or rows % num_ranks:
    return None
  per = rows // num_ranks
  slots = np.flatnonzero(perm != np.arange(rows))
  if not len(slots):
    return None
  rank = slots // per
  if not (perm[slots] // per == (rank - 1) % num_ranks).all():
    return None
  taken = np.bincount(rank, minlength=num_ranks)
  return int(taken[0]) if (taken == taken[0]).all() else None


def permutation_from_bins(
  bins: Sequence[Int[np.ndarray, ' b']], locality: Int[np.ndarray, 'B R'] | None = None
) -> Int[np.ndarray, ' B']:
  """The permutation that gives rank k the rows of its matched bin (`in_slots` order).

  Args:
    bins: equal-size arrays of row indices that partition range(B).
    locality: optional [B, ranks] score of keeping row r on rank k (e.g. how many of rank k's
      devices already hold it); bins are matched to ranks to maximise the total.

  Returns:
    perm int64 [B]: rank k's rows are perm[k * B/ranks : (k + 1) * B/ranks].
  """
  ranks = len(bins)
  if locality is None:
    assignment = np.arange(ranks)
  else:
    score = np.stack([locality[b].sum(axis=0) for b in bins])  # [bin, rank]
    rows, cols = linear_sum_assignment(-score)
    assignment = np.empty(ranks, np.int64)
    assignment[cols] = rows  # rank -> bin
  return in_slots([bins[assignment[k]] for k in range(ranks)])


def in_slots(rows_by_rank: Sequence[Int[np.ndarray, ' b']]) -> Int[np.ndarray, ' B']:
  """perm with rank k's rows in its block of positions: a row whose index lies in that block
  keeps it (perm[r] = r), the others fill the free positions in ascending order."""
  per = len(rows_by_rank[0])
  perm = np.empty(per * len(rows_by_rank), np.int64)
  for k, rows in enumerate(rows_by_rank):
    rows = np.sort(np.asarray(rows, np.int64))
    lo = k * per
    stay = (rows >= lo) & (rows < lo + per)
    block = np.full(per, -1, np.int64)
    block[rows[stay] - lo] = rows[stay]
    block[block < 0] = rows[~stay]
    perm[lo : lo + per] = block
  return perm


def target_ranks(dst: Layout, rows: int) -> int:
  """How many data-parallel ranks (distinct row blocks) the target layout has."""
  shards = {dst.row_shards(i) for i in range(len(dst.fields))}
  if len(shards) != 1:
    raise LayoutError(
      f'The target layout splits rows differently across fields ({sorted(shards)}); token '
      f'balancing needs one row split.'
    )
  ranks = shards.pop()
  if rows % ranks:
    raise LayoutError(f'{rows} rows do not split over the {ranks} row blocks of the target.')
  return ranks


def locality_scores(src: Layout, dst: Layout, like: Any) -> Int[np.ndarray, 'B R']:
  """[B, ranks]: how many devices of target rank k already hold source row r (field 0)."""
  leaves = src.check(like)
  shape = tuple(leaves[0].shape)
  rows = shape[0]
  ranks = target_ranks(dst, rows)
  per = rows // ranks
  src_map = src.sharding(0).devices_indices_map(shape)
  dst_map = dst.sharding(0).devices_indices_map(shape)
  score = np.zeros((rows, ranks), np.int64)
  for device in src.mesh.devices.flat:
    r0, r1, _ = src_map[device][0].indices(rows)
    k = dst_map[device][0].indices(rows)[0] // per
    score[r0:r1, k] += 1
  return score


def balanced_permutation(
  lengths_B: Lengths,
  src: Layout,
  dst: Layout,
  *,
  like: Any,
  method: Method = 'local',
  cost: Callable[[Int[np.ndarray, ' B']], float] | None = None,
) -> Int[np.ndarray, ' B']:
  """A row permutation balancing real tokens over the target's data-parallel ranks.

  Args:
    lengths_B: real (unpadded) tokens per row, known on every host (0 for padding rows).
    src: the layout the batch is on (used to keep rows where they are when it costs nothing).
    dst: the target layout; its row blocks are the ranks.
    like: the batch (or ShapeDtypeStructs), for shapes.
    method: 'local' (default: KK's balance, few rows moved), 'ring' (one ring shift of rows,
      where the layouts alone move no row; 'local' elsewhere), 'kk' or 'lpt'.
    cost: 'ring': what a permutation costs (lower is better; default: the maximum load).

  Returns:
    perm int64 [B] for `Dispatcher.dispatch(..., perm=perm)`.
  """
  leaves = jax.tree.leaves(like)
  rows = int(leaves[0].shape[0])
  if len(np.asarray(lengths_B)) != rows:
    raise LayoutError(f'lengths_B has {len(np.asarray(lengths_B))} entries for {rows} rows.')
  ranks = target_ranks(dst, rows)
  locality = locality_scores(src, dst, like)
  if method == 'lpt':
    return permutation_from_bins(lpt_bins(lengths_B, ranks), locality)
  if method not in ('local', 'ring', 'kk'):
    raise ValueError(f"method must be 'local', 'ring', 'kk' or 'lpt', got {method!r}.")
  kk = kk_bins(lengths_B, ranks)
  if method == 'kk':
    return permutation_from_bins(kk, locality)
  lengths = np.asarray(lengths_B, np.int64)
  kk_max = max(int(lengths[b].sum()) for b in kk)
  local = local_bins(lengths, ranks, target=kk_max)
  if max(int(lengths[b].sum()) for b in local) > kk_max * (1 + _LOCAL_SLACK):
    local_perm = permutation_from_bins(kk, locality)
  else:  # the identity placement is the starting point: rank k keeps bin k (no matching)
    local_perm = in_slots(local)
  if method == 'local':
    return local_perm
  return _ring_permutation(lengths, ranks, locality, local_perm, cost)


def _ring_permutation(
  lengths: np.ndarray,
  ranks: int,
  locality: Int[np.ndarray, 'B R'],
  local: Int[np.ndarray, ' B'],
  cost: Callable[[Int[np.ndarray, ' B']], float] | None,
) -> Int[np.ndarray, ' B']:
  """'ring' (see the module docstring): the ring shift of least cost, or `local` (the 'local'
  permutation) where the layouts move rows anyway (`locality`: not every row is on its
  identity rank's devices) or where it costs strictly less."""
  per = len(lengths) // ranks
  identity = np.arange(len(lengths))
  if not (locality[identity, identity // per] > 0).all():
    return local  # the layouts move rows: the balancing's ride along

  def price(perm: np.ndarray) -> float:
    if cost is not None:
      return float(cost(perm))
    return float(rank_loads(lengths, perm, ranks).max())

  best, best_cost = identity, price(identity)
  # j a power of two: every j is a kernel to compile (per bucket), and with the main job's
  # packing cost a j in between did not pack into fewer rows than the powers
  # (docs/results/main-job.md, "The demo with ring balancing").
  for j in (2**i for i in range((per // 2).bit_length())):
    perm = in_slots(ring_bins(lengths, ranks, j))
    c = price(perm)
    if c < best_cost:
      best, best_cost = perm, c
  return local if price(local) < best_cost else best


def rank_loads(
  lengths_B: Lengths, perm: Int[np.ndarray, ' B'] | None, num_ranks: int
) -> Int[np.ndarray, ' R']:
  """[ranks] real tokens each target rank holds after applying `perm` (None: identity)."""
  lengths = _check_lengths(lengths_B, num_ranks)
  placed = lengths if perm is None else lengths[np.asarray(perm)]
  return placed.reshape(num_ranks, -1).sum(axis=1)
