"""Sequence packing: the episodes of each data-parallel rank packed side by side into fewer rows.

A batch on a layout holds one episode per row, padded to the bucket T; most of a row is padding
when contexts vary (a bucket holds the longest episode). Packing moves, on every device and
without any communication, the episodes of its rank's rows into rows of T tokens one after
another (first fit, longest first), with segment ids (1, 2, ... per episode in a row; 0 for
padding) and positions that restart at 0 for every episode; the model then attends within a
segment only (`qwen2.token_logprobs(..., segments=...)`), so every token's log-prob and gradient
are the same as unpacked. The programs then run on R packed rows instead of B, and the rank with
the most tokens sets R: balancing real tokens across the ranks (`dispatch.balanced_permutation`,
applied when the batch moves onto the layout) is what makes R small.

Dimension letters as in `earl_jax.config`; per rank: b = B / ranks rows in, r = R / ranks out.

  plan = packing.plan(lengths_B, ranks=layout.ranks, bucket=T, row_multiple=8)
  packed = packing.pack(batch, plan, layout)          # Batch [R, T], segment ids and positions
  plan.rows, plan.fill                                # R, and real tokens / (R x T)

Only per-token fields survive packing with a meaning (advantages are computed before); the row
fields of a packed row are: valid (it holds an episode), lengths (its real tokens), rewards and
group ids 0.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int, Int32, Shaped

from earl_jax.rl.batch import Batch
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding import rules

# Packed rows per rank are rounded up to one of these fractions of the rows per rank, so that
# the programs that run packed batches are compiled for at most four shapes per bucket (each
# compiled shape costs a compile and, while it is cached, its host memory).
ROW_FRACTIONS = tuple(i / 4 for i in range(1, 5))


@dataclasses.dataclass(frozen=True)
class PackPlan:
  """Where every packed token comes from (host tables, the same on every process).

  Attributes:
    rows: R, the packed rows of the whole batch (ranks x rows per rank).
    src_row: [R, T] the row of its rank's block each token comes from (-1: padding).
    src_col: [R, T] the column in that row.
    segment_ids: [R, T] 1, 2, ... for the episodes of a packed row; 0 for padding.
    positions: [R, T] the token's position in its own episode.
    tokens: real tokens in all.
  """

  rows: int
  src_row: Int32[np.ndarray, 'R T']
  src_col: Int32[np.ndarray, 'R T']
  segment_ids: Int32[np.ndarray, 'R T']
  positions: Int32[np.ndarray, 'R T']
  tokens: int

  @property
  def bucket(self) -> int:
    return self.src_row.shape[1]

  @property
  def fill(self) -> float:
    """Real tokens over the R x T slots: 1 means no padding at all."""
    return self.tokens / (self.rows * self.bucket)


def _first_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
  """Row indices grouped into bins of at most `capacity` tokens, longest first."""
  bins: list[list[int]] = []
  room: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
    n = int(lengths[i])
    for k, free in enumerate(room):
      if n <= free:
        bins[k].append(i)
        room[k] -= n
        break
    else:
      bins.append([i])
      room.append(capacity - n)
  return bins


def packed_rows_per_rank(needed: int, rows_per_rank: int, ranks: int, row_multiple: int) -> int:
  """The smallest allowed packed row count per rank that holds `needed` rows and makes the
  whole batch's rows (ranks x it) a multiple of `row_multiple`."""
  sizes = sorted({max(1, math.ceil(f * rows_per_rank)) for f in ROW_FRACTIONS})
  for r in sizes:
    if r >= needed and (ranks * r) % row_multiple == 0:
      return r
  r = max(needed, rows_per_rank)
  while (ranks * r) % row_multiple:
    r += 1
  return r


def rows_needed(
  lengths_B: Int[np.ndarray, ' B'] | list[int], *, ranks: int, bucket: int, row_multiple: int = 1
) -> int:
  """R, the packed rows `plan` would give the batch (without building its tables): what a
  balancing permutation is worth to the programs that run the packed batch."""
  lengths = np.asarray(lengths_B, np.int64)
  b = len(lengths) // ranks
  needed = max(len(_first_fit(lengths[k * b : (k + 1) * b], bucket)) for k in range(ranks))
  return ranks * packed_rows_per_rank(needed, b, ranks, row_multiple)


def plan(
  lengths_B: Int[np.ndarray, ' B'] | list[int],
  *,
  ranks: int,
  bucket: int,
  row_multiple: int = 1,
) -> PackPlan:
  """The packing of a batch whose rank k holds rows [k b, (k + 1) b), b = B / ranks.

  Args:
    lengths_B: real tokens of every row, in the batch's row order (0: a padding row).
    ranks: the data-parallel ranks of the layout (its row blocks).
    bucket: T, the row length (every episode fits one row).
    row_multiple: the packed rows of the whole batch must be a multiple of this (the batch
      shards of the layouts it goes to, the micro-batches of the update).

  Raises:
    ValueError: rows that do not split over the ranks, or an episode longer than T.
  """
  lengths = np.asarray(lengths_B, np.int64)
  B = len(lengths)
  if B % ranks:
    raise ValueError(f'packing: {B} rows do not split over {ranks} ranks.')
  if lengths.max(initial=0) > bucket:
    raise ValueError(f'packing: an episode of {lengths.max()} tokens exceeds the bucket {bucket}.')
  b = B // ranks
  per_rank = [_first_fit(lengths[k * b : (k + 1) * b], bucket) for k in range(ranks)]
  needed = max((len(bins) for bins in per_rank), default=1)
  r = packed_rows_per_rank(needed, b, ranks, row_multiple)
  R = ranks * r
  src_row = np.full((R, bucket), -1, np.int32)
  src_col = np.zeros((R, bucket), np.int32)
  segment_ids = np.zeros((R, bucket), np.int32)
  positions = np.zeros((R, bucket), np.int32)
  for k, bins in enumerate(per_rank):
    for j, members in enumerate(bins):
      row, start = k * r + j, 0
      for s, i in enumerate(members):
        n = int(lengths[k * b + i])
        if n == 0:
          continue
        src_row[row, start : start + n] = i
        src_col[row, start : start + n] = np.arange(n)
        segment_ids[row, start : start + n] = s + 1
        positions[row, start : start + n] = np.arange(n)
        start += n
  return PackPlan(
    rows=R,
    src_row=src_row,
    src_col=src_col,
    segment_ids=segment_ids,
    positions=positions,
    tokens=int(lengths.sum()),
  )


def _gather(
  x: Shaped[Array, 'b T'], src_row: Int[Array, 'r T'], src_col: Int[Array, 'r T']
) -> Shaped[Array, 'r T']:
  """One device: out[j, t] = x[src_row[j, t], src_col[j, t]] (0 / False where src_row < 0)."""
  got = x[jnp.maximum(src_row, 0), src_col]
  return jnp.where(src_row >= 0, got, jnp.zeros((), x.dtype))


_TOKEN_FIELDS = (
  'tokens',
  'loss_mask',
  'sample_logprobs',
  'old_logprobs',
  'ref_logprobs',
  'advantages',
  'returns',
  'legal_moves',
)


def pack(batch: Batch, packing: PackPlan, mesh: jax.sharding.Mesh) -> Batch:
  """The batch (on `mesh`'s train layout, `Batch.shardings`) packed as `packing` says.

  Per shard: token fields [b, T] -> [r, T] by a local gather over whole rows; the plan's tables
  [r, T] arrive sharded like the rows. No collective moves rows: every rank packs the rows it
  holds. On a context-parallel mesh, where each device holds T / cp tokens of its rows, the
  gather reads the whole rows (gathered over the 'context' ring of the rows' devices, since a
  sequence may move anywhere in its packed row) and each device keeps its T / cp tokens of the
  result. Row fields become those of the packed rows (see the module docstring).
  """
  row_axes = rules.spec(('batch',))[0]
  rows_sharding = NamedSharding(mesh, P(row_axes, None))
  shardings = Batch.shardings(mesh)
  R, T = packing.src_row.shape
  src_row, src_col = (
    mesh_lib.put_rows(table, np.arange(R), (R, T), rows_sharding)
    for table in (packing.src_row, packing.src_col)
  )
  segment_ids, positions = (
    mesh_lib.put_rows(table, np.arange(R), (R, T), sharding)
    for table, sharding in (
      (packing.segment_ids, shardings.segment_ids),
      (packing.positions, shardings.positions),
    )
  )
  moved = _gather_token_fields(
    batch,
    src_row,
    src_col,
    mesh,
    rows_sharding.spec,
    [getattr(shardings, name) for name in _TOKEN_FIELDS],
  )
  out = Batch.zeros(R, T).replace(
    **dict(zip(_TOKEN_FIELDS, moved)),
    segment_ids=segment_ids,
    positions=positions,
  )
  real = packing.segment_ids > 0
  host_rows = {
    'rewards': np.zeros(R, np.float32),
    'lengths': real.sum(axis=1).astype(np.int32),
    'group_ids': np.zeros(R, np.int32),
    'valid': real.any(axis=1),
  }
  row_sharding = NamedSharding(mesh, P(row_axes))
  out = out.replace(
    **{
      name: mesh_lib.put_rows(values, np.arange(R), (R,), row_sharding)
      for name, values in host_rows.items()
    }
  )
  for x, want in zip(jax.tree.leaves(out), jax.tree.leaves(shardings)):
    assert x.sharding.is_equivalent_to(want, x.ndim), (x.sharding, want)
  return out


def _gather_token_fields(
  batch: Batch,
  src_row: jax.Array,
  src_col: jax.Array,
  mesh: jax.sharding.Mesh,
  spec: P,
  out_shardings: list[NamedSharding],
) -> list[jax.Array]:
  """The token fields of `batch` gathered into the packed rows, shard by shard (`_gather`), on
  whole rows (`spec`), then laid out on `out_shardings`."""
  program = _gather_program(mesh, spec, tuple(out_shardings))
  return program([getattr(batch, name) for name in _TOKEN_FIELDS], src_row, src_col)


@functools.cache
def _gather_program(mesh: jax.sharding.Mesh, spec: P, out_shardings: tuple[NamedSharding, ...]):
  """The jitted gather of `_gather_token_fields`, one per layout: every step packs with the same
  function, so jit traces it once per shape instead of once per call."""

  def kernel(fields, src_row, src_col):
    return [_gather(x, src_row, src_col) for x in fields]

  return jax.jit(
    jax.shard_map(
      kernel,
      mesh=mesh,
      in_specs=([spec] * len(_TOKEN_FIELDS), spec, spec),
      out_specs=[spec] * len(_TOKEN_FIELDS),
    ),
    out_shardings=list(out_shardings),
  )
