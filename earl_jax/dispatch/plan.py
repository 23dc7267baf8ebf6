"""The routing plan of a dispatch: which device sends which blocks to which device.

Pure numpy and Python: a plan is a deterministic function of (source layout, target layout,
field shapes and dtypes, optional row permutation), so every process computes the same plan
without talking to the others, and no payload is ever touched.

Vocabulary
  rows       B, dimension 0 of every field.
  perm       optional int array [B]: target row i holds source row perm[i].
  group      fields that route identically: same row blocks and same column blocks in source
             and target. [B] fields and [B, T] fields whose T is split in neither layout share a
             group; sequence-sharded fields form their own.
  unit       the smallest block a group moves: one row, or, when T is split differently in the
             two layouts, one row times a chunk of g columns, where g is the gcd of the source
             and target column block widths (so every unit lies inside one source block and one
             target block). A device's local block is a [units, unit...] array by a free reshape
             ([b, t, ...] -> [b * t/g, g, ...]), unit-major.
  route      for every unit a target device needs, the device that sends it. A unit the target
             already holds is copied locally. Otherwise one of the source replicas that hold it
             sends it: for each (target device, source block) the least-loaded replica (by
             bytes sent so far), ties broken towards the replica after the target in ring order,
             so replicated rollout outputs (rows on 'data', replicated over 'tensor') are read
             from every tensor rank, not all from one.
  round      one step of the schedule, shared by all groups: a partial permutation of devices
             (each sends to at most one and receives from at most one; a self pair is a local
             copy) and, per group, a static capacity in units (the buffer every device sends;
             short sends are padded, their padding never read). A small round (at most
             `pack_max_bytes` per device) is "packed": the fields of every group with the same
             item size travel as one buffer of unsigned words in one collective, because on a
             latency-bound link the number of collectives, not the bytes, sets the time (gloo on
             this machine: ~3 ms per extra ppermute). A large round sends one collective per
             field, saving the packing copies (it is bandwidth-bound).
  schedule   the rounds that carry every remote unit.
               static (no permutation): the send graph, weighted by bytes over all groups, is
               edge-coloured into matchings; several colourings are tried (edges in ring-shift
               order, edges by weight, Konig's exact colouring with max-degree colours), each
               also with the big pairs cut into equal chunks (a pair in k rounds sends its next
               units in each), and the cheapest kept (cost = per-round latency + padded bytes).
               Cuts matter when pair sizes are uneven: a round pads every pair to its largest,
               so whole big pairs would fill the small receivers' rounds with padding. Caps are
               exact. When the plan permutes whole blocks between devices, it is one round whose
               self pairs carry the blocks that stay, so the output is the received buffer.
               bucketed (a permutation that changes every step): rounds are the fixed ring
               shifts k = 1..n-1 (device s sends to s+k), each cap rounded up to a capacity
               bucket (a few buckets per octave). The compiled kernel depends only on these
               caps, so a new permutation with the same caps reuses it. When pair sizes are so
               uneven that a colouring (with cuts, same bucketed caps) costs at most
               COLOURING_GAIN of the ring shifts, the colouring is taken; its kernel depends on
               its pairs too.
               all_to_all: one round with every pair and one cap per group (padded), for
               backends whose all-to-all is fast (NCCL); on XLA:CPU with gloo, ppermute rounds
               measured 3-4x faster for the same bytes.
  tables     per device int32 index tables the kernels read: for every round the source units
             to send (or an offset when they are one contiguous run, or nothing when it is the
             whole local block), and for the output the position of every target unit in the
             "pool" [local units, round 0 section, round 1 section, ...] (or an offset into one
             pool region when the output is one contiguous run of it, or nothing when it is a
             whole region). These kinds are static; the tables are data. A plan for a kernel
             that writes into landing buffers (`land`) replaces the gather by the inverse table:
             the slot of every local and every received unit, so each round's buffer is written
             as it arrives ('scatter').

Accounting: `min_bytes` is what must move (every unit a target device lacks, once);
`scheduled_bytes` is what the rounds move including padding. For a static plan with uniform
rounds they are equal; tests check the compiled HLO's collectives against `scheduled_*`.
"""

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import numpy as np

from earl_jax.dispatch.layout import Layout, LayoutError, check_compatible

Collective = Literal['ppermute', 'all_to_all']
# Per-round latency expressed in bytes when comparing schedules (a ppermute round costs about
# this much on top of its payload).
ROUND_COST_BYTES = 256 * 1024
# Rounds up to this size (per device) carry all their fields in one collective. Measured with
# 8 gloo processes on 2 CPU cores: an extra ppermute costs ~3 ms, and packing copies cost about
# as much at ~4 MiB per device (the copies of all processes share the cores). On GPUs
# (collectives ~10-50 us, copies at HBM speed) the break-even is larger; tune per platform.
DEFAULT_PACK_MAX_BYTES = 4 << 20
# A landing plan (`make_plan(land=True)`) writes each round into the landing buffer as it arrives
# only when the rounds receive at least this many bytes per device: below it the gather's
# received buffers, all live at once, stay far under glibc's 32 MiB mmap ceiling and come from
# the reused heap, while the scatter chain compiles about twice as slowly (measured: 0.3 vs
# 0.7 s for a 64 x 1024 RL batch over 7 rounds) and runs no faster.
LAND_MIN_BYTES = 8 << 20
# A permuted (bucketed) plan takes an edge colouring over the ring shifts when it costs at most
# this share of them.
COLOURING_GAIN = 0.8
# The most rounds one pair may be cut into (see _chunkings).
_MAX_CHUNKS = 4


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


@dataclasses.dataclass(frozen=True)
class SendOp:
  """How a group's section of a round is cut from its local units: 'full' (the whole local
  block), 'slice' (a contiguous run at a per-device offset), 'gather' (per-device indices) or
  'none' (the group sends nothing in this round)."""

  kind: Literal['full', 'slice', 'gather', 'none']


@dataclasses.dataclass(frozen=True)
class OutOp:
  """How the output block is read from the pool: 'full' (one region, whole), 'slice' (one
  region at a per-device offset), 'gather' (per-device indices into the whole pool), 'update'
  (the local block with `updates` units overwritten from the pool: the units that stay in their
  slot are not copied when the source is donated) or 'scatter' (a landing buffer the regions
  are written into as they arrive: first `updates` local units, then each round's received
  buffer into its slots, so a round's buffer is dead once written and the next round reuses
  its memory; the kernel holds about one round in flight instead of every received buffer)."""

  kind: Literal['full', 'slice', 'gather', 'update', 'scatter']
  region: int = -1  # 0 = local units, r + 1 = this group's section of round r ('update': 1 =
  # the written units come from the received buffers alone, 0 = from the whole pool)
  updates: int = 0  # 'update': the slots written per device (a capacity bucket, padded);
  # 'scatter': the local units written per device (a power of two, or the exact count)


@dataclasses.dataclass(frozen=True)
class FieldPlan:
  """One field of a group: its leaf index, shapes and per-device block shapes."""

  index: int
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  src_block: tuple[int, ...]
  dst_block: tuple[int, ...]
  unit_shape: tuple[int, ...]

  @property
  def unit_bytes(self) -> int:
    return math.prod(self.unit_shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class GroupPlan:
  """Routing of one group of fields (see the module docstring).

  Attributes:
    fields: the group's fields.
    num_devices: n.
    src_units / dst_units: local units per device in the source / target layout.
    unit_bytes: bytes of one unit summed over the group's fields.
    counts: [n, n] units sent from device s (row) to device d (column); the diagonal counts
      local copies.
    send_ops: one per plan round.
    out_op: how the output is read from the pool.
    send_tables: per plan round, int32 [n, cap] ('gather') or [n] ('slice') or None.
    out_table: int32 [n, dst_units] ('gather'), [n] ('slice'), [n, 2, updates] ('update':
      the slots, then their pool indices; padding slots are dst_units, dropped), [n, 2,
      updates + received units] ('scatter': row 0 the slot of each local unit, then of each
      received unit of every round in pool order; row 1 the local units' indices; padding
      slots are dst_units, dropped) or None.
  """

  fields: tuple[FieldPlan, ...]
  num_devices: int
  src_units: int
  dst_units: int
  unit_bytes: int
  counts: np.ndarray
  send_ops: tuple[SendOp, ...]
  out_op: OutOp
  send_tables: tuple[np.ndarray | None, ...]
  out_table: np.ndarray | None

  def structure(self) -> tuple:
    """The static structure a compiled kernel depends on (tables excluded)."""
    return (
      tuple(
        (f.index, f.shape, f.dtype.str, f.src_block, f.dst_block, f.unit_shape) for f in self.fields
      ),
      self.src_units,
      self.dst_units,
      self.send_ops,
      self.out_op,
    )

  def remote_matrix(self) -> np.ndarray:
    """[n, n] bytes device s must send device d (diagonal zero)."""
    m = self.counts.astype(np.int64) * self.unit_bytes
    np.fill_diagonal(m, 0)
    return m


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """The routing plan of one dispatch (see the module docstring).

  Attributes:
    groups: one GroupPlan per routing group.
    rounds: the schedule, shared by all groups.
    collective: 'ppermute' or 'all_to_all'.
    num_devices: n, the devices of both meshes (same order).
    rows: B.
    static: exact capacities and colouring-based rounds (no permutation), or bucketed
      capacities over fixed ring-shift rounds (a permutation that changes every step; a
      colouring when pair sizes are very uneven).
  """

  groups: tuple[GroupPlan, ...]
  rounds: tuple[Round, ...]
  collective: Collective
  num_devices: int
  rows: int
  static: bool

  def round_bytes(self, r: int) -> int:
    """Bytes of round r's buffer per (source, target) pair."""
    return sum(c * g.unit_bytes for c, g in zip(self.rounds[r].caps, self.groups))

  @functools.cached_property
  def min_matrix(self) -> np.ndarray:
    return sum(
      (g.remote_matrix() for g in self.groups), np.zeros((self.num_devices,) * 2, np.int64)
    )

  @functools.cached_property
  def scheduled_matrix(self) -> np.ndarray:
    """[n, n] bytes the schedule moves from s to d, padding included (diagonal zero)."""
    n = self.num_devices
    m = np.zeros((n, n), np.int64)
    for r, rnd in enumerate(self.rounds):
      size = self.round_bytes(r)
      for s, d in rnd.pairs:
        if s != d:
          m[s, d] += size
    return m

  @property
  def min_bytes(self) -> int:
    """Bytes that must move between devices (each unit a target lacks, once)."""
    return int(self.min_matrix.sum())

  @property
  def scheduled_bytes(self) -> int:
    """Bytes the schedule moves, padding included."""
    return int(self.scheduled_matrix.sum())

  @property
  def bytes_sent(self) -> np.ndarray:
    """[n] minimum bytes each device sends."""
    return self.min_matrix.sum(axis=1)

  @property
  def bytes_received(self) -> np.ndarray:
    """[n] minimum bytes each device receives."""
    return self.min_matrix.sum(axis=0)

  @property
  def scheduled_sent(self) -> np.ndarray:
    return self.scheduled_matrix.sum(axis=1)

  @property
  def scheduled_received(self) -> np.ndarray:
    return self.scheduled_matrix.sum(axis=0)

  @property
  def num_collectives(self) -> int:
    """Collectives the kernel issues: per round, one per item size present when packed, else
    one per field sent."""
    total = 0
    for r in self.rounds:
      fields = [f for c, g in zip(r.caps, self.groups) if c for f in g.fields]
      total += len({f.dtype.itemsize for f in fields}) if r.packed else len(fields)
    return total

  @property
  def is_local(self) -> bool:
    """Whether every target block is already on its device (no communication)."""
    return not self.rounds

  @property
  def is_zero_copy(self) -> bool:
    """Whether every target block is exactly a source block on the same device."""
    return not self.rounds and all(
      g.out_op.kind == 'full' and all(f.src_block == f.dst_block for f in g.fields)
      for g in self.groups
    )

  @functools.cached_property
  def _structure(self) -> tuple:
    return (
      self.num_devices,
      self.rows,
      self.collective,
      self.rounds,
      tuple(g.structure() for g in self.groups),
    )

  def structure(self) -> tuple:
    """The static structure compiled kernels depend on (hashable; tables excluded)."""
    return self._structure

  @functools.cached_property
  def accounting(self) -> dict[str, tuple[int, ...] | int]:
    """Byte counts as plain ints (computed once): min_bytes, bytes_sent / bytes_received and
    scheduled_sent / scheduled_received per device."""
    return {
      'min_bytes': self.min_bytes,
      'bytes_sent': tuple(int(b) for b in self.bytes_sent),
      'bytes_received': tuple(int(b) for b in self.bytes_received),
      'scheduled_sent': tuple(int(b) for b in self.scheduled_sent),
      'scheduled_received': tuple(int(b) for b in self.scheduled_received),
    }

  def summary(self) -> dict:
    """A JSON-friendly summary."""
    return {
      'rows': self.rows,
      'num_devices': self.num_devices,
      'static': self.static,
      'collective': self.collective,
      'rounds': [
        {'pairs': len(r.pairs), 'caps': list(r.caps), 'packed': r.packed} for r in self.rounds
      ],
      'num_collectives': self.num_collectives,
      'groups': [
        {
          'fields': [f.path for f in g.fields],
          'unit_bytes': g.unit_bytes,
          'send_ops': [s.kind for s in g.send_ops],
          'out_op': g.out_op.kind,
        }
        for g in self.groups
      ],
      'min_bytes': self.min_bytes,
      'scheduled_bytes': self.scheduled_bytes,
      'bytes_sent': self.bytes_sent.tolist(),
      'bytes_received': self.bytes_received.tolist(),
    }


# --------------------------------------------------------------------------------- blocks


def _device_blocks(layout: Layout, index: int, shape: tuple[int, ...]) -> np.ndarray:
  """[n, 4] (row start, row stop, col start, col stop) of field `index` on every device, in the
  mesh's flattened device order. Columns are dimension 1 ([0, 1) for 1-D fields)."""
  sharding = layout.sharding(index)
  indices = sharding.devices_indices_map(shape)
  out = np.zeros((layout.num_devices, 4), np.int64)
  for k, device in enumerate(layout.mesh.devices.flat):
    idx = indices[device]
    rows = idx[0].indices(shape[0])
    out[k, 0], out[k, 1] = rows[0], rows[1]
    if len(shape) >= 2:
      cols = idx[1].indices(shape[1])
      out[k, 2], out[k, 3] = cols[0], cols[1]
    else:
      out[k, 2], out[k, 3] = 0, 1
  return out


def check_permutation(perm: np.ndarray | Sequence[int], rows: int) -> np.ndarray:
  """Returns `perm` as int64 [B]; raises LayoutError unless it is a permutation of range(B)."""
  p = np.asarray(perm)
  if p.shape != (rows,) or not np.issubdtype(p.dtype, np.integer):
    raise LayoutError(
      f'A row permutation must be an integer array of shape ({rows},) for a batch of {rows} rows; '
      f'got {p.dtype} {p.shape}.'
    )
  p = p.astype(np.int64)
  seen = np.zeros(rows, bool)
  if rows and (p.min() < 0 or p.max() >= rows):
    raise LayoutError(f'Row permutation has entries outside [0, {rows}).')
  seen[p] = True
  if not seen.all():
    raise LayoutError(
      f'Row permutation of {rows} rows repeats rows (misses {int((~seen).sum())} of them); '
      f'a dispatch never duplicates or drops rows.'
    )
  return p


# --------------------------------------------------------------------------------- routing


def _route(
  rows: int,
  cols: int,
  chunk: int,
  perm: np.ndarray | None,
  src_blocks: np.ndarray,
  dst_blocks: np.ndarray,
  unit_bytes: int,
) -> tuple[np.ndarray, np.ndarray]:
  """For every target device and local target unit: the sending device and its local unit.

  Returns:
    (src_dev, src_unit), each int64 [n, dst_units].
  """
  n = len(src_blocks)
  s_rows = int(src_blocks[0, 1] - src_blocks[0, 0])
  s_cols = int(src_blocks[0, 3] - src_blocks[0, 2])
  s_kc = s_cols // chunk
  s_ncb = cols // s_cols
  block_of_dev = (src_blocks[:, 0] // s_rows) * s_ncb + src_blocks[:, 2] // s_cols
  holders: dict[int, list[int]] = {}
  for s in range(n):
    holders.setdefault(int(block_of_dev[s]), []).append(s)
  load = np.zeros(n, np.int64)
  d_rows = int(dst_blocks[0, 1] - dst_blocks[0, 0])
  d_kc = int(dst_blocks[0, 3] - dst_blocks[0, 2]) // chunk
  n_du = d_rows * d_kc
  src_dev = np.zeros((n, n_du), np.int64)
  src_unit = np.zeros((n, n_du), np.int64)
  u = np.arange(n_du)
  for d in range(n):
    i = dst_blocks[d, 0] + u // d_kc
    ch = dst_blocks[d, 2] // chunk + u % d_kc
    r = i if perm is None else perm[i]
    col = ch * chunk
    blk = (r // s_rows) * s_ncb + col // s_cols
    src_unit[d] = (r % s_rows) * s_kc + (ch - (col // s_cols) * s_kc)
    chosen = np.empty(n_du, np.int64)
    uniq, inverse, sizes = np.unique(blk, return_inverse=True, return_counts=True)
    for j, (b, size) in enumerate(zip(uniq, sizes)):
      hs = holders[int(b)]
      if d in hs:
        pick = d
      else:
        pick = min(hs, key=lambda h: (load[h], (h - d) % n))
        load[pick] += int(size) * unit_bytes
      chosen[inverse == j] = pick
    src_dev[d] = chosen
  return src_dev, src_unit


# --------------------------------------------------------------------------------- schedules


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
    if a not in at_d[d]:
      at_s[s][a], at_d[d][a] = d, s
      continue
    # Flip colours a/b along the alternating path from d: d -a- s1 -b- d2 -a- ...
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
  bucket: tuple[Sequence[int], int] | None = None,
) -> list[Round]:
  """Rounds from an edge colouring of the send graph (bytes over all groups), its pairs possibly
  cut into chunks (`_chunkings`); the cheapest of several colourings and cuts is kept.

  Caps are exact, or with `bucket` = (limits, per_octave) rounded up to capacity buckets. A pair
  cut into k chunks appears in k rounds; each of its rounds carries its next units, up to the cap.
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
        if bucket is not None:
          limits, per_octave = bucket
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


def _uniform_rounds(
  counts: Sequence[np.ndarray], limits: Sequence[int], floor: Mapping[int, Sequence[int]] | None
) -> list[Round]:
  """Every ring shift k = 1..n-1 that carries anything, each with a power-of-two cap per group,
  at least the caps `floor` gives that shift (those of the kernel compiled so far, `stable_floor`):
  a new permutation whose rows fit them has the same structure, so it reuses that kernel."""
  n = len(counts[0])
  floor = floor or {}
  rounds = []
  for k in range(1, n):
    low = floor.get(k, (0,) * len(counts))
    caps = tuple(
      max(capacity_bucket(max(int(c[s, (s + k) % n]) for s in range(n)), limit, 1), f)
      for c, limit, f in zip(counts, limits, low)
    )
    if any(caps):
      rounds.append(Round(pairs=tuple((s, (s + k) % n) for s in range(n)), caps=caps))
  return rounds


def stable_floor(plan: 'Plan') -> dict[int, tuple[int, ...]]:
  """The caps of a stable plan per ring shift k, for `make_plan(floor=...)`; at k = 0 the local
  sections of its 'scatter' outputs (0 for a group without one)."""
  n = plan.num_devices
  floor = {(r.pairs[0][1] - r.pairs[0][0]) % n: r.caps for r in plan.rounds}
  floor[0] = tuple(g.out_op.updates if g.out_op.kind == 'scatter' else 0 for g in plan.groups)
  return floor


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
  groups_fields: Sequence[int],
  unit_bytes: Sequence[int],
  n: int,
  collective: Collective,
  pack_max_bytes: int,
) -> tuple[Round, ...]:
  """Marks the rounds that carry several fields in one collective (see make_plan)."""
  out = []
  for r in rounds:
    sections = sum(f for c, f in zip(r.caps, groups_fields) if c)
    size = sum(c * b for c, b in zip(r.caps, unit_bytes)) * (n if collective == 'all_to_all' else 1)
    out.append(dataclasses.replace(r, packed=sections > 1 and size <= pack_max_bytes))
  # (A packed round issues one collective per item size; see Plan.num_collectives.)
  return tuple(out)


# --------------------------------------------------------------------------------- tables


def _contiguous(rows: np.ndarray) -> bool:
  return len(rows) <= 1 or bool(np.all(np.diff(rows) == 1))


def _send_op(lists: dict[int, np.ndarray], cap: int, n: int, n_su: int, stable: bool):
  """The cheapest op that sends every sender's units in one ppermute round, and its table:
  the whole block, one contiguous run per sender, or (always, when `stable`) a row gather."""
  senders = [u for u in lists.values() if len(u)]
  if not stable:
    if cap == n_su and all(len(u) == n_su and np.array_equal(u, np.arange(n_su)) for u in senders):
      return SendOp('full'), None
    if all(_contiguous(u) for u in senders) and all(
      (u[0] if len(u) else 0) + cap <= n_su for u in lists.values()
    ):
      table = np.zeros((n,), np.int64)
      for s, units in lists.items():
        table[s] = units[0] if len(units) else 0
      return SendOp('slice'), table.astype(np.int32)
  table = np.zeros((n, cap), np.int64)
  for s, units in lists.items():
    table[s, : len(units)] = units
  return SendOp('gather'), table.astype(np.int32)


def _scatter_out(pool_idx, region_of, sizes, local_cap):
  """The 'scatter' output op and its table [n, 2, local_cap + received units] (see OutOp)."""
  n, n_du = pool_idx.shape
  received = int(sum(sizes[1:]))
  table = np.zeros((n, 2, local_cap + received), np.int64)
  table[:, 0, :] = n_du  # padding: out of bounds, dropped by the scatter
  for d in range(n):
    local = np.nonzero(region_of[d] == 0)[0]
    table[d, 0, : len(local)] = local
    table[d, 1, : len(local)] = pool_idx[d, local]
    remote = np.nonzero(region_of[d] > 0)[0]
    # Pool positions past the local region are the received units in pool order.
    table[d, 0, local_cap + pool_idx[d, remote] - sizes[0]] = remote
  return OutOp('scatter', updates=local_cap), table.astype(np.int32)


def _local_cap(region_of: np.ndarray, bucket: tuple[int, int] | None) -> int:
  """Width of a 'scatter' table's local section: the most units a device keeps, exact (static
  plans) or rounded up to a capacity bucket (`bucket` = (per_octave, floor)), so that the
  kernels of a stream of permutations repeat."""
  n_du = region_of.shape[1]
  most = int((region_of == 0).sum(axis=1).max())
  if bucket is None:
    return most
  per_octave, floor = bucket
  return max(capacity_bucket(most, n_du, per_octave), min(floor, n_du))


def _out_op(pool_idx, region_of, offsets, sizes, collective, stable, land=False, bucket=None):
  """The output op: one region read whole or as one run, else the local block with the changed
  slots written, else, with `land` (the kernel writes into landing buffers), a scatter of every
  region into the landing buffer as it arrives (its local section sized by `bucket`, see
  `_local_cap`), else a gather over the pool. When `stable`: always a scatter or a gather."""
  n, n_du = pool_idx.shape
  if land and stable:
    return _scatter_out(pool_idx, region_of, sizes, _local_cap(region_of, bucket))
  regions = np.unique(region_of)
  if len(regions) == 1 and not stable:
    region = int(regions[0])
    local = pool_idx - offsets[region]
    if (region == 0 or collective != 'all_to_all') and all(_contiguous(local[d]) for d in range(n)):
      starts = local[:, 0]
      if np.all(starts == 0) and n_du == sizes[region]:
        return OutOp('full', region), None
      return OutOp('slice', region), starts.astype(np.int32)
  if sizes[0] == n_du and not stable:
    # Slots whose unit is already there (local unit j at slot j) need no write: if at most half
    # of the slots change on every device, write only those into the local block. (Not when
    # `stable`: whether and how wide depends on the permutation, which would multiply kernels.)
    changed = pool_idx != np.arange(n_du)[None, :]
    most = int(changed.sum(axis=1).max())
    if 0 < most <= n_du // 2:
      width = capacity_bucket(most, n_du, per_octave=2)
      # When every written unit was received (none moves within its device), the sources index
      # the received buffers alone (region 1), so the write never reads the block it updates.
      received_only = bool((pool_idx[changed] >= sizes[0]).all())
      shift = sizes[0] if received_only else 0
      table = np.zeros((n, 2, width), np.int64)
      table[:, 0, :] = n_du  # padding: out of bounds, dropped by the scatter
      for d in range(n):
        slots = np.nonzero(changed[d])[0]
        table[d, 0, : len(slots)] = slots
        table[d, 1, : len(slots)] = pool_idx[d, slots] - shift
      region = 1 if received_only else 0
      return OutOp('update', region=region, updates=width), table.astype(np.int32)
  if land:
    return _scatter_out(pool_idx, region_of, sizes, _local_cap(region_of, bucket))
  return OutOp('gather'), pool_idx.astype(np.int32)


def _build_tables(
  g: int,
  src_dev: np.ndarray,
  src_unit: np.ndarray,
  rounds: Sequence[Round],
  collective: Collective,
  n_su: int,
  stable: bool = False,
  land: bool = False,
  bucket: tuple[int, int] | None = None,
) -> tuple[tuple[SendOp, ...], tuple[np.ndarray | None, ...], OutOp, np.ndarray | None]:
  """Send ops and tables of group g for every round, and its output op and table (`stable`:
  row gathers throughout, so that the ops never depend on the permutation; `land` and
  `bucket`: see `_out_op`)."""
  n, n_du = src_dev.shape
  caps = [r.caps[g] for r in rounds]
  sizes = [n_su, *((n * c) if collective == 'all_to_all' else c for c in caps)]
  offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
  pool_idx = np.full((n, n_du), -1, np.int64)  # where each target unit lands in the pool
  region_of = np.full((n, n_du), -1, np.int64)  # 0: local; k + 1: received in round k
  for d in range(n):
    mine = src_dev[d] == d
    pool_idx[d, mine] = src_unit[d, mine]
    region_of[d, mine] = 0
  send_ops, send_tables = [], []
  for k, (rnd, cap) in enumerate(zip(rounds, caps)):
    if not cap:
      send_ops.append(SendOp('none'))
      send_tables.append(None)
      continue
    if collective == 'all_to_all':
      table = np.zeros((n, n * cap), np.int64)
      for s in range(n):
        for d in range(n):
          if s == d:
            continue
          pos = np.nonzero(src_dev[d] == s)[0]
          table[s, d * cap : d * cap + len(pos)] = src_unit[d, pos]
          pool_idx[d, pos] = offsets[k + 1] + s * cap + np.arange(len(pos))
          region_of[d, pos] = k + 1
      send_ops.append(SendOp('gather'))
      send_tables.append(table.astype(np.int32))
      continue
    lists = {}
    for s, d in rnd.pairs:
      # A pair cut into chunks appears in several rounds: each carries its next units (not yet
      # received; a self pair takes the local ones).
      pos = np.nonzero((src_dev[d] == s) & (region_of[d] <= 0))[0][:cap]
      pool_idx[d, pos] = offsets[k + 1] + np.arange(len(pos))
      region_of[d, pos] = k + 1
      lists[s] = src_unit[d, pos]
    op, table = _send_op(lists, cap, n, n_su, stable)
    send_ops.append(op)
    send_tables.append(table)
  if (pool_idx < 0).any():
    raise AssertionError('dispatch plan left target units unrouted')
  out_op, out_table = _out_op(pool_idx, region_of, offsets, sizes, collective, stable, land, bucket)
  return tuple(send_ops), tuple(send_tables), out_op, out_table


# --------------------------------------------------------------------------------- plans


def _block_shape(blocks: np.ndarray, shape: tuple[int, ...], col_split: bool) -> tuple[int, ...]:
  """A device's block of a field: [rows, cols (split or whole), rest...]."""
  rows = int(blocks[0, 1] - blocks[0, 0])
  if len(shape) < 2:
    return (rows,)
  cols = int(blocks[0, 3] - blocks[0, 2]) if col_split else shape[1]
  return (rows, cols, *shape[2:])


@dataclasses.dataclass(frozen=True)
class _Routed:
  """One group of fields with the same block structure, routed unit by unit."""

  fields: tuple[FieldPlan, ...]
  src_units: int
  dst_units: int
  unit_bytes: int
  src_dev: np.ndarray  # [n, dst_units]: the device each target unit comes from
  src_unit: np.ndarray  # [n, dst_units]: its unit index there
  counts: np.ndarray  # [n, n]: units sent from device s to device d


def _checked_structs(src, dst, shapes, dtypes, collective) -> list[jax.ShapeDtypeStruct]:
  check_compatible(src, dst)
  if len(shapes) != len(src.fields) or len(dtypes) != len(src.fields):
    raise LayoutError(
      f'make_plan got {len(shapes)} shapes and {len(dtypes)} dtypes for {len(src.fields)} fields.'
    )
  if collective not in ('ppermute', 'all_to_all'):
    raise ValueError(f"collective must be 'ppermute' or 'all_to_all', got {collective!r}.")
  structs = [jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for s, d in zip(shapes, dtypes)]
  for layout, role in ((src, 'source'), (dst, 'target')):
    layout.check(jax.tree.unflatten(layout.treedef, structs), what=f'batch ({role} layout)')
  return structs


def _group_fields(src: Layout, dst: Layout, structs) -> dict[tuple, list]:
  """Fields grouped by their (source, target) block structure: one routing per group."""
  members: dict[tuple, list[tuple[int, np.ndarray, np.ndarray]]] = {}
  for i, st in enumerate(structs):
    sb = _device_blocks(src, i, st.shape)
    db = _device_blocks(dst, i, st.shape)
    cols = st.shape[1] if len(st.shape) >= 2 else 1
    full_s = np.all(sb[:, 2] == 0) and np.all(sb[:, 3] == cols)
    full_d = np.all(db[:, 2] == 0) and np.all(db[:, 3] == cols)
    if full_s and full_d:
      sb, db = sb.copy(), db.copy()
      sb[:, 2:], db[:, 2:] = (0, 1), (0, 1)
      key = ('rows', sb[:, :2].tobytes(), db[:, :2].tobytes())
    else:
      key = ('cols', cols, sb.tobytes(), db.tobytes())
    members.setdefault(key, []).append((i, sb, db))
  return members


def _route_group(src: Layout, key: tuple, group: list, structs, rows, perm, n) -> _Routed:
  """The unit size of a group, its fields' block shapes, and where every target unit comes from."""
  _, sb, db = group[0]
  col_split = key[0] == 'cols'
  cols = key[1] if col_split else 1
  chunk = math.gcd(int(sb[0, 3] - sb[0, 2]), int(db[0, 3] - db[0, 2])) if col_split else 1
  s_units = int(sb[0, 1] - sb[0, 0]) * (int(sb[0, 3] - sb[0, 2]) // chunk)
  d_units = int(db[0, 1] - db[0, 0]) * (int(db[0, 3] - db[0, 2]) // chunk)
  fields = tuple(
    FieldPlan(
      index=i,
      path=src.fields[i].path,
      shape=structs[i].shape,
      dtype=structs[i].dtype,
      src_block=_block_shape(sb, structs[i].shape, col_split),
      dst_block=_block_shape(db, structs[i].shape, col_split),
      unit_shape=(chunk, *structs[i].shape[2:]) if col_split else tuple(structs[i].shape[1:]),
    )
    for i, _, _ in group
  )
  unit_bytes = sum(f.unit_bytes for f in fields)
  src_dev, src_unit = _route(rows, cols, chunk, perm, sb, db, max(1, unit_bytes))
  counts = np.zeros((n, n), np.int64)
  for d in range(n):
    counts[:, d] = np.bincount(src_dev[d], minlength=n)
  return _Routed(fields, s_units, d_units, unit_bytes, src_dev, src_unit, counts)


def _schedule(
  routed, n, *, collective, static, stable, buckets_per_octave, pack_max_bytes, floor=None
):
  """The collective rounds that carry every group's units (then packed into shared buffers)."""
  counts = [r.counts for r in routed]
  unit_bytes = [r.unit_bytes for r in routed]
  limits = [min(r.src_units, r.dst_units) for r in routed]
  if stable and collective == 'ppermute':
    rounds = _uniform_rounds(counts, limits, floor)
  elif collective == 'all_to_all':
    rounds = _all_to_all_rounds(counts, limits, buckets_per_octave, static)
  elif static:
    rounds = _block_permutation_round([r.src_dev for r in routed], [r.dst_units for r in routed])
    if rounds is None:
      rounds = _colouring_rounds(counts, unit_bytes)
  else:
    rounds = _bucketed_rounds(counts, limits, buckets_per_octave)
    # Ring shifts pad every pair of a shift to its largest; when pair sizes are uneven, a
    # colouring (same bucketed caps) can move much less. It is kept only for a clear gain, since
    # its kernel also depends on the pairs, which a new permutation may change.
    coloured = _colouring_rounds(counts, unit_bytes, bucket=(limits, buckets_per_octave))
    if _schedule_cost(coloured, unit_bytes) <= COLOURING_GAIN * _schedule_cost(rounds, unit_bytes):
      rounds = coloured
  return _pack(rounds, [len(r.fields) for r in routed], unit_bytes, n, collective, pack_max_bytes)


def make_plan(
  src: Layout,
  dst: Layout,
  shapes: Sequence[tuple[int, ...]],
  dtypes: Sequence[np.dtype],
  *,
  perm: np.ndarray | Sequence[int] | None = None,
  static: bool | None = None,
  collective: Collective = 'ppermute',
  buckets_per_octave: int = 4,
  pack_max_bytes: int = DEFAULT_PACK_MAX_BYTES,
  stable: bool = False,
  floor: Mapping[int, Sequence[int]] | None = None,
  land: bool = False,
  land_min_bytes: int = LAND_MIN_BYTES,
) -> Plan:
  """Computes the routing plan of moving a batch from `src` to `dst`.

  Args:
    src: the source layout.
    dst: the target layout (same devices, same order, same fields).
    shapes: the global shape of every field, in layout order.
    dtypes: the dtype of every field, in layout order.
    perm: optional int [B]: target row i holds source row perm[i].
    static: exact capacities over an edge colouring (default when perm is None), or bucketed
      capacities over fixed ring shifts (default with a permutation; over a colouring when
      that costs at most COLOURING_GAIN of them).
    collective: 'ppermute' rounds or one 'all_to_all'.
    buckets_per_octave: capacity buckets per power of two for non-static plans.
    pack_max_bytes: a round whose buffer (per device) is at most this many bytes carries all
      its fields in one collective (one uint8 buffer); larger rounds send one collective per
      field and avoid the packing copies (they are bandwidth-bound, not latency-bound).
    stable: for a permutation: the ring shifts with power-of-two caps per group and row
      gathers throughout, so that a kernel compiled for one permutation serves every other whose
      rows fit its caps (more padding on the wire; the tables carry the permutation).
    floor: stable only: the least caps per ring shift (`stable_floor` of the previous plan for
      the same layouts and shapes). Caps then only grow, so a stream of permutations settles on
      one kernel whose caps fit them all, each shift padded only to what it carried.
    land: the kernel writes its outputs into landing buffers (`make_kernel(recycle=True)`): an
      output that would be a gather over the pool of received buffers is instead a 'scatter'
      (OutOp) into the landing buffer, round by round, so only about one round's buffers are
      live at a time. Its local section is exact (static), bucketed (a permutation) or a power
      of two that only grows (stable, floor key 0). Only when the rounds receive at least
      `land_min_bytes` per device (their capacities, so a stable kernel's choice only changes
      when its caps grow); smaller plans keep the gather.

  Returns:
    The Plan.

  Raises:
    LayoutError: incompatible layouts, fields that do not divide, a bad permutation.
  """
  structs = _checked_structs(src, dst, shapes, dtypes, collective)
  rows = structs[0].shape[0]
  p = None if perm is None else check_permutation(perm, rows)
  if p is not None and np.array_equal(p, np.arange(rows)):
    p = None
  static = (perm is None) if static is None else static
  n = src.num_devices
  routed = [
    _route_group(src, key, group, structs, rows, p, n)
    for key, group in _group_fields(src, dst, structs).items()
  ]
  stable = stable and p is not None and not static
  rounds = _schedule(
    routed,
    n,
    collective=collective,
    static=static,
    stable=stable,
    buckets_per_octave=buckets_per_octave,
    pack_max_bytes=pack_max_bytes,
    floor=floor if stable else None,
  )
  per_pair = n if collective == 'all_to_all' else 1
  received = sum(c * r.unit_bytes * per_pair for rnd in rounds for c, r in zip(rnd.caps, routed))
  land = land and received >= land_min_bytes
  groups = []
  for g, r in enumerate(routed):
    if static:
      bucket = None
    elif stable:
      bucket = (1, (floor or {}).get(0, (0,) * len(routed))[g])
    else:
      bucket = (buckets_per_octave, 0)
    send_ops, send_tables, out_op, out_table = _build_tables(
      g, r.src_dev, r.src_unit, rounds, collective, r.src_units, stable, land, bucket
    )
    groups.append(
      GroupPlan(
        fields=r.fields,
        num_devices=n,
        src_units=r.src_units,
        dst_units=r.dst_units,
        unit_bytes=r.unit_bytes,
        counts=r.counts,
        send_ops=send_ops,
        out_op=out_op,
        send_tables=send_tables,
        out_table=out_table,
      )
    )
  return Plan(
    groups=tuple(groups),
    rounds=rounds,
    collective=collective,
    num_devices=n,
    rows=rows,
    static=static,
  )
