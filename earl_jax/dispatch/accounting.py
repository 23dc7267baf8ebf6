"""Accounting: what a dispatch moved and how long it took, and the collectives in compiled HLO.

Every dispatch returns a `DispatchReport`: the strategy that ran, the wall time (when the
dispatcher was asked to time it, which blocks until the result is ready), and the bytes each
device sends and receives according to the plan: the minimum that must move, and for the
layout-aware kernels what the schedule moves including padding.

`hlo_collectives` reads the collectives of compiled HLO text
(`jax.jit(f).lower(...).compile().as_text()`) and their result buffer sizes, so tests can check
that the compiled kernels move exactly the bytes the plan says, and the benchmark can show what
XLA's own resharding moves:

  collective-permute   device t receives the result buffer from s, for every pair (s, t), s != t
  all-to-all           each member of a group of g receives (g - 1) / g of the result
  all-gather           each member receives (g - 1) / g of the result
  all-reduce, reduce-scatter
                       counted, with (g - 1) / g of the result (a ring's receive volume)
"""

import dataclasses
import re
from collections import Counter

import numpy as np

_DTYPE_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
  'c64': 8,
  'c128': 16,
  'f8e4m3fn': 1,
  'f8e5m2': 1,
}
_OP = re.compile(
  r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+'
  r'(?P<op>collective-permute|all-to-all|all-gather|all-reduce|reduce-scatter)(?P<suffix>-start)?\('
)
_ARRAY = re.compile(r'(?P<dtype>[a-z]+[0-9]*[a-z0-9]*)\[(?P<dims>[0-9,]*)\]')


@dataclasses.dataclass(frozen=True)
class DispatchReport:
  """What one dispatch did.

  Attributes:
    strategy: the strategy that ran ('noop', 'rewrap', 'layout_aware', 'xla', 'gather_scatter',
      'allgather').
    requested: the strategy that was asked for (e.g. 'auto').
    wall_s: seconds from the call to the result being ready (planning included, accounting-only
      planning excluded), when the dispatcher is timed; else None.
    plan_s: seconds spent on the plan the strategy needed (a cache lookup when it was cached).
    compiled: whether this call built a new kernel (a trace).
    min_bytes: total bytes that must move between devices.
    bytes_sent: [n] minimum bytes each device sends.
    bytes_received: [n] minimum bytes each device receives.
    scheduled_sent / scheduled_received: [n] bytes the layout-aware schedule moves, padding
      included (None for other strategies).
    num_collectives: collectives the layout-aware kernel issues (rounds x fields).
    recycled_bytes: bytes of this process's outputs that landed in recycled buffers (spent
      source blocks of earlier dispatches) instead of fresh allocations (layout_aware only).
  """

  strategy: str
  requested: str
  wall_s: float | None = None
  plan_s: float = 0.0
  compiled: bool = False
  min_bytes: int | None = None
  bytes_sent: tuple[int, ...] | None = None
  bytes_received: tuple[int, ...] | None = None
  scheduled_sent: tuple[int, ...] | None = None
  scheduled_received: tuple[int, ...] | None = None
  num_collectives: int = 0
  recycled_bytes: int = 0

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class HloCollective:
  """One collective of compiled HLO."""

  kind: str
  result_bytes: int
  pairs: tuple[tuple[int, int], ...] = ()
  group_size: int = 0


def _array_bytes(text: str) -> list[int]:
  out = []
  for m in _ARRAY.finditer(text):
    dtype = m.group('dtype')
    if dtype not in _DTYPE_BYTES:
      continue
    dims = [int(d) for d in m.group('dims').split(',') if d]
    out.append(int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES[dtype])
  return out


def _group_size(line: str, num_devices: int) -> int:
  m = re.search(r'replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}', line)
  if m:
    first = re.match(r'\{([0-9,]*)\}', m.group(1))
    assert first is not None
    return len([x for x in first.group(1).split(',') if x])
  m = re.search(r'replica_groups=\[(\d+),(\d+)\]<=', line)
  if m:
    return int(m.group(2))
  m = re.search(r'replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<used>[^}]*)\}', line)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group('axes')))
    used = re.findall(r"'([^']+)'", m.group('used'))
    return int(np.prod([int(sizes[a]) for a in used], dtype=np.int64)) if used else 1
  return num_devices


def hlo_collectives(hlo_text: str, num_devices: int) -> list[HloCollective]:
  """The collectives in compiled HLO text, with their result sizes, pairs and group sizes."""
  out = []
  for line in hlo_text.splitlines():
    m = _OP.match(line)
    if not m:
      continue
    sizes = _array_bytes(m.group('type'))
    if m.group('suffix'):  # async start: (operands, results, ...); take the result buffer(s).
      sizes = sizes[len(sizes) // 2 : len(sizes) // 2 + 1] if len(sizes) > 1 else sizes
    kind = m.group('op')
    pairs: tuple[tuple[int, int], ...] = ()
    if kind == 'collective-permute':
      pm = re.search(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}', line)
      if pm:
        pairs = tuple((int(a), int(b)) for a, b in re.findall(r'\{(\d+),(\d+)\}', pm.group(1)))
    out.append(
      HloCollective(
        kind=kind,
        result_bytes=sum(sizes),
        pairs=pairs,
        group_size=0 if kind == 'collective-permute' else _group_size(line, num_devices),
      )
    )
  return out


def hlo_received_bytes(hlo_text: str, num_devices: int) -> np.ndarray:
  """[n] bytes each device receives over all collectives of compiled HLO (see module doc)."""
  received = np.zeros(num_devices, np.int64)
  for c in hlo_collectives(hlo_text, num_devices):
    if c.kind == 'collective-permute':
      for s, t in c.pairs:
        if s != t:
          received[t] += c.result_bytes
    elif c.group_size > 1:
      received += c.result_bytes * (c.group_size - 1) // c.group_size
  return received


def hlo_collective_counts(hlo_text: str, num_devices: int) -> dict[str, int]:
  """How many collectives of each kind compiled HLO issues."""
  return dict(Counter(c.kind for c in hlo_collectives(hlo_text, num_devices)))
