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
No device ever holds more than two kv shards, and the output needs no gather. The kernel is
plain jnp and collectives under `jax.shard_map`, so jax differentiates it (the transpose of a
ppermute is the reverse ppermute); each visit is rematerialised (`jax.checkpoint`), so the
backward pass keeps the accumulators and kv shard of each step, not the [t, t] scores.

Zig-zag order. With the sequence split in C contiguous shards, device C - 1 sees every key and
device 0 only its own: causal work grows linearly along the ring. With `zigzag=True` the
sequence is cut into 2C chunks of c = T / (2C) positions and device i holds chunks i and
2C - 1 - i (one early, one late), so every device has the same number of (query, key) pairs
to compute. A visit then needs only half a tile: a shard from an earlier device is seen by all
local queries but only through its early chunk; a shard from a later device is seen only by the
local late chunk, through both of its chunks. (Contiguous order: an earlier shard is seen whole
and a later one skipped.) The kernels take inputs ALREADY in the layout order: layout position
p holds global position `sequence_positions(T, C, zigzag=True)[p]`; `to_zigzag` / `from_zigzag`
move a [B, T, ...] array into and out of it (a gather along T, done once per batch, e.g. by the
data pipeline: token ids, targets and segment ids alike).

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

Per-device shapes (t = T / C; c = t / 2 with zig-zag):
  q        [B_local, t, K, Q, Dh]    k, v [B_local, t, K, Dh]    segment_ids [B_local, t] or None
  out      [B_local, t, K, Q, Dh]    (q's dtype)
  ring     one visit's tile [B_local, K, Q, t, c] or [.., c, t] (zig-zag), [.., t, t] (contiguous)
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
from jaxtyping import Array, Bool, Float, Int, Shaped

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


def sequence_spec(mesh: Mesh, axis: str, ndim: int) -> P:
  """P(batch axes, axis, None, ...): the batch over every other mesh axis, T over `axis`."""
  rest = tuple(a for a in mesh.axis_names if a != axis)
  batch = rest[0] if len(rest) == 1 else (rest or None)
  return P(batch, axis, *([None] * (ndim - 2)))


def _check_batch(B: int, mesh: Mesh, axis: str) -> None:
  shards = math.prod(n for a, n in mesh.shape.items() if a != axis)
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

  specs = tuple(sequence_spec(mesh, axis, ndims[i]) for i in keep)
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=check_vma)(
    *(arrays[i] for i in keep)
  )


# Ring attention: one device's online softmax over visiting kv shards.


class _Queries(NamedTuple):
  q: Array  # [B, t, K, Q, Dh] f32
  seg: Array | None  # [B, t]
  pos: Array  # [t] global positions

  def rows(self, sl: slice) -> '_Queries':
    return _Queries(self.q[:, sl], None if self.seg is None else self.seg[:, sl], self.pos[sl])


class _Keys(NamedTuple):
  k: Array  # [B, t, K, Dh] f32
  v: Array  # [B, t, K, Dh] f32
  seg: Array | None  # [B, t]
  pos: Array  # [t] global positions

  def rows(self, sl: slice) -> '_Keys':
    seg = None if self.seg is None else self.seg[:, sl]
    return _Keys(self.k[:, sl], self.v[:, sl], seg, self.pos[sl])


class _Acc(NamedTuple):
  """Online-softmax state per query: running max and sum [B, K, Q, t], weighted values
  [B, K, Q, t, Dh] (all f32)."""

  row_max: Array
  row_sum: Array
  weighted: Array

  def rows(self, sl: slice) -> '_Acc':
    return _Acc(self.row_max[..., sl], self.row_sum[..., sl], self.weighted[..., sl, :])


def _concat_rows(a: _Acc, b: _Acc) -> _Acc:
  return _Acc(*(jnp.concatenate([x, y], axis=3) for x, y in zip(a, b)))


def _mask(qs: _Queries, ks: _Keys) -> Bool[Array, 'b 1 1 tq tk']:
  """Causal by global position, and same segment; b is 1 without segment ids."""
  mask = (ks.pos[None, :] <= qs.pos[:, None])[None]
  if qs.seg is not None:
    mask = mask & (qs.seg[:, :, None] == ks.seg[:, None, :])
  return mask[:, None, None]


def _accumulate(acc: _Acc, qs: _Queries, ks: _Keys) -> _Acc:
  """Folds one [tq, tk] tile into the online softmax of the queries `qs`.

  The running max only shifts the exponent (the output does not depend on it), so it carries
  no gradient; fully masked rows keep max _NEG and add nothing.
  """
  scale = 1.0 / float(qs.q.shape[-1]) ** 0.5
  mask = _mask(qs, ks)
  scores = jnp.where(mask, jnp.einsum('BTKQd,BSKd->BKQTS', qs.q, ks.k) * scale, _NEG)
  new_max = lax.stop_gradient(jnp.maximum(acc.row_max, jnp.max(scores, axis=-1)))
  probs = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
  alpha = jnp.exp(acc.row_max - new_max)
  row_sum = acc.row_sum * alpha + jnp.sum(probs, axis=-1)
  values = jnp.einsum('BKQTS,BSKd->BKQTd', probs, ks.v)
  return _Acc(new_max, row_sum, acc.weighted * alpha[..., None] + values)


def _visit(acc: _Acc, qs: _Queries, ks: _Keys, *, zigzag: bool) -> _Acc:
  """Folds in the kv shard of another device, computing only its unmasked part (module doc).

  The first position of a shard orders the devices in both layouts.
  """
  from_earlier = ks.pos[0] < qs.pos[0]
  if not zigzag:
    return lax.cond(from_earlier, lambda a: _accumulate(a, qs, ks), lambda a: a, acc)
  early, late = slice(None, qs.q.shape[1] // 2), slice(qs.q.shape[1] // 2, None)

  def earlier(a):  # all queries see the visitor's early chunk; its late chunk is in the future
    return _accumulate(a, qs, ks.rows(early))

  def later(a):  # only the late query chunk sees the visitor, all of it
    return _concat_rows(a.rows(early), _accumulate(a.rows(late), qs.rows(late), ks))

  return lax.cond(from_earlier, earlier, later, acc)


def _ring_per_device(
  q: Float[Array, 'B t K Q Dh'],
  k: Float[Array, 'B t K Dh'],
  v: Float[Array, 'B t K Dh'],
  segment_ids: Int[Array, 'B t'] | None,
  *,
  axis: str,
  zigzag: bool,
) -> Float[Array, 'B t K Q Dh']:
  """One device: its own kv shard, then C - 1 visitors passed along the ring."""
  C = lax.axis_size(axis)
  B, t, K, Q, Dh = q.shape
  table = sequence_positions(C * t, C, zigzag=zigzag).reshape(C, t)
  positions = jnp.asarray(table)[lax.axis_index(axis)]  # [t] global positions of this shard
  qs = _Queries(q.astype(jnp.float32), segment_ids, positions)
  ks = _Keys(k.astype(jnp.float32), v.astype(jnp.float32), segment_ids, positions)
  init = _Acc(
    jnp.full((B, K, Q, t), _NEG, jnp.float32),
    jnp.zeros((B, K, Q, t), jnp.float32),
    jnp.zeros((B, K, Q, t, Dh), jnp.float32),
  )
  acc = jax.checkpoint(_accumulate)(init, qs, ks)  # the diagonal: every query sees itself
  visit = jax.checkpoint(functools.partial(_visit, zigzag=zigzag))
  ring = [(j, (j + 1) % C) for j in range(C)]

  def step(carry, _):
    acc, ks = carry
    ks = jax.tree.map(lambda x: lax.ppermute(x, axis, ring), ks)
    return (visit(acc, qs, ks), ks), None

  (acc, _), _ = lax.scan(step, (acc, ks), length=C - 1)
  out = acc.weighted / acc.row_sum[..., None]
  return out.transpose(0, 3, 1, 2, 4).astype(q.dtype)


def ring_attention(
  q: Float[Array, 'B T K Q Dh'],
  k: Float[Array, 'B T K Dh'],
  v: Float[Array, 'B T K Dh'],
  segment_ids: Int[Array, 'B T'] | None,
  *,
  mesh: Mesh,
  axis: str,
  zigzag: bool = True,
) -> Float[Array, 'B T K Q Dh']:
  """Causal grouped-query attention with the sequence split over `axis` (module doc).

  Inputs are in layout order (zig-zag order when `zigzag`, see `to_zigzag`), sharded or not;
  the output is in the same order, with spec `sequence_spec(mesh, axis, 5)`. Per device:
  q, out [B_local, T / C, K, Q, Dh], k, v [B_local, T / C, K, Dh], segment_ids [B_local, T / C].

  Raises:
    ValueError: C (2C with zig-zag) does not divide T, or the batch does not split over the
      other mesh axes.
  """
  B, T = q.shape[:2]
  _check_batch(B, mesh, axis)
  sequence_positions(T, mesh.shape[axis], zigzag=zigzag)  # validates T
  per_device = functools.partial(_ring_per_device, axis=axis, zigzag=zigzag)
  return _sequence_shard_map(per_device, mesh, axis, (q, k, v, segment_ids), (5, 4, 4, 2))


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
