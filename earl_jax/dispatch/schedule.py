"""The schedule of a plan: the collective rounds that carry every remote unit (pure numpy).

A round is one step shared by all groups: a partial permutation of devices (each sends to at
most one and receives from at most one; a self pair is a local copy) and, per group, a static
capacity in units (the buffer every device sends; short sends are padded, their padding never
read). Which rounds, by the plan's options (`PlanOptions`):

  static     (no permutation) the send graph, weighted by bytes over all groups, edge-coloured
             into matchings; several colourings are tried (edges in ring-shift order, edges by
             weight, Konig's exact colouring with max-degree colours), each also with the big
             pairs cut into equal chunks (a pair in k rounds sends its next units in each), and
             the cheapest kept (cost = per-round latency + padded bytes). Cuts matter when pair
             sizes are uneven: a round pads every pair to its largest. Caps are exact. When the
             plan permutes whole blocks between devices, it is one round whose self pairs carry
             the blocks that stay, so the output is the received buffer.
  bucketed   (a permutation that changes every step) the fixed ring shifts k = 1..n-1 (device s
             sends to s+k), each cap rounded up to a capacity bucket, so a new permutation with
             the same caps reuses the compiled kernel; a colouring (same bucketed caps) when it
             costs at most COLOURING_GAIN of the ring shifts.
  stable     (a permutation that changes every step, and a kernel that should not) a capacity
             per (source, target) pair and group: the pair's units rounded up to a capacity
             bucket, at least the capacity of the kernel compiled so far (`floor`, a `Floor`),
             so a stream of permutations settles on one kernel; the rounds are a colouring of
             those capacities (merging pairs of different capacities into one round only where
             that pads at most FIT_SLACK of them), so a pair that carries nothing costs nothing.
             With fit='shifts' (the earlier policy, kept for comparison) every ring shift gets
             one power-of-two capacity instead, and all n pairs of a shift send it.
  all_to_all one round with every pair and one cap per group, for backends whose all-to-all is
             fast (NCCL); on XLA:CPU with gloo, ppermute rounds are faster
             (docs/results/tried.md).

A small round (at most `pack_max_bytes` per device) is packed: the fields of every group with
the same item size travel as one buffer of unsigned words in one collective, because on a
latency-bound link the number of collectives, not the bytes, sets the time. A large round sends
one collective per field, saving the packing copies.
"""

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from earl_jax.dispatch.routing import RoutedGroup
from earl_jax.errors import ConfigError

Collective = Literal['ppermute', 'all_to_all']
# Per-round latency expressed in bytes when comparing schedules (a ppermute round costs about
# this much on top of its payload).
ROUND_COST_BYTES = 256 * 1024
# Rounds up to this size (per device) carry all their fields in one collective: on gloo over
# 2 CPU cores an extra collective costs about what packing copies cost at this size
# (docs/results/from-docstrings.md, "Plan defaults"). On GPUs the break-even is larger; tune
# per platform.
DEFAULT_PACK_MAX_BYTES = 4 << 20
# A landing plan writes each round into the landing buffer as it arrives only when the rounds
# receive at least this many bytes per device: below it the gather's received buffers stay far
# under glibc's 32 MiB mmap ceiling and come from the reused heap, while the scatter chain
# compiles more slowly and runs no faster (docs/results/from-docstrings.md, "Plan defaults").
LAND_MIN_BYTES = 8 << 20
# A permuted (bucketed) plan takes an edge colouring over the ring shifts when it costs at most
# this share of them.
COLOURING_GAIN = 0.8
# The most rounds one pair may be cut into (see _chunkings).
_MAX_CHUNKS = 4
# A stable plan's rounds may pad its pair capacities by at most this share (see _capacity_rounds).
FIT_SLACK = 0.25
# A stable plan that grows provisions the pairs later permutations may use while its wire stays
# within this share of the padding `PlanOptions.max_padding` allows (the rest is headroom for
# smaller moves).
SPECULATE_SHARE = 0.75

Fit = Literal['pairs', 'shifts']


@dataclasses.dataclass(frozen=True, eq=False)
class Floor:
  """The capacities of a stable kernel, the least capacities of the next plan for the same
  layouts and shapes (`Plan.floor`).

  Attributes:
    pairs: per group, int64 [n, n]: the units each (source, target) pair can carry (diagonal 0).
    local: per group, the width of its 'scatter' output's local section (0 without one).
  """

  pairs: tuple[np.ndarray, ...]
  local: tuple[int, ...]

  def __post_init__(self):
    pairs = tuple(np.array(p, np.int64) for p in self.pairs)
    if len(pairs) != len(self.local) or any(
      p.ndim != 2 or p.shape[0] != p.shape[1] or (p < 0).any() for p in pairs
    ):
      raise ConfigError(
        f'Floor needs one non-negative [n, n] capacity matrix and one local width per group; got '
        f'{[p.shape for p in pairs]} and {len(self.local)} widths.'
      )
    for p in pairs:
      p.setflags(write=False)
    object.__setattr__(self, 'pairs', pairs)
    object.__setattr__(self, 'local', tuple(int(w) for w in self.local))

  def fits(self, other: 'Floor') -> bool:
    """Whether every capacity of `other` is at most this floor's (same groups and devices)."""
    return (
      len(self.pairs) == len(other.pairs)
      and all(a.shape == b.shape and bool((b <= a).all()) for a, b in zip(self.pairs, other.pairs))
      and all(b <= a for a, b in zip(self.local, other.local))
    )

  def merged(self, other: 'Floor') -> 'Floor':
    """The elementwise maximum of two floors of the same plan shape."""
    return Floor(
      pairs=tuple(np.maximum(a, b) for a, b in zip(self.pairs, other.pairs)),
      local=tuple(max(a, b) for a, b in zip(self.local, other.local)),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
  """How `make_plan` schedules a dispatch and builds its tables.

  Attributes:
    static: exact capacities over an edge colouring (default when there is no permutation), or
      bucketed capacities over fixed ring shifts (default with a permutation; over a colouring
      when that costs at most COLOURING_GAIN of them).
    collective: 'ppermute' rounds or one 'all_to_all'.
    buckets_per_octave: capacity buckets per power of two for non-static plans.
    pack_max_bytes: a round whose buffer (per device) is at most this many bytes carries all
      its fields in one collective (one buffer of words); larger rounds send one collective per
      field and avoid the packing copies (they are bandwidth-bound, not latency-bound).
    stable: for a permutation: capacities per (source, target) pair (see `fit`) and row
      gathers throughout, so that a kernel compiled for one permutation serves every other whose
      rows fit its capacities (the tables carry the permutation).
    fit: stable only: 'pairs' (each pair's units rounded up to a capacity bucket, rounds from
      an edge colouring of those capacities) or 'shifts' (the ring shifts, each with one
      power-of-two capacity that every pair of the shift sends; the earlier policy, more
      padding, kept for comparison).
    max_padding: stable only, fit 'pairs': a growing plan provisions the pairs later
      permutations may use only while its wire stays within 1 + SPECULATE_SHARE * (max_padding
      - 1) times the bytes that must move (`stable_capacities`).
    floor: stable only: the least capacities (`Plan.floor` of the previous plan for the same
      layouts and shapes, or a smaller one to shed capacity the recent moves no longer use).
      A permutation whose units fit the floor gets exactly the floor's rounds (the same kernel);
      one that does not raises only the capacities it needs.
    land: the kernel writes its outputs into landing buffers (`landing.make_recycling_kernel`):
      an output that would be a gather over the pool of received buffers is instead a 'scatter'
      (OutOp) into the landing buffer, round by round, so only about one round's buffers are
      live at a time. Its local section is exact (static), bucketed (a permutation) or a power
      of two that only grows (stable, `Floor.local`). Only when the rounds receive at least
      `land_min_bytes` per device (their capacities, so a stable kernel's choice only changes
      when its caps grow); smaller plans keep the gather.
    land_min_bytes: see `land`.
  """

  static: bool | None = None
  collective: Collective = 'ppermute'
  buckets_per_octave: int = 4
  pack_max_bytes: int = DEFAULT_PACK_MAX_BYTES
  stable: bool = False
  fit: Fit = 'pairs'
  floor: Floor | None = None
  max_padding: float = 1.5
  land: bool = False
  land_min_bytes: int = LAND_MIN_BYTES

  def __post_init__(self):
    if self.collective not in ('ppermute', 'all_to_all'):
      raise ConfigError(
        f"PlanOptions.collective must be 'ppermute' or 'all_to_all', got {self.collective!r}."
      )
    for name, least in (('buckets_per_octave', 1), ('pack_max_bytes', 0), ('land_min_bytes', 0)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f'PlanOptions.{name} must be an int >= {least}, got {value!r}.')
    if self.stable and self.static:
      raise ConfigError(
        'PlanOptions.stable=True needs a bucketed plan (static=None or False), got static=True.'
      )
    if (
      isinstance(self.max_padding, bool)
      or not isinstance(self.max_padding, (int, float))
      or not self.max_padding >= 1
    ):
      raise ConfigError(f'PlanOptions.max_padding must be a number >= 1, got {self.max_padding!r}.')
    if self.fit not in ('pairs', 'shifts'):
      raise ConfigError(f"PlanOptions.fit must be 'pairs' or 'shifts', got {self.fit!r}.")
    if self.floor is not None:
      if not self.stable:
        raise ConfigError('PlanOptions.floor is for stable plans only; got stable=False.')
      if not isinstance(self.floor, Floor):
        raise ConfigError(
          f'PlanOptions.floor must be a Floor (Plan.floor of an earlier plan), got '
          f'{type(self.floor).__name__}.'
        )


@dataclasses.dataclass(frozen=True)
class Round:
  """One collective step shared by every group.

  Attributes:
    pairs: (source, target) device indices; a partial permutation for ppermute (self pairs are
      local copies), every ordered pair for all_to_all.
    caps: units per buffer for each group (0: the group sends nothing in this round).
    packed: all sections (every field of every group with cap > 0) travel as one uint8 buffer
      in one collective; otherwise one collective per field.
  """

  pairs: tuple[tuple[int, int], ...]
  caps: tuple[int, ...]
  packed: bool = False


def capacity_bucket(count: int, limit: int, per_octave: int) -> int:
  """Rounds `count` up to a capacity bucket: at most `per_octave` buckets per power of two
  (so at most 1/per_octave padding), never above `limit`; 0 stays 0."""
  if count <= 0:
    return 0
  step = 1 << max(0, count.bit_length() - 1 - max(0, per_octave.bit_length() - 1))
  return min(limit, -(-count // step) * step)


def _greedy_colouring(edges: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
  """First-fit: each edge (s, d, w) joins the first round where s sends and d receives nothing."""
  rounds: list[list[tuple[int, int, int]]] = []
  busy: list[tuple[set[int], set[int]]] = []
  for s, d, w in edges:
    for k, (senders, receivers) in enumerate(busy):
      if s not in senders and d not in receivers:
        rounds[k].append((s, d, w))
        senders.add(s)
        receivers.add(d)
        break
    else:
      rounds.append([(s, d, w)])
      busy.append(({s}, {d}))
  return rounds


def _flip_alternating_path(
  at_s: list[dict[int, int]], at_d: list[dict[int, int]], d: int, a: int, b: int
) -> None:
  """Swaps colours a and b along the alternating path from target d: d -a- s1 -b- d2 -a- ...
  (`at_s[s][c]` is the target sender s reaches with colour c, `at_d[d][c]` the sender)."""
  path = []
  node, side, c = d, 'd', a
  while True:
    table = at_d if side == 'd' else at_s
    if c not in table[node]:
      break
    nxt = table[node][c]
    path.append((node, side, c, nxt))
    node, side = nxt, ('s' if side == 'd' else 'd')
    c = b if c == a else a
  for node, side, c, nxt in path:
    if side == 'd':
      del at_d[node][c]
      del at_s[nxt][c]
    else:
      del at_s[node][c]
      del at_d[nxt][c]
  for node, side, c, nxt in path:
    c2 = b if c == a else a
    if side == 'd':
      at_d[node][c2], at_s[nxt][c2] = nxt, node
    else:
      at_s[node][c2], at_d[nxt][c2] = nxt, node


def _konig_colouring(edges: list[tuple[int, int, int]], n: int) -> list[list[tuple[int, int, int]]]:
  """Konig's bipartite edge colouring with exactly max-degree colours (alternating paths)."""
  if not edges:
    return []
  deg_s = np.bincount([e[0] for e in edges], minlength=n)
  deg_d = np.bincount([e[1] for e in edges], minlength=n)
  colours = int(max(deg_s.max(), deg_d.max()))
  # at_s[s][c] = d using colour c at sender s; at_d[d][c] = s.
  at_s: list[dict[int, int]] = [{} for _ in range(n)]
  at_d: list[dict[int, int]] = [{} for _ in range(n)]
  for s, d, _ in edges:
    a = next(c for c in range(colours) if c not in at_s[s])
    b = next(c for c in range(colours) if c not in at_d[d])
    if a in at_d[d]:
      _flip_alternating_path(at_s, at_d, d, a, b)
    at_s[s][a], at_d[d][a] = d, s
  weight = {(s, d): w for s, d, w in edges}
  out: list[list[tuple[int, int, int]]] = [[] for _ in range(colours)]
  for s in range(n):
    for c, d in at_s[s].items():
      out[c].append((s, d, weight[(s, d)]))
  return [r for r in out if r]


def _chunkings(weight: np.ndarray) -> list[np.ndarray]:
  """Ways to cut each pair's bytes into equal chunks, each chunk its own edge of the send graph.

  A round pads every pair to its largest one, so when pair sizes are uneven (a device that
  receives from few devices, each a lot, beside one that receives a little from many), whole
  pairs leave the small receivers' rounds mostly padding. Cut into chunks near the small pairs'
  size, every round carries about one chunk per pair and a device's rounds add up to about what
  it must receive (preemptive scheduling: with equal chunks the rounds are max-degree matchings).
  Returns [n, n] chunk counts, the first one all ones (no cut); a cut that would make a pair more
  than `_MAX_CHUNKS` chunks is skipped.
  """
  off = weight[weight > 0]
  out = [np.where(weight > 0, 1, 0)]
  if not off.size:
    return out
  seen = {tuple(out[0].ravel())}
  for quantum in (int(off.min()), int(off.max()) // 2, int(off.max()) // 4):
    if quantum <= 0:
      continue
    # Within 1/8 of a whole number of quanta is that number (a pair of rows that also carries
    # a few [B] fields is not cut in two for them).
    chunks = np.where(weight > 0, np.maximum(1, -(-8 * weight // (9 * quantum))), 0)
    key = tuple(chunks.ravel())
    if chunks.max() <= _MAX_CHUNKS and key not in seen:
      seen.add(key)
      out.append(chunks)
  return out


def _colouring_rounds(
  counts: Sequence[np.ndarray],
  unit_bytes: Sequence[int],
  limits: Sequence[int] | None = None,
  per_octave: int = 0,
) -> list[Round]:
  """Rounds from an edge colouring of the send graph (bytes over all groups), its pairs possibly
  cut into chunks (`_chunkings`); the cheapest of several colourings and cuts is kept.

  Caps are exact, or with `limits` rounded up to capacity buckets (`per_octave`, each at most
  its group's limit). A pair cut into k chunks appears in k rounds; each of its rounds carries
  its next units, up to the cap.
  """
  n = len(counts[0])
  weight = sum(c.astype(np.int64) * max(1, b) for c, b in zip(counts, unit_bytes))
  np.fill_diagonal(weight, 0)
  if not weight.any():
    return []
  best = None
  for chunks in _chunkings(weight):
    edges = [
      (s, d, int(-(-weight[s, d] // chunks[s, d])))
      for s in range(n)
      for d in range(n)
      for _ in range(chunks[s, d])
    ]
    # Per group, the units of one chunk of each pair.
    chunk_units = [np.where(chunks > 0, -(-c // np.maximum(chunks, 1)), 0) for c in counts]
    colourings = [
      _greedy_colouring(sorted(edges, key=lambda e: ((e[1] - e[0]) % n, e[0]))),
      _greedy_colouring(sorted(edges, key=lambda e: (-e[2], (e[1] - e[0]) % n, e[0]))),
      _konig_colouring(sorted(edges, key=lambda e: (-e[2], e[0], e[1])), n),
    ]
    for colouring in colourings:
      rounds = []
      for r in colouring:
        pairs = tuple(sorted((s, d) for s, d, _ in r))
        caps = [max(int(u[s, d]) for s, d in pairs) for u in chunk_units]
        if limits is not None:
          caps = [capacity_bucket(c, limit, per_octave) for c, limit in zip(caps, limits)]
        rounds.append(Round(pairs=pairs, caps=tuple(caps)))
      rounds.sort(key=lambda r: -sum(c * b for c, b in zip(r.caps, unit_bytes)))
      cost = _schedule_cost(rounds, unit_bytes)
      if best is None or cost < best[0]:
        best = (cost, rounds)
  assert best is not None
  return best[1]


def _schedule_cost(rounds: Sequence[Round], unit_bytes: Sequence[int]) -> int:
  """What a schedule costs, in bytes: each round's per-pair buffer plus its latency."""
  return sum(ROUND_COST_BYTES + sum(c * b for c, b in zip(r.caps, unit_bytes)) for r in rounds)


def _block_permutation_round(
  src_devs: Sequence[np.ndarray], dst_units: Sequence[int]
) -> list[Round] | None:
  """One round with self-pairs when the plan permutes whole target blocks between devices.

  When, in every group, every device receives its entire target block from one device, the
  same device for every group, and no device sends to two, the plan is a permutation of
  devices. Sending the devices that keep their block to themselves in the same
  collective-permute makes the round's buffer the output on every device (no select, no
  gather, no copy); XLA performs a self-pair as a local copy, and it is not counted as moved.
  """
  n = len(src_devs[0])
  sources = []
  for d in range(n):
    s = np.unique(np.concatenate([sd[d] for sd in src_devs]))
    if len(s) != 1:
      return None
    sources.append(int(s[0]))
  if len(set(sources)) != n or all(sources[d] == d for d in range(n)):
    return None
  if all(sources[d] != d for d in range(n)):
    return None  # no device keeps its block: the ordinary schedule is this round already
  pairs = tuple(sorted((sources[d], d) for d in range(n)))
  return [Round(pairs=pairs, caps=tuple(dst_units))]


def _bucketed_rounds(
  counts: Sequence[np.ndarray], limits: Sequence[int], per_octave: int
) -> list[Round]:
  """Fixed ring shifts k = 1..n-1 with bucketed caps per group; empty shifts are dropped."""
  n = len(counts[0])
  rounds = []
  for k in range(1, n):
    pairs = tuple((s, (s + k) % n) for s in range(n))
    caps = tuple(
      capacity_bucket(max(int(c[s, (s + k) % n]) for s in range(n)), limit, per_octave)
      for c, limit in zip(counts, limits)
    )
    if any(caps):
      rounds.append(Round(pairs=pairs, caps=caps))
  return rounds


def pair_needs(
  counts: Sequence[np.ndarray], limits: Sequence[int], fit: Fit, per_octave: int
) -> list[np.ndarray]:
  """Per group, the int64 [n, n] capacities these units need alone (diagonal 0): each pair's
  units rounded up to a capacity bucket (fit 'pairs'), or every pair of ring shift k the
  power-of-two bucket of the shift's largest pair ('shifts')."""
  n = len(counts[0])
  out = []
  for c, limit in zip(counts, limits):
    off = np.asarray(c, np.int64).copy()
    np.fill_diagonal(off, 0)
    cap = np.zeros((n, n), np.int64)
    if fit == 'pairs':
      for s, d in zip(*np.nonzero(off)):
        cap[s, d] = capacity_bucket(int(off[s, d]), limit, per_octave)
    else:
      senders = np.arange(n)
      for k in range(1, n):
        targets = (senders + k) % n
        cap[senders, targets] = capacity_bucket(int(off[senders, targets].max()), limit, 1)
    out.append(cap)
  return out


def stable_capacities(groups: Sequence[RoutedGroup], options: PlanOptions) -> list[np.ndarray]:
  """Per group, the int64 [n, n] capacities of a stable plan (diagonal 0).

  The floor's, when the units fit it (the same rounds, the same kernel). Otherwise the floor
  raised to what the units need (`pair_needs`); with fit 'pairs' the growth also provisions the
  pairs a later permutation may use (`RoutedGroup.reach`), at the largest capacity the growth
  needed for which the plan's rounds stay within SPECULATE_SHARE of the padding
  `options.max_padding` allows (else at one unit, else not at all): one growth instead of one
  per pair."""
  counts = [np.asarray(g.counts, np.int64) for g in groups]
  limits = [min(g.src_units, g.dst_units) for g in groups]
  need = pair_needs(counts, limits, options.fit, options.buckets_per_octave)
  floor = options.floor
  if floor is not None:
    n = len(counts[0])
    if len(floor.pairs) != len(need) or any(f.shape != c.shape for f, c in zip(floor.pairs, need)):
      raise ConfigError(
        f'PlanOptions.floor is for {len(floor.pairs)} groups over {floor.pairs[0].shape[0]} '
        f'devices, but this plan has {len(need)} groups over {n}: a floor serves only the '
        f'layouts and shapes of the plan it came from.'
      )
    if all((c <= f).all() for c, f in zip(need, floor.pairs)):
      return [f.copy() for f in floor.pairs]
    caps = [np.maximum(c, f) for c, f in zip(need, floor.pairs)]
    grown = [c > f for c, f in zip(need, floor.pairs)]
  else:
    caps, grown = need, [c > 0 for c in need]
  if options.fit != 'pairs' or any(g.reach is None for g in groups):
    return caps
  unit_bytes = [max(1, g.unit_bytes) for g in groups]
  moved = sum(int(c.sum() - np.trace(c)) * b for c, b in zip(counts, unit_bytes))
  # Candidate levels per group: the capacities the growth needed, largest first, then one unit.
  grown_caps = [sorted({int(v) for v in c[g]}, reverse=True) for c, g in zip(caps, grown)]
  deepest = max(len(v) for v in grown_caps)
  candidates = [[v[min(i, len(v) - 1)] if v else 0 for v in grown_caps] for i in range(deepest)]
  candidates.append([1 if v else 0 for v in grown_caps])
  within = 1 + SPECULATE_SHARE * (options.max_padding - 1)
  for levels in candidates:
    trial = [np.maximum(c, np.where(g.reach, lv, 0)) for c, g, lv in zip(caps, groups, levels)]
    if _wire_bytes(_capacity_rounds(trial, unit_bytes), unit_bytes) <= within * moved:
      return trial
  return caps


def _shift_rounds(capacities: Sequence[np.ndarray]) -> list[Round]:
  """The ring shifts k = 1..n-1 that carry anything, each with its capacity per group (fit
  'shifts': every pair of a shift has the same)."""
  n = len(capacities[0])
  senders = np.arange(n)
  rounds = []
  for k in range(1, n):
    caps = tuple(int(c[senders, (senders + k) % n].max()) for c in capacities)
    if any(caps):
      rounds.append(Round(pairs=tuple((s, (s + k) % n) for s in range(n)), caps=caps))
  return rounds


def _exact_rounds(capacities: Sequence[np.ndarray], unit_bytes: Sequence[int]) -> list[Round]:
  """Rounds that pad nothing: the pairs with the same capacities (in every group) are
  edge-coloured together (Konig: their max degree of rounds), largest rounds first."""
  n = len(capacities[0])
  classes: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
  for s in range(n):
    for d in range(n):
      caps = tuple(int(c[s, d]) for c in capacities)
      if s != d and any(caps):
        classes.setdefault(caps, []).append((s, d, 1))
  rounds = []
  for caps in sorted(classes, key=lambda k: (-sum(c * b for c, b in zip(k, unit_bytes)), k)):
    for r in _konig_colouring(classes[caps], n):
      rounds.append(Round(pairs=tuple(sorted((s, d) for s, d, _ in r)), caps=caps))
  return rounds


def _wire_bytes(rounds: Sequence[Round], unit_bytes: Sequence[int]) -> int:
  """Bytes the rounds put on the wire: every pair between two devices sends its round's buffer."""
  return sum(
    sum(s != d for s, d in r.pairs) * sum(c * b for c, b in zip(r.caps, unit_bytes)) for r in rounds
  )


def _capacity_rounds(capacities: Sequence[np.ndarray], unit_bytes: Sequence[int]) -> list[Round]:
  """The rounds of a stable plan (fit 'pairs'): every pair carries at least its capacity.

  The cheapest colouring of the capacities (`_colouring_rounds`: round latency plus padded
  bytes; it may put pairs of different capacities in one round) when it pads them by at most
  FIT_SLACK, else the rounds that pad nothing (`_exact_rounds`). Either way, a deterministic
  function of the capacities: the same capacities give the same kernel."""
  exact = _exact_rounds(capacities, unit_bytes)
  if not exact:
    return []
  coloured = _colouring_rounds(capacities, unit_bytes)
  needed = sum(int(c.sum()) * b for c, b in zip(capacities, unit_bytes))
  if _wire_bytes(coloured, unit_bytes) <= (1 + FIT_SLACK) * needed and _schedule_cost(
    coloured, unit_bytes
  ) < _schedule_cost(exact, unit_bytes):
    return coloured
  return exact


def _all_to_all_rounds(
  counts: Sequence[np.ndarray], limits: Sequence[int], per_octave: int, static: bool
) -> list[Round]:
  n = len(counts[0])
  caps = []
  for c, limit in zip(counts, limits):
    off = c.copy()
    np.fill_diagonal(off, 0)
    top = int(off.max()) if n > 1 else 0
    caps.append(top if static else capacity_bucket(top, limit, per_octave))
  if not any(caps):
    return []
  return [Round(pairs=tuple((s, d) for s in range(n) for d in range(n)), caps=tuple(caps))]


def _pack(
  rounds: list[Round],
  fields_per_group: Sequence[int],
  unit_bytes: Sequence[int],
  n: int,
  options: PlanOptions,
) -> tuple[Round, ...]:
  """Marks the rounds that carry several fields in one collective (see the module docstring).
  A packed round issues one collective per item size; see Plan.num_collectives."""
  out = []
  for r in rounds:
    sections = sum(f for c, f in zip(r.caps, fields_per_group) if c)
    size = sum(c * b for c, b in zip(r.caps, unit_bytes))
    size *= n if options.collective == 'all_to_all' else 1
    out.append(dataclasses.replace(r, packed=sections > 1 and size <= options.pack_max_bytes))
  return tuple(out)


def schedule(
  groups: Sequence[RoutedGroup],
  n: int,
  options: PlanOptions,
  capacities: Sequence[np.ndarray] | None = None,
) -> tuple[Round, ...]:
  """The collective rounds that carry every group's units (then packed into shared buffers).

  `options` are resolved (`static` a bool; `stable` only for a permutation, see make_plan);
  `capacities` are a stable plan's (`stable_capacities`), needed when `options.stable`."""
  counts = [g.counts for g in groups]
  unit_bytes = [g.unit_bytes for g in groups]
  limits = [min(g.src_units, g.dst_units) for g in groups]
  if options.stable and options.collective == 'ppermute':
    assert capacities is not None, 'a stable plan needs its capacities (stable_capacities)'
    if options.fit == 'shifts':
      rounds = _shift_rounds(capacities)
    else:
      rounds = _capacity_rounds(capacities, [max(1, b) for b in unit_bytes])
  elif options.collective == 'all_to_all':
    rounds = _all_to_all_rounds(counts, limits, options.buckets_per_octave, bool(options.static))
  elif options.static:
    rounds = _block_permutation_round([g.src_dev for g in groups], [g.dst_units for g in groups])
    if rounds is None:
      rounds = _colouring_rounds(counts, unit_bytes)
  else:
    rounds = _bucketed_rounds(counts, limits, options.buckets_per_octave)
    # Ring shifts pad every pair of a shift to its largest; when pair sizes are uneven, a
    # colouring (same bucketed caps) can move much less. It is kept only for a clear gain, since
    # its kernel also depends on the pairs, which a new permutation may change.
    coloured = _colouring_rounds(counts, unit_bytes, limits, options.buckets_per_octave)
    if _schedule_cost(coloured, unit_bytes) <= COLOURING_GAIN * _schedule_cost(rounds, unit_bytes):
      rounds = coloured
  return _pack(rounds, [len(g.fields) for g in groups], unit_bytes, n, options)
