"""Exact causal attention over query and key blocks in loops, with its own backward pass.

`blockwise_causal_attention` computes softmax(q k^T / sqrt(Dh)) v for a causal (and optionally
segmented) chunk one [block, block] tile at a time: a loop over the T / block query blocks, and
for query block i a loop over key blocks 0..i only, so the upper triangle is never computed. The
softmax is accumulated across key blocks with a running maximum and sum (exact in real
arithmetic; in f32 it differs from a one-pass softmax only by rounding). The backward pass is a
`custom_vjp` that recomputes each tile from the saved log-sum-exp, so that the forward saves only
its output and one f32 value per query and head, and no pass holds more than one tile's scores.

Because both passes are loops (`lax.fori_loop`), the compiled program has one loop body whatever
T / block is: compile time and the program's memory no longer grow with the number of blocks, as
they did when every block was its own copy of the attention in the program (measured on the main
job's train program at T = 1536, block 128: see docs/results/model-and-tests.md, "Blockwise
attention in loops").

Shapes (dimension letters as in `earl_jax.config`; Q = H / K query heads per KV head, b = block):
  q        [B, T, K, Q, Dh]   k, v   [B, T, K, Dh]   segment_ids [B, T] or None
  out      [B, T, K, Q, Dh]   (q's dtype)
  lse      [B, K, Q, T]       f32 log-sum-exp of each query's scaled scores (saved for backward)
  one tile [B, K, Q, b, b]    f32

`write_rows` is the KV cache's row-wise scatter (qwen2's cache and `context_decode`'s split one).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

_NEG = float(jnp.finfo(jnp.float32).min)


def _tile(q_i, k_j, seg_q, seg_k, i, j, block, scale):
  """Scaled scores of query block i against key block j and their mask.

  q_i [B, b, K, Q, Dh], k_j [B, b, K, Dh], seg_q / seg_k [B, b] or None.
  Returns scores [B, K, Q, b, b] (f32, masked entries _NEG) and mask ([1 or B], 1, 1, b, b).
  """
  scores = jnp.einsum('BTKQd,BSKd->BKQTS', q_i, k_j) * scale
  q_pos = i * block + jnp.arange(block)
  k_pos = j * block + jnp.arange(block)
  mask = (k_pos[None, :] <= q_pos[:, None])[None]  # [1, b, b]
  if seg_q is not None:
    mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])  # [B, b, b]
  mask = mask[:, None, None]
  return jnp.where(mask, scores, _NEG), mask


def _slice(x, i, block, axis=1):
  return lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _forward(q, k, v, segment_ids, block):
  """Returns out [B, T, K, Q, Dh] (f32) and lse [B, K, Q, T] (f32)."""
  B, T, K, Q, Dh = q.shape
  scale = 1.0 / float(Dh) ** 0.5
  qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
  seg = segment_ids

  def query_block(i, carry):
    out, lse = carry
    q_i = _slice(qf, i, block)
    seg_q = None if seg is None else _slice(seg, i, block)

    def key_block(j, acc):
      # Running max, sum of exp and weighted values: [B, K, Q, b], [.., b], [.., b, Dh].
      row_max, row_sum, weighted = acc
      scores, mask = _tile(
        q_i,
        _slice(kf, j, block),
        seg_q,
        None if seg is None else _slice(seg, j, block),
        i,
        j,
        block,
        scale,
      )
      new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
      probs = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
      alpha = jnp.exp(row_max - new_max)
      row_sum = row_sum * alpha + jnp.sum(probs, axis=-1)
      values = jnp.einsum('BKQTS,BSKd->BKQTd', probs, _slice(vf, j, block))
      weighted = weighted * alpha[..., None] + values
      return new_max, row_sum, weighted

    init = (
      jnp.full((B, K, Q, block), _NEG, jnp.float32),
      jnp.zeros((B, K, Q, block), jnp.float32),
      jnp.zeros((B, K, Q, block, Dh), jnp.float32),
    )
    # Every query sees itself, so total > 0.
    row_max, row_sum, weighted = lax.fori_loop(0, i + 1, key_block, init)
    out_i = (weighted / row_sum[..., None]).transpose(0, 3, 1, 2, 4)  # [B, b, K, Q, Dh]
    out = lax.dynamic_update_slice_in_dim(out, out_i, i * block, axis=1)
    lse = lax.dynamic_update_slice_in_dim(lse, row_max + jnp.log(row_sum), i * block, axis=3)
    return out, lse

  init = (jnp.zeros((B, T, K, Q, Dh), jnp.float32), jnp.zeros((B, K, Q, T), jnp.float32))
  return lax.fori_loop(0, T // block, query_block, init)


def _backward(q, k, v, segment_ids, out, lse, d_out, block):
  """Gradients of q, k, v (f32) from the saved out and lse, one recomputed tile at a time."""
  T, Dh = q.shape[1], q.shape[-1]
  scale = 1.0 / float(Dh) ** 0.5
  qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
  do = d_out.astype(jnp.float32)
  delta = jnp.einsum('BTKQd,BTKQd->BKQT', do, out)  # rowsum(dO * O)
  seg = segment_ids

  def query_block(i, carry):
    dq, dk, dv = carry
    q_i, do_i = _slice(qf, i, block), _slice(do, i, block)
    lse_i, delta_i = _slice(lse, i, block, axis=3), _slice(delta, i, block, axis=3)
    seg_q = None if seg is None else _slice(seg, i, block)

    def key_block(j, acc):
      dq_i, dk, dv = acc
      k_j, v_j = _slice(kf, j, block), _slice(vf, j, block)
      scores, mask = _tile(
        q_i, k_j, seg_q, None if seg is None else _slice(seg, j, block), i, j, block, scale
      )
      probs = jnp.where(mask, jnp.exp(scores - lse_i[..., None]), 0.0)
      d_probs = jnp.einsum('BTKQd,BSKd->BKQTS', do_i, v_j)
      d_scores = probs * (d_probs - delta_i[..., None]) * scale
      dq_i = dq_i + jnp.einsum('BKQTS,BSKd->BTKQd', d_scores, k_j)
      dk_j = jnp.einsum('BKQTS,BTKQd->BSKd', d_scores, q_i)
      dv_j = jnp.einsum('BKQTS,BTKQd->BSKd', probs, do_i)
      dk = lax.dynamic_update_slice_in_dim(dk, _slice(dk, j, block) + dk_j, j * block, axis=1)
      dv = lax.dynamic_update_slice_in_dim(dv, _slice(dv, j, block) + dv_j, j * block, axis=1)
      return dq_i, dk, dv

    dq_i, dk, dv = lax.fori_loop(0, i + 1, key_block, (jnp.zeros_like(q_i), dk, dv))
    dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=1)
    return dq, dk, dv

  init = (jnp.zeros_like(qf), jnp.zeros_like(kf), jnp.zeros_like(vf))
  return lax.fori_loop(0, T // block, query_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segment_ids, block):
  out, _ = _forward(q, k, v, segment_ids, block)
  return out.astype(q.dtype)


def _attention_fwd(q, k, v, segment_ids, block):
  out, lse = _forward(q, k, v, segment_ids, block)
  return out.astype(q.dtype), (q, k, v, segment_ids, out, lse)


def _attention_bwd(block, residuals, d_out):
  q, k, v, segment_ids, out, lse = residuals
  dq, dk, dv = _backward(q, k, v, segment_ids, out, lse, d_out, block)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_causal_attention(
  q: Float[Array, 'B T K Q Dh'],
  k: Float[Array, 'B T K Dh'],
  v: Float[Array, 'B T K Dh'],
  *,
  block: int,
  segment_ids: Int[Array, 'B T'] | None = None,
) -> Float[Array, 'B T K Q Dh']:
  """Causal grouped-query attention, one [block, block] tile at a time (see the module doc).

  `block` must divide T. With `segment_ids` (packed rows), a query sees only the keys of its
  own segment.
  """
  T = q.shape[1]
  if block <= 0 or T % block:
    raise ValueError(f'block {block} must be a positive divisor of T={T}.')
  return _attention(q, k, v, segment_ids, block)


def cudnn_supported(dtype=jnp.bfloat16, device: jax.Device | None = None) -> bool:
  """Whether `jax.nn.dot_product_attention(..., implementation='cudnn')` compiles on `device`.

  Compiles one tiny causal grouped-query call in `dtype` (cuDNN's fused attention takes bf16 and
  f16 only) for the device (default: the first); False on any platform but CUDA, and wherever
  cuDNN refuses (an old GPU, a cuDNN without fused attention). Used to pick 'cudnn' as a model's
  `attention_impl`, with the blockwise attention as the fallback.
  """
  device = device or jax.devices()[0]
  if device.platform != 'gpu':
    return False
  on = jax.sharding.SingleDeviceSharding(device)
  q = jax.ShapeDtypeStruct((1, 128, 4, 64), dtype, sharding=on)
  kv = jax.ShapeDtypeStruct((1, 128, 2, 64), dtype, sharding=on)
  fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation='cudnn')
  try:
    jax.jit(fn).lower(q, kv, kv).compile()
  except Exception:  # cuDNN's refusals surface as several exception types
    return False
  return True


def write_rows(
  cache: Float[Array, 'B K S Dh'], positions: Int[Array, 'B T'], x: Float[Array, 'B T K Dh']
) -> Float[Array, 'B K S Dh']:
  """cache[b, :, positions[b, t]] = x[b, t] (a KV cache's K or V); positions past the capacity
  are dropped.

  Written per row (vmap), so the scatter has a batching dimension and a batch-sharded cache is
  updated locally on every shard, with no collective.
  """
  write = lambda c, p, u: c.at[:, p].set(u.swapaxes(0, 1).astype(c.dtype), mode='drop')  # noqa: E731
  return jax.vmap(write)(cache, positions, x)
