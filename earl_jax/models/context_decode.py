"""Decode attention over a KV cache whose sequence (slot) dimension is split across devices.

The cache is qwen2's `KVCache` layout, one layer at a time: k, v [B, K, S, Dh], slot j of row b
holding the token at position j. Over the mesh axis `axis` (C devices) the slots are split in
contiguous slices: device i holds slots [i * s, (i + 1) * s), s = S / C. The kv heads may be
split over `head_axis` (the model's 'tensor'); every other mesh axis splits the batch, as in
`context_attention`: on a ('data', 'context') mesh the cache spec is `cache_spec` =
P('data', None, 'context', None), and q, the output and the positions are P('data', None, ...)
(replicated over `axis`); with head_axis='tensor' the cache is P(batch, 'tensor', 'context',
None) and q P(batch, None, 'tensor', None, None).

Masking. Exactly `qwen2.Attention._attend_cache`'s rule: a query at position p sees slot j iff
j <= p; the queries' positions are given. In a decode step the N new tokens of row b sit at
positions lengths[b] - N .. lengths[b] - 1 (`decode_positions`), so query n sees slots
j <= lengths[b] - N + n; slots past it may hold stale values and are never read. N = 1 is a
decode step; N > 1 a chunk (a prompt's, or a new turn's).

Split-K combine (flash decoding). Device i scores its queries against its own slots only and
keeps, per query (in f32): the local max m_i of the masked scores, the local sum l_i of
exp(score - m_i) and the local weighted values o_i = sum exp(score - m_i) v. Then, across
`axis`: M = pmax(m_i), and with a_i = exp(m_i - M) the output is
psum(a_i o_i) / psum(a_i l_i), which is softmax(scores) v over all S slots. The traffic is two
all-reduces of [B, K, Q * N] and one of [B, K, Q * N, Dh] per layer; no slot moves.

Why no NaN. Masked scores are set to finfo(f32).min, a finite number (not -inf), as qwen2 does.
A device whose slice holds no visible slot for a query has m_i = min and exp(min - min) = 1 on
its slots, so l_i and o_i are finite; if some other device sees a slot, M is a real score and
a_i = exp(min - M) = 0, so that device adds nothing. A query that sees no slot at all (only when
a negative position) gets every a_i = 1: the mean of v over the cache, exactly what qwen2's softmax
over all-min scores returns. No inf - inf, no 0 / 0.

Writes (`sharded_cache_write`). The N new tokens (replicated over `axis`) reach every device of
their batch shard; each shifts the positions into its slice and scatters only those that fall
in it (qwen2's row-wise scatter with mode='drop'; the rest are pointed past the slice end), so
nothing of the cache is gathered or sent. A prefill of a whole [B, T] prompt is the same call
with N = T (pad positions with any value >= S, which every device drops): it differs only in
that a prompt arriving split over `axis` (from ring attention) is all-gathered by shard_map to
the T new k, v per device, the size of the prompt's k, v, never of the cache.

Per-device shapes (b = B / the product of the batch axes' sizes, s = S / C, k = K / the size of
`head_axis` (K without one), J = Q * N):
  q, out            [b, N, k, Q, Dh]      (out in f32, as qwen2's cache attention returns it)
  cache_k, cache_v  [b, k, s, Dh]         positions [b, N]      new_k, new_v [b, N, k, Dh]
  scores            [b, k, J, s]          m_i, l_i [b, k, J]    o_i [b, k, J, Dh]
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from earl_jax.models import attention
from earl_jax.models import context_attention as ca

_NEG = float(jnp.finfo(jnp.float32).min)


# Specs and checks.


def batch_spec(mesh: Mesh, axis: str, ndim: int, head_axis: str | None = None) -> P:
  """P(batch axes, None, ...): the batch over every mesh axis but `axis` and `head_axis`,
  replicated over `axis`; with `head_axis`, dimension 2 (the kv heads of a [B, N, K, ...] array)
  over it."""
  batch = ca.sequence_spec(mesh, axis, 2, head_axis)[0]
  if head_axis is None or ndim < 3:
    return P(batch, *([None] * (ndim - 1)))
  return P(batch, None, head_axis, *([None] * (ndim - 3)))


def cache_spec(mesh: Mesh, axis: str, head_axis: str | None = None) -> P:
  """The spec of a [B, K, S, Dh] cache: the batch as in `batch_spec`, the kv heads over
  `head_axis` (when given), the slots S over `axis`."""
  return P(ca.sequence_spec(mesh, axis, 2, head_axis)[0], head_axis, axis, None)


def _check(B: int, S: int, mesh: Mesh, axis: str, head_axis: str | None) -> None:
  if S % mesh.shape[axis]:
    raise ValueError(
      f'A cache of S = {S} slots does not split over the C = {mesh.shape[axis]} devices of '
      f'axis {axis!r}: C must divide S.'
    )
  ca._check_batch(B, mesh, axis, head_axis)


def decode_positions(lengths: Int[Array, ' B'], N: int) -> Int[Array, 'B N']:
  """Positions of the last N written tokens of each row: lengths[b] - N + n."""
  return lengths[:, None] - N + jnp.arange(N, dtype=lengths.dtype)[None, :]


# Decode attention.


def _local_softmax(
  q: Float[Array, 'b N K Q Dh'],
  k: Float[Array, 'b K s Dh'],
  v: Float[Array, 'b K s Dh'],
  positions: Int[Array, 'b N'],
  first_slot: Int[Array, ''],
) -> tuple[Float[Array, 'b K J'], Float[Array, 'b K J'], Float[Array, 'b K J Dh']]:
  """Local max, sum of exp and weighted values of the queries over slots first_slot + [0, s).

  Same query order, matmuls and mask as qwen2's `_attend_cache`: J = Q * N (query head major),
  the cache in its own dtype with f32 accumulation.
  """
  b, N, K, Q, Dh = q.shape
  s = k.shape[2]
  qg = q.transpose(0, 2, 3, 1, 4).reshape(b, K, Q * N, Dh)
  scores = jnp.einsum(
    'bKJd,bKsd->bKJs', qg.astype(k.dtype), k, preferred_element_type=jnp.float32
  ) / jnp.sqrt(Dh)
  slots = first_slot + jnp.arange(s)
  visible = slots[None, None, :] <= positions[:, :, None]  # [b, N, s]
  visible = jnp.broadcast_to(visible[:, None], (b, Q, N, s)).reshape(b, 1, Q * N, s)
  scores = jnp.where(visible, scores, _NEG)
  # The max only shifts the exponent (the output does not depend on it): no gradient through it.
  row_max = lax.stop_gradient(jnp.max(scores, axis=-1))
  probs = jnp.exp(scores - row_max[..., None])  # masked slots: 0, or 1 if none is visible
  weighted = jnp.einsum(
    'bKJs,bKsd->bKJd', probs.astype(v.dtype), v, preferred_element_type=jnp.float32
  )
  return row_max, jnp.sum(probs, axis=-1), weighted


def _combine(
  row_max: Float[Array, 'b K J'],
  row_sum: Float[Array, 'b K J'],
  weighted: Float[Array, 'b K J Dh'],
  axis: str,
) -> Float[Array, 'b K J Dh']:
  """The split-K combine across `axis` (module doc): rescale to the global max, then sum."""
  scale = jnp.exp(row_max - lax.pmax(row_max, axis))  # 0 for a device with nothing visible
  total = lax.psum(row_sum * scale, axis)
  return lax.psum(weighted * scale[..., None], axis) / total[..., None]


def _decode_per_device(
  q: Float[Array, 'b N K Q Dh'],
  k: Float[Array, 'b K s Dh'],
  v: Float[Array, 'b K s Dh'],
  positions: Int[Array, 'b N'],
  *,
  axis: str,
) -> Float[Array, 'b N K Q Dh']:
  b, N, K, Q, Dh = q.shape
  first_slot = lax.axis_index(axis) * k.shape[2]
  out = _combine(*_local_softmax(q, k, v, positions, first_slot), axis)
  return out.reshape(b, K, Q, N, Dh).transpose(0, 3, 1, 2, 4)


def sharded_decode_attention(
  q: Float[Array, 'B N K Q Dh'],
  cache_k: Float[Array, 'B K S Dh'],
  cache_v: Float[Array, 'B K S Dh'],
  positions: Int[Array, 'B N'],
  *,
  mesh: Mesh,
  axis: str,
  head_axis: str | None = None,
) -> Float[Array, 'B N K Q Dh']:
  """Attention of N new queries per row, at `positions`, to a cache split along its slots over
  `axis` (and its kv heads over `head_axis`, when given).

  The new tokens' k, v are already written (`sharded_cache_write`); query n of row b sees slots
  <= positions[b, n] (module doc; `decode_positions` gives a decode step's). Inputs sharded or
  not; the cache is taken in `cache_spec`. Returns f32, spec `batch_spec(mesh, axis, 5,
  head_axis)` (replicated over `axis`). Per device: q, out [b, N, k, Q, Dh], cache
  [b, k, S / C, Dh], positions [b, N].

  Raises:
    ValueError: C does not divide S, or the batch does not split over the other mesh axes.
  """
  _check(q.shape[0], cache_k.shape[2], mesh, axis, head_axis)
  rows = batch_spec(mesh, axis, 5, head_axis)
  cache = cache_spec(mesh, axis, head_axis)
  return jax.shard_map(
    functools.partial(_decode_per_device, axis=axis),
    mesh=mesh,
    in_specs=(rows, cache, cache, batch_spec(mesh, axis, 2, head_axis)),
    out_specs=rows,
  )(q, cache_k, cache_v, positions)


# Cache writes.


def _write_per_device(
  cache_k: Float[Array, 'b K s Dh'],
  cache_v: Float[Array, 'b K s Dh'],
  new_k: Float[Array, 'b N K Dh'],
  new_v: Float[Array, 'b N K Dh'],
  positions: Int[Array, 'b N'],
  *,
  axis: str,
) -> tuple[Float[Array, 'b K s Dh'], Float[Array, 'b K s Dh']]:
  """Scatters the tokens whose position falls in this device's slice; the others are pointed
  at slot s (past the end), which the scatter drops (negative indices would wrap)."""
  s = cache_k.shape[2]
  local = positions - lax.axis_index(axis) * s
  local = jnp.where((local >= 0) & (local < s), local, s)
  return attention.write_rows(cache_k, local, new_k), attention.write_rows(cache_v, local, new_v)


def sharded_cache_write(
  cache_k: Float[Array, 'B K S Dh'],
  cache_v: Float[Array, 'B K S Dh'],
  new_k: Float[Array, 'B N K Dh'],
  new_v: Float[Array, 'B N K Dh'],
  positions: Int[Array, 'B N'],
  *,
  mesh: Mesh,
  axis: str,
  head_axis: str | None = None,
) -> tuple[Float[Array, 'B K S Dh'], Float[Array, 'B K S Dh']]:
  """cache[b, :, positions[b, n]] = new[b, n] on a cache split along its slots over `axis` (and
  its kv heads over `head_axis`, when given).

  Each device writes only the positions in its slice; positions outside [0, S) are dropped
  everywhere (qwen2 drops those >= S). Also the prefill: N = T prompt tokens (module doc).
  Returns the caches in `cache_spec` (donate them in the caller's jit to update in place).
  Per device: cache [b, k, S / C, Dh], new [b, N, k, Dh], positions [b, N].

  Raises:
    ValueError: C does not divide S, or the batch does not split over the other mesh axes.
  """
  _check(cache_k.shape[0], cache_k.shape[2], mesh, axis, head_axis)
  cache, rows = cache_spec(mesh, axis, head_axis), batch_spec(mesh, axis, 4, head_axis)
  return jax.shard_map(
    functools.partial(_write_per_device, axis=axis),
    mesh=mesh,
    in_specs=(cache, cache, rows, rows, batch_spec(mesh, axis, 2, head_axis)),
    out_specs=(cache, cache),
  )(cache_k, cache_v, new_k, new_v, positions)


# Dense reference.


def reference_decode_attention(
  q: Float[Array, 'B N K Q Dh'],
  cache_k: Float[Array, 'B K S Dh'],
  cache_v: Float[Array, 'B K S Dh'],
  lengths: Int[Array, ' B'],
) -> Float[Array, 'B N K Q Dh']:
  """One-device softmax(q k^T / sqrt(Dh)) v over the cache in f32, with qwen2's cache mask
  (slot <= lengths[b] - N + n, masked scores at finfo(f32).min). Returns f32."""
  N, Dh, S = q.shape[1], q.shape[-1], cache_k.shape[2]
  scores = jnp.einsum(
    'BNKQd,BKSd->BKQNS', q.astype(jnp.float32), cache_k.astype(jnp.float32)
  ) / np.sqrt(Dh)
  visible = jnp.arange(S)[None, None, :] <= decode_positions(lengths, N)[:, :, None]
  scores = jnp.where(visible[:, None, None], scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum('BKQNS,BKSd->BNKQd', probs, cache_v.astype(jnp.float32))
