"""Causal attention over a sequence split across devices (context parallelism), as shard_maps.

Both kernels take q, k, v and segment ids split along the sequence over one mesh axis `axis`
(C = its size) and return the output split the same way. Every other mesh axis splits the batch
(in mesh order; B must be divisible by the product of their sizes), so on a ('data', 'context')
mesh the spec of q and of the output is P('data', 'context', None, None, None).

Ring attention (`ring_attention`). Each device keeps its query shard and passes its key/value
shard (with its segment ids and global positions) around a ring of the C devices with
`lax.ppermute`, C - 1 times: at step s device i holds the kv shard of device i - s (mod C). Each
visit is folded into the device's queries with an online softmax (a running max, sum of exp and
weighted values per query, in f32), masked by GLOBAL positions (key <= query) and segment ids.
No device ever holds more than two kv shards, and the output needs no gather.

Each visit is blockwise, as the single-device `models.attention.blockwise_causal_attention`: a
loop over the query blocks of b positions (b = gcd(block, t), gcd(block, c) with zig-zag) and,
for each, over the key blocks it sees, one [b, b] tile at a time. Positions increase along a
shard in both layouts, so a query block sees a prefix of the visitor's key blocks (those whose
first key is not after its last query): the diagonal visit (a shard against itself) stops at the
diagonal, a visitor whose keys are all in the future costs no tile, and with zig-zag only the
needed half of a visit (below) is computed. The ring is one `custom_vjp` per device: the forward
saves only its output and the log-sum-exp of each query; the backward is a second ring pass in
which each kv shard travels with its dk, dv accumulators, every device adding its queries' part
tile by tile (recomputed from the lse, dq kept locally), and one last hop takes dk, dv home. No
pass holds more than one tile's scores, so a device's memory grows with t, not t^2.

Zig-zag order. With the sequence split in C contiguous shards, device C - 1 sees every key and
device 0 only its own: causal work grows linearly along the ring. With `zigzag=True` the
sequence is cut into 2C chunks of c = T / (2C) positions and device i holds chunks i and
2C - 1 - i (one early, one late), so every device has the same number of (query, key) pairs
to compute. A visit then needs only half its (query, key) pairs: a shard from an earlier device
is seen by all local queries but only through its early chunk; a shard from a later device is
seen only by the local late chunk, through both of its chunks. (Contiguous order: an earlier
shard is seen whole and a later one skipped.) The kernels take inputs ALREADY in the layout
order: layout position p holds global position `sequence_positions(T, C, zigzag=True)[p]`;
`to_zigzag` / `from_zigzag` move a [B, T, ...] array into and out of it (a gather along T, done
once per batch, e.g. by the data pipeline: token ids, targets and segment ids alike).

Ulysses attention (`ulysses_attention`). One `lax.all_to_all` turns sequence shards of all K kv
heads into the whole sequence for K / C heads, each device runs the single-device
`blockwise_causal_attention` on its heads, and a second all-to-all turns the output back. It
applies when C divides K (GQA groups move whole: the Q query heads of a kv head stay together)
and one device can hold the full sequence for K / C heads; its traffic is 4 all-to-alls of a
shard, independent of C, against ring's C - 1 kv shard hops. Ring has no head constraint.

Packed rows and padding: a query sees a key only if key position <= query position and both
carry the same segment id. Padding is a segment of its own (by convention id 0): real tokens
never see it; padded queries see only padding, so their outputs are finite but meaningless and
the loss must mask them. `reference_attention` uses the same rule.

Per-device shapes (t = T / C; c = t / 2 with zig-zag; b the ring's tile):
  q        [B_local, t, K, Q, Dh]    k, v [B_local, t, K, Dh]    segment_ids [B_local, t] or None
  out      [B_local, t, K, Q, Dh]    (q's dtype)
  ring     one tile [B_local, K, Q, b, b] (f32); accumulators and lse [B_local, K, Q, t] (f32),
           weighted values [B_local, K, Q, t, Dh]; backward: dk, dv [B_local, t, K, Dh] (f32)
  ulysses  [B_local, T, K / C, Q, Dh] between the all-to-alls
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, Shaped

from earl_jax.models.attention import blockwise_causal_attention

_NEG = float(jnp.finfo(jnp.float32).min)


# Layout: zig-zag order, positions, specs.


def zigzag_order(T: int, C: int) -> Int[np.ndarray, ' T']:
  """The global position at each layout position of the zig-zag order (a permutation of T).

  Device i holds chunks i and 2C - 1 - i of c = T / (2C) positions, devices in order:
  zigzag_order(8, 2) = [0 1 6 7 | 2 3 4 5]. `x[:, zigzag_order(T, C)]` is x in zig-zag order.
  """
  if T % (2 * C):
    raise ValueError(f'Zig-zag order needs 2C = {2 * C} to divide T = {T}.')
  chunks = np.arange(T, dtype=np.int32).reshape(2 * C, T // (2 * C))
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * C - 1 - i]]) for i in range(C)])


def zigzag_inverse(T: int, C: int) -> Int[np.ndarray, ' T']:
  """The layout position of each global position: `x_zig[:, zigzag_inverse(T, C)]` is x."""
  return np.argsort(zigzag_order(T, C)).astype(np.int32)


def uses_zigzag(T: int, C: int) -> bool:
  """Whether a [B, T] forward over C > 1 context devices runs in zig-zag order: wherever 2C
  divides T (each device then holds a chunk from each end, the causal work balanced); else the
  contiguous order. The model (`qwen2.Qwen2.__call__`) and its attention decide by this rule."""
  return C > 1 and T % (2 * C) == 0


def to_zigzag(x: Shaped[Array, 'B T *rest'], C: int) -> Shaped[Array, 'B T *rest']:
  """[B, T, ...] in sequence order -> the same in zig-zag order for C devices."""
  return jnp.take(x, zigzag_order(x.shape[1], C), axis=1)


def from_zigzag(x: Shaped[Array, 'B T *rest'], C: int) -> Shaped[Array, 'B T *rest']:
  """Inverse of `to_zigzag`."""
  return jnp.take(x, zigzag_inverse(x.shape[1], C), axis=1)


def sequence_positions(T: int, C: int, *, zigzag: bool) -> Int[np.ndarray, ' T']:
  """Global position at each layout position; device i holds [i * T / C, (i + 1) * T / C)."""
  if T % C:
    raise ValueError(f'Context parallelism over C = {C} devices needs C to divide T = {T}.')
  return zigzag_order(T, C) if zigzag else np.arange(T, dtype=np.int32)


def sequence_spec(mesh: Mesh, axis: str, ndim: int, head_axis: str | None = None) -> P:
  """P(batch axes, axis, [head_axis], None, ...): T over `axis`, the kv heads (dimension 2 of
  a q, k, v or output; none in [B, T] segment ids) over `head_axis` when given, and the batch
  over every other mesh axis."""
  rest = tuple(a for a in mesh.axis_names if a not in (axis, head_axis))
  batch = rest[0] if len(rest) == 1 else (rest or None)
  if head_axis is None or ndim < 3:
    return P(batch, axis, *([None] * (ndim - 2)))
  return P(batch, axis, head_axis, *([None] * (ndim - 3)))


def _check_batch(B: int, mesh: Mesh, axis: str, head_axis: str | None = None) -> None:
  shards = math.prod(n for a, n in mesh.shape.items() if a not in (axis, head_axis))
  if B % shards:
    raise ValueError(
      f'Batch {B} does not split over the {shards} devices of the mesh axes other than '
      f'{axis!r} (mesh {dict(mesh.shape)}).'
    )


def _sequence_shard_map(
  per_device: Callable,
  mesh: Mesh,
  axis: str,
  arrays: Sequence,
  ndims: Sequence[int],
  *,
  check_vma: bool = True,
  head_axis: str | None = None,
) -> Array:
  """shard_map of `per_device` over arrays split by `sequence_spec`; output specced like the
  first. A None array (no segment ids) is not passed to shard_map and reaches `per_device` as
  None."""
  keep = [i for i, a in enumerate(arrays) if a is not None]

  def body(*xs):
    full = [None] * len(arrays)
    for i, x in zip(keep, xs):
      full[i] = x
    return per_device(*full)

  specs = tuple(sequence_spec(mesh, axis, ndims[i], head_axis) for i in keep)
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=check_vma)(
    *(arrays[i] for i in keep)
  )


def ring_tile(block: int, cp: int) -> int:
  """The tile the model's ring attention uses over cp devices: `block` / sqrt(cp), down to a
  power of two (at least 8). A context-parallel layout holds cp times the rows per device that
  a data-parallel one of its devices does, and a tile [B_local, K, Q, b, b] holds every local
  row, so this keeps a tile's bytes near the data-parallel layout's."""
  return max(8, 1 << int(math.log2(max(block / math.sqrt(cp), 1))))


# Ring attention, per device: b x b tiles of each visit, a forward and a backward ring pass.


def _rows(x: Array, i, b: int, axis: int = 1) -> Array:
  """Rows [i * b, (i + 1) * b) of x along `axis` (i may be traced)."""
  return lax.dynamic_slice_in_dim(x, i * b, b, axis=axis)


def _put(x: Array, i, b: int, rows: Array, axis: int = 1) -> Array:
  """x with rows [i * b, (i + 1) * b) along `axis` replaced by `rows`."""
  return lax.dynamic_update_slice_in_dim(x, rows, i * b, axis=axis)


def _seg_rows(seg: Array | None, i, b: int) -> Array | None:
  return None if seg is None else _rows(seg, i, b)


class _Queries(NamedTuple):
  """A device's queries: q [B, t, K, Q, Dh], segment ids [B, t] or None, global positions [t]."""

  q: Array
  seg: Array | None
  pos: Array

  def block(self, i, b: int) -> '_Queries':
    return _Queries(_rows(self.q, i, b), _seg_rows(self.seg, i, b), _rows(self.pos, i, b, 0))


class _Shard(NamedTuple):
  """A kv shard as it travels the ring: k, v [B, t, K, Dh] (inputs' dtype), segment ids [B, t]
  or None, and the global positions [t] of the device it comes from."""

  k: Array
  v: Array
  seg: Array | None
  pos: Array

  def block(self, j, b: int) -> '_Shard':
    k, v, pos = _rows(self.k, j, b), _rows(self.v, j, b), _rows(self.pos, j, b, 0)
    return _Shard(k, v, _seg_rows(self.seg, j, b), pos)


def _scale(qs: _Queries) -> float:
  return 1.0 / float(qs.q.shape[-1]) ** 0.5


def _tile(qb: _Queries, kb: _Shard) -> tuple[Array, Array]:
  """Scaled scores [B, K, Q, b, b] (f32, masked entries _NEG) of a query block against a key
  block, and the mask [B or 1, 1, 1, b, b]: key position <= query position, same segment."""
  f32 = jnp.float32
  scores = jnp.einsum('BTKQd,BSKd->BKQTS', qb.q.astype(f32), kb.k.astype(f32)) * _scale(qb)
  mask = (kb.pos[None, :] <= qb.pos[:, None])[None]
  if qb.seg is not None:
    mask = mask & (qb.seg[:, :, None] == kb.seg[:, None, :])
  mask = mask[:, None, None]
  return jnp.where(mask, scores, _NEG), mask


def _sweep(qs: _Queries, ks: _Shard, b: int, query_block: Callable, carry):
  """Runs carry = query_block(i, n_i, carry) over the query blocks i of one visit that see a
  key of `ks`, where n_i is how many key blocks query block i sees.

  Positions increase along a shard in both layouts, so query block i sees a prefix of the key
  blocks (those whose first key is not after its last query: the diagonal visit stops at the
  diagonal), and the blocks that see any key are a suffix (none: a visitor from the future).
  """
  seen = jnp.sum(ks.pos[::b][None, :] <= qs.pos[b - 1 :: b][:, None], axis=1)  # [t / b]
  first = jnp.sum(seen == 0)
  return lax.fori_loop(first, seen.shape[0], lambda i, c: query_block(i, seen[i], c), carry)


def _pass(tree, axis: str):
  """Every device's `tree` to the next device on the ring (device i gets device i - 1's)."""
  C = lax.axis_size(axis)
  ring = [(j, (j + 1) % C) for j in range(C)]
  return jax.tree.map(lambda x: lax.ppermute(x, axis, ring), tree)


def _around_the_ring(visit: Callable, local, travel, axis: str):
  """local, travel = visit(local, travel) on this device's own `travel`, then C - 1 times on
  the one passed from the previous device; returns the last (local, travel)."""
  local, travel = visit(local, travel)

  def step(carry, _):
    local, travel = carry
    return visit(local, _pass(travel, axis)), None

  (local, travel), _ = lax.scan(step, (local, travel), length=lax.axis_size(axis) - 1)
  return local, travel


# Ring forward: an online softmax per query over the visiting shards' tiles.


class _Acc(NamedTuple):
  """Online-softmax state per query: running max and sum [B, K, Q, t], weighted values
  [B, K, Q, t, Dh] (all f32)."""

  row_max: Array
  row_sum: Array
  weighted: Array

  @classmethod
  def empty(cls, B: int, t: int, K: int, Q: int, Dh: int) -> '_Acc':
    f32 = jnp.float32
    rows = jnp.full((B, K, Q, t), _NEG, f32)
    return cls(rows, jnp.zeros_like(rows), jnp.zeros((B, K, Q, t, Dh), f32))

  def block(self, i, b: int) -> '_Acc':
    return _Acc(*(_rows(x, i, b, 3) for x in self))

  def put(self, i, b: int, acc: '_Acc') -> '_Acc':
    return _Acc(*(_put(x, i, b, y, 3) for x, y in zip(self, acc)))


def _fold_tile(acc: _Acc, qb: _Queries, kb: _Shard) -> _Acc:
  """Folds one tile into a query block's online softmax; fully masked rows add nothing."""
  scores, mask = _tile(qb, kb)
  new_max = jnp.maximum(acc.row_max, jnp.max(scores, axis=-1))
  probs = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
  alpha = jnp.exp(acc.row_max - new_max)
  row_sum = acc.row_sum * alpha + jnp.sum(probs, axis=-1)
  values = jnp.einsum('BKQTS,BSKd->BKQTd', probs, kb.v.astype(jnp.float32))
  return _Acc(new_max, row_sum, acc.weighted * alpha[..., None] + values)


def _fold_visit(acc: _Acc, qs: _Queries, ks: _Shard, b: int) -> _Acc:
  """Folds every tile of the shard `ks` that a local query sees into the accumulators."""

  def query_block(i, n, acc):
    qb = qs.block(i, b)
    acc_i = lax.fori_loop(0, n, lambda j, a: _fold_tile(a, qb, ks.block(j, b)), acc.block(i, b))
    return acc.put(i, b, acc_i)

  return _sweep(qs, ks, b, query_block, acc)


# Ring backward: a second pass, the kv shards travelling with their dk, dv accumulators.


class _Cotangents(NamedTuple):
  """Per query: d_out [B, t, K, Q, Dh], lse and delta = rowsum(d_out * out) [B, K, Q, t] (f32)."""

  d_out: Array
  lse: Array
  delta: Array

  def block(self, i, b: int) -> '_Cotangents':
    return _Cotangents(
      _rows(self.d_out, i, b), _rows(self.lse, i, b, 3), _rows(self.delta, i, b, 3)
    )


class _KVGrads(NamedTuple):
  """dk, dv [B, t, K, Dh] (f32) of one kv shard, travelling with it."""

  dk: Array
  dv: Array

  def add(self, j, b: int, dk_j: Array, dv_j: Array) -> '_KVGrads':
    return _KVGrads(
      _put(self.dk, j, b, _rows(self.dk, j, b) + dk_j),
      _put(self.dv, j, b, _rows(self.dv, j, b) + dv_j),
    )


def _tile_grads(qb: _Queries, gb: _Cotangents, kb: _Shard) -> tuple[Array, Array, Array]:
  """One tile recomputed from the saved lse: its parts of dq [B, b, K, Q, Dh] and of dk, dv
  [B, b, K, Dh]."""
  f32 = jnp.float32
  scores, mask = _tile(qb, kb)
  probs = jnp.where(mask, jnp.exp(scores - gb.lse[..., None]), 0.0)
  d_probs = jnp.einsum('BTKQd,BSKd->BKQTS', gb.d_out, kb.v.astype(f32))
  d_scores = probs * (d_probs - gb.delta[..., None]) * _scale(qb)
  dq = jnp.einsum('BKQTS,BSKd->BTKQd', d_scores, kb.k.astype(f32))
  dk = jnp.einsum('BKQTS,BTKQd->BSKd', d_scores, qb.q.astype(f32))
  dv = jnp.einsum('BKQTS,BTKQd->BSKd', probs, gb.d_out)
  return dq, dk, dv


def _grad_visit(dq: Array, dkv: _KVGrads, qs: _Queries, g: _Cotangents, ks: _Shard, b: int):
  """Adds the local queries' part of every tile of `ks` they see to dq (local, f32) and to the
  shard's travelling dk, dv."""

  def query_block(i, n, carry):
    dq, dkv = carry
    qb, gb = qs.block(i, b), g.block(i, b)

    def key_block(j, carry):
      dq_i, dkv = carry
      dq_ij, dk_j, dv_j = _tile_grads(qb, gb, ks.block(j, b))
      return dq_i + dq_ij, dkv.add(j, b, dk_j, dv_j)

    dq_i, dkv = lax.fori_loop(0, n, key_block, (_rows(dq, i, b), dkv))
    return _put(dq, i, b, dq_i), dkv

  return _sweep(qs, ks, b, query_block, (dq, dkv))


# The ring as one custom_vjp per device.


def _local(q, k, v, segment_ids, axis: str, zigzag: bool) -> tuple[_Queries, _Shard]:
  """This device's queries and kv shard, with the global positions of its layout positions."""
  C, t = lax.axis_size(axis), q.shape[1]
  table = sequence_positions(C * t, C, zigzag=zigzag).reshape(C, t)
  positions = jnp.asarray(table)[lax.axis_index(axis)]
  return _Queries(q, segment_ids, positions), _Shard(k, v, segment_ids, positions)


def _ring_fwd(q, k, v, segment_ids, axis: str, zigzag: bool, b: int):
  """out [B, t, K, Q, Dh] (q's dtype) and the residuals: the inputs, out (f32) and lse."""
  qs, ks = _local(q, k, v, segment_ids, axis, zigzag)
  visit = lambda acc, ks: (_fold_visit(acc, qs, ks, b), ks)  # noqa: E731
  acc, _ = _around_the_ring(visit, _Acc.empty(*q.shape), ks, axis)
  out = (acc.weighted / acc.row_sum[..., None]).transpose(0, 3, 1, 2, 4)  # every query sees itself
  lse = acc.row_max + jnp.log(acc.row_sum)
  return out.astype(q.dtype), (q, k, v, segment_ids, out, lse)


def _ring_bwd(axis: str, zigzag: bool, b: int, residuals, d_out):
  """dq, dk, dv: the kv shards go around the ring again, each with its dk, dv accumulators,
  and after C - 1 visits one more hop takes the accumulators home."""
  q, k, v, segment_ids, out, lse = residuals
  qs, ks = _local(q, k, v, segment_ids, axis, zigzag)
  d_out = d_out.astype(jnp.float32)
  g = _Cotangents(d_out, lse, jnp.einsum('BTKQd,BTKQd->BKQT', d_out, out))

  def visit(dq, travel):
    ks, dkv = travel
    dq, dkv = _grad_visit(dq, dkv, qs, g, ks, b)
    return dq, (ks, dkv)

  zeros = _KVGrads(jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dq, (_, dkv) = _around_the_ring(visit, jnp.zeros(q.shape, jnp.float32), (ks, zeros), axis)
  dkv = _pass(dkv, axis)
  return dq.astype(q.dtype), dkv.dk.astype(k.dtype), dkv.dv.astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring_per_device(q, k, v, segment_ids, axis: str, zigzag: bool, b: int):
  return _ring_fwd(q, k, v, segment_ids, axis, zigzag, b)[0]


_ring_per_device.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
  q: Float[Array, 'B T K Q Dh'],
  k: Float[Array, 'B T K Dh'],
  v: Float[Array, 'B T K Dh'],
  segment_ids: Int[Array, 'B T'] | None,
  *,
  mesh: Mesh,
  axis: str,
  zigzag: bool = True,
  block: int = 128,
  head_axis: str | None = None,
) -> Float[Array, 'B T K Q Dh']:
  """Causal grouped-query attention with the sequence split over `axis` (module doc).

  Inputs are in layout order (zig-zag order when `zigzag`, see `to_zigzag`), sharded or not;
  the output is in the same order, with spec `sequence_spec(mesh, axis, 5, head_axis)` (the
  model's layout: kv heads over 'tensor' with `head_axis='tensor'`). Per device: q, out
  [B_local, T / C, K_local, Q, Dh], k, v [B_local, T / C, K_local, Dh], segment_ids
  [B_local, T / C].
  Each visit is computed in tiles of b = gcd(block, T / C) (gcd(block, T / 2C) with zig-zag,
  so that a tile never straddles two chunks).

  Raises:
    ValueError: C (2C with zig-zag) does not divide T, the batch does not split over the
      other mesh axes, or block < 1.
  """
  B, T = q.shape[:2]
  C = mesh.shape[axis]
  _check_batch(B, mesh, axis, head_axis)
  sequence_positions(T, C, zigzag=zigzag)  # validates T
  if block < 1:
    raise ValueError(f'Ring attention needs a positive block, got {block}.')
  b = math.gcd(block, T // (2 * C) if zigzag else T // C)

  def per_device(q, k, v, segment_ids):
    return _ring_per_device(q, k, v, segment_ids, axis, zigzag, b)

  # check_vma=False: the tile loops start from fresh (device-invariant) accumulators, which the
  # varying-axes check rejects as loop carries; the backward pass is written out (custom_vjp),
  # so no collective is transposed by jax.
  return _sequence_shard_map(
    per_device,
    mesh,
    axis,
    (q, k, v, segment_ids),
    (5, 4, 4, 2),
    check_vma=False,
    head_axis=head_axis,
  )


# Ulysses attention.


def _ulysses_per_device(
  q: Float[Array, 'B t K Q Dh'],
  k: Float[Array, 'B t K Dh'],
  v: Float[Array, 'B t K Dh'],
  segment_ids: Int[Array, 'B t'] | None,
  *,
  axis: str,
  zigzag: bool,
  block: int,
) -> Float[Array, 'B t K Q Dh']:
  """One device: sequence shards of all heads -> all of T for K / C heads, attention, back."""
  C = lax.axis_size(axis)
  q, k, v = (lax.all_to_all(x, axis, 2, 1, tiled=True) for x in (q, k, v))  # [B, T, K / C, ..]
  if segment_ids is not None:
    segment_ids = lax.all_gather(segment_ids, axis, axis=1, tiled=True)  # [B, T]
  T = q.shape[1]
  if zigzag:  # the local sequence is in layout order; the blockwise attention wants it in order
    q, k, v, segment_ids = (
      None if x is None else from_zigzag(x, C) for x in (q, k, v, segment_ids)
    )
  out = blockwise_causal_attention(q, k, v, block=math.gcd(T, block), segment_ids=segment_ids)
  if zigzag:
    out = to_zigzag(out, C)
  return lax.all_to_all(out, axis, 1, 2, tiled=True)


def ulysses_attention(
  q: Float[Array, 'B T K Q Dh'],
  k: Float[Array, 'B T K Dh'],
  v: Float[Array, 'B T K Dh'],
  segment_ids: Int[Array, 'B T'] | None,
  *,
  mesh: Mesh,
  axis: str,
  zigzag: bool = False,
  block: int = 512,
) -> Float[Array, 'B T K Q Dh']:
  """Causal grouped-query attention by head/sequence all-to-alls over `axis` (module doc).

  Same contract as `ring_attention` (layout order in and out, output spec
  `sequence_spec(mesh, axis, 5)`), but `zigzag` defaults to False: pass the layout the inputs
  are in. Each device attends over all T for K / C kv heads, in tiles of gcd(T, block).

  Raises:
    ValueError: C does not divide K (or T; 2C with zig-zag), or the batch does not split.
  """
  B, T, K = k.shape[:3]
  C = mesh.shape[axis]
  if K % C:
    raise ValueError(
      f'Ulysses attention splits the K = {K} kv heads over the C = {C} devices of axis '
      f'{axis!r}: C must divide K (use ring attention otherwise).'
    )
  _check_batch(B, mesh, axis)
  sequence_positions(T, C, zigzag=zigzag)  # validates T
  per_device = functools.partial(_ulysses_per_device, axis=axis, zigzag=zigzag, block=block)
  # check_vma=False: the blockwise attention's loops start from fresh (device-invariant) zeros,
  # which the varying-axes check rejects as loop carries. Nothing here needs the check: the
  # collectives are all-to-alls (their own transpose) and an all-gather of integer ids.
  return _sequence_shard_map(
    per_device, mesh, axis, (q, k, v, segment_ids), (5, 4, 4, 2), check_vma=False
  )


# Dense reference.


def reference_attention(
  q: Float[Array, 'B T K Q Dh'],
  k: Float[Array, 'B T K Dh'],
  v: Float[Array, 'B T K Dh'],
  segment_ids: Int[Array, 'B T'] | None,
) -> Float[Array, 'B T K Q Dh']:
  """softmax(q k^T / sqrt(Dh)) v on one device, in f32 (returned as f32), with the causal and
  segment mask of the module doc. Inputs in sequence order."""
  T, Dh = q.shape[1], q.shape[-1]
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  scores = jnp.einsum('BTKQd,BSKd->BKQTS', f32[0], f32[1]) / np.sqrt(Dh)
  mask = jnp.tril(jnp.ones((T, T), bool))[None]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  return jnp.einsum('BKQTS,BSKd->BTKQd', jax.nn.softmax(scores, axis=-1), f32[2])
