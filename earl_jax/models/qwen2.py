"""A Qwen2 / Qwen2.5 decoder in Flax NNX whose every parameter and activation is named logically.

The architecture matches HF `Qwen2ForCausalLM`: RMSNorm (computed in f32), rotate-half RoPE with a
configurable base, grouped-query attention with q/k/v bias, a SwiGLU MLP, and tied or untied
embeddings. Parameters carry logical axis names ('embed', 'heads', ...); `sharding.rules` maps
them to mesh axes, so the same model runs on any (data, fsdp, tensor) mesh.

Three ways to run it:
  * training / experience: `token_logprobs(model, tokens_BxT)`, per-token log-probs of each token
    given its prefix, computed chunk by chunk over T so that [B, T, V] logits never exist whole;
  * generation: `model(tokens_BxT, positions_BxT, cache)` writes K/V at the given positions of a
    `KVCache` whose capacity S is a context bucket, then attends to everything at or before each
    query's position (prefill of a new turn, or one-token decode);
  * `init_model` / `abstract_model` create the parameters already sharded (abstract shapes, then a
    jitted init with out_shardings), never as one unsharded copy.

Dimension letters as in `earl_jax.config` (T: tokens of this call; Q = H / K query heads share one
KV head).
"""

import dataclasses
import functools
import typing

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from earl_jax.config import ModelConfig
from earl_jax.models import attention, context_attention, context_decode
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding import rules

# Logit of a token outside a restricted vocabulary: finite, so exp() is 0 and 0 * it is not NaN.
_MASKED_LOGIT = -1e30

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def dtype_of(name: str) -> jnp.dtype:
  return _DTYPES[name]


def _param(
  rngs: nnx.Rngs, init, shape: tuple[int, ...], logical: tuple[str | None, ...], dtype
) -> nnx.Param:
  """A parameter created already sharded by its logical axes (eager sharding, current mesh)."""
  return nnx.Param(
    init(rngs.params(), shape, dtype),
    out_sharding=logical,
    sharding_rules=rules.flax_rules(),
  )


_normal = jax.nn.initializers.normal(stddev=0.02)
_zeros = jax.nn.initializers.zeros
_ones = jax.nn.initializers.ones


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, computed in f32 like HF Qwen2RMSNorm."""

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = _param(rngs, _ones, (dim,), ('norm',), param_dtype)  # [D]

  def __call__(self, x: Float[Array, '*B D']) -> Float[Array, '*B D']:
    dtype = x.dtype
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
    return (scale * x).astype(dtype)


def rope(
  x: Float[Array, 'B T Hx Dh'], positions: Int[Array, 'B T'], theta: float
) -> Float[Array, 'B T Hx Dh']:
  """Rotate-half rotary embedding (HF `apply_rotary_pos_emb`), in f32; Hx is H or K."""
  Dh = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, Dh, 2, dtype=jnp.float32) / Dh))  # [Dh/2]
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (xf * jnp.cos(emb) + rotated * jnp.sin(emb)).astype(x.dtype)


# Pytree container: its fields also hold shardings and ShapeDtypeStructs (for jit and AOT), so
# the shape annotations document it and the runtime checker skips it.
@typing.no_type_check
@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values for a batch of rows, with capacity S (a context bucket).

  Slot j of row b holds the token at position j of that row. A query at position p attends to
  slots 0..p, so slots past a row's fill hold stale values that are masked until overwritten.
  `lengths` counts the filled slots of each row; the engine advances it.

  Heads come before slots ([B, K, S, Dh]), so that the attention's matmuls batch over (B, K) with
  S and Dh contiguous, as the CPU and GPU dot kernels take them: with [B, S, K, Dh], XLA copied
  both caches of every layer into that order at every decode step (16% of the decode time at
  batch 32 on the CPU).
  """

  k: tuple[Float[Array, 'B K S Dh'], ...]
  v: tuple[Float[Array, 'B K S Dh'], ...]
  lengths: Int[Array, ' B']

  @property
  def capacity(self) -> int:
    return self.k[0].shape[2]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  LOGICAL = ('cache_batch', 'cache_kv_heads', 'cache_seq', 'head_dim')

  @classmethod
  def shardings(cls, cfg: ModelConfig, mesh: jax.sharding.Mesh) -> 'KVCache':
    kv = rules.sharding(cls.LOGICAL, mesh)
    return cls(
      k=(kv,) * cfg.num_layers,
      v=(kv,) * cfg.num_layers,
      lengths=rules.sharding(('cache_batch',), mesh),
    )

  @classmethod
  def abstract(cls, cfg: ModelConfig, batch: int, capacity: int, mesh=None) -> 'KVCache':
    """ShapeDtypeStructs (with shardings when a mesh is given) for AOT lowering."""
    shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    sh = cls.shardings(cfg, mesh) if mesh is not None else None
    kv = lambda i, s: jax.ShapeDtypeStruct(shape, dtype_of(cfg.dtype), sharding=s)  # noqa: E731
    return cls(
      k=tuple(kv(i, sh.k[i] if sh else None) for i in range(cfg.num_layers)),
      v=tuple(kv(i, sh.v[i] if sh else None) for i in range(cfg.num_layers)),
      lengths=jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sh.lengths if sh else None),
    )

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, capacity: int, mesh: jax.sharding.Mesh) -> 'KVCache':
    """A zero cache created directly in its sharded layout on `mesh`."""
    return cls.zeros_like(cls.abstract(cfg, batch, capacity, mesh))

  @staticmethod
  def zeros_like(abstract: 'KVCache') -> 'KVCache':
    """Zeros shaped and sharded like `abstract` (ShapeDtypeStructs with shardings)."""
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    return jax.jit(
      lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=shardings
    )()


def _attend(q, k, v, mask):
  """Exact softmax attention in f32: q [B, Tq, K, Q, Dh], k/v [B, Tk, K, Dh], mask [Tq, Tk]
  (every row alike) or [B, Tq, Tk] (per row: packed sequences)."""
  Dh = q.shape[-1]
  scores = jnp.einsum('BTKQd,BSKd->BKQTS', q.astype(jnp.float32), k.astype(jnp.float32))
  mask = mask[None, None, None] if mask.ndim == 2 else mask[:, None, None]
  scores = jnp.where(mask, scores / jnp.sqrt(Dh), jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum('BKQTS,BSKd->BTKQd', probs, v.astype(jnp.float32))


def causal_attention(
  q: Float[Array, 'B T H Dh'],
  k: Float[Array, 'B T K Dh'],
  v: Float[Array, 'B T K Dh'],
  *,
  block: int,
  impl: str = 'blockwise',
  segment_ids: Int[Array, 'B T'] | None = None,
) -> Float[Array, 'B T H Dh']:
  """Causal self-attention of a chunk (query t sees keys 0..t), grouped-query.

  'blockwise' (`earl_jax.models.attention`) loops over query blocks of `block` tokens and, for
  query block i, over key blocks 0..i only, so the upper triangle is never computed; the softmax
  is accumulated exactly in f32 across key blocks, and the backward pass recomputes one
  [B, H, block, block] tile at a time from the saved log-sum-exp instead of storing [B, H, T, T].
  Both passes are loops, so the program's size does not grow with T / block.
  'dot_product' calls `jax.nn.dot_product_attention` (XLA's attention); 'cudnn' the same with
  implementation='cudnn' (GPU only; packed rows fall back to XLA's, with the segment mask).
  With `segment_ids` (packed rows: several sequences side by side), a query also sees only the
  keys of its own segment.
  """
  B, T, H, Dh = q.shape
  K = k.shape[2]

  def mask(lo: int, hi: int):  # [hi - lo, hi], or [B, hi - lo, hi] with segments
    causal = jnp.arange(hi)[None, :] <= jnp.arange(lo, hi)[:, None]
    if segment_ids is None:
      return causal
    return causal[None] & (segment_ids[:, lo:hi, None] == segment_ids[:, None, :hi])

  if impl == 'cudnn' and segment_ids is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation='cudnn')
  if impl in ('dot_product', 'cudnn'):
    if segment_ids is None:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation='xla')
    return jax.nn.dot_product_attention(q, k, v, mask=mask(0, T)[:, None], implementation='xla')
  qg = q.reshape(B, T, K, H // K, Dh)
  mesh = jax.sharding.get_abstract_mesh()
  cp = mesh_lib.context_size(mesh)
  if cp > 1:
    # Context parallelism: each device holds T / cp tokens of its rows, in zig-zag order where
    # 2 cp divides T (`Qwen2.__call__` put them so), else contiguous; the kv shards go around
    # the 'context' ring, the kv heads stay split over 'tensor', in tiles sized for the rows a
    # device holds (`ring_tile`).
    tile = context_attention.ring_tile(block if block > 0 else T, cp)
    out = context_attention.ring_attention(
      qg,
      k,
      v,
      segment_ids,
      mesh=mesh,
      axis=mesh_lib.CONTEXT,
      zigzag=context_attention.uses_zigzag(T, cp),
      block=tile,
      head_axis=mesh_lib.TENSOR,
    )
    return out.reshape(B, T, H, Dh).astype(q.dtype)
  if block <= 0 or block >= T or T % block:
    out = _attend(qg, k, v, mask(0, T))
    return out.reshape(B, T, H, Dh).astype(q.dtype)
  out = attention.blockwise_causal_attention(qg, k, v, block=block, segment_ids=segment_ids)
  return out.reshape(B, T, H, Dh).astype(q.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, H, K, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = dtype_of(cfg.param_dtype)
    self.cfg = cfg
    self.q_proj = _param(rngs, _normal, (D, H, Dh), ('embed', 'heads', 'head_dim'), pd)
    self.k_proj = _param(rngs, _normal, (D, K, Dh), ('embed', 'kv_heads', 'head_dim'), pd)
    self.v_proj = _param(rngs, _normal, (D, K, Dh), ('embed', 'kv_heads', 'head_dim'), pd)
    self.o_proj = _param(rngs, _normal, (H, Dh, D), ('heads', 'head_dim', 'embed'), pd)
    if cfg.qkv_bias:
      self.q_bias = _param(rngs, _zeros, (H, Dh), ('heads', 'head_dim'), pd)
      self.k_bias = _param(rngs, _zeros, (K, Dh), ('kv_heads', 'head_dim'), pd)
      self.v_bias = _param(rngs, _zeros, (K, Dh), ('kv_heads', 'head_dim'), pd)

  def _project(self, x, w, b, heads: str, logical):
    """x [B, T, D] -> [B, T, heads, Dh] by the weights w [D, heads, Dh] (and bias b); `heads` is
    the projection's head letter: 'H' (queries) or 'K' (keys, values)."""
    dtype = x.dtype
    y = jnp.einsum(f'BTD,D{heads}d->BT{heads}d', x, w[...].astype(dtype))
    if self.cfg.qkv_bias:
      y = y + b[...].astype(dtype)[None, None]
    return rules.constrain(y, logical)

  def __call__(
    self,
    x: Float[Array, 'B T D'],
    positions: Int[Array, 'B T'],
    kv: tuple[Float[Array, 'B K S Dh'], Float[Array, 'B K S Dh']] | None,
    segment_ids: Int[Array, 'B T'] | None = None,
  ) -> tuple[Float[Array, 'B T D'], tuple | None]:
    """Self-attention of x at `positions`: without `kv` (training, experience) the chunk
    attends to itself causally; with `kv` (generation) its K/V are written into the cache at
    `positions` and it attends to the cache. Returns the output and the updated (k, v) cache."""
    cfg = self.cfg
    q = self._project(
      x, self.q_proj, getattr(self, 'q_bias', None), 'H', ('batch', 'seq', 'act_heads', 'head_dim')
    )
    kv_logical = ('batch', 'seq', 'act_kv_heads', 'head_dim')
    k = self._project(x, self.k_proj, getattr(self, 'k_bias', None), 'K', kv_logical)
    v = self._project(x, self.v_proj, getattr(self, 'v_bias', None), 'K', kv_logical)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)

    if kv is None:
      # Training / experience: the chunk attends to itself, causally (positions are 0..T-1).
      out = causal_attention(
        q, k, v, block=cfg.attention_block, impl=cfg.attention_impl, segment_ids=segment_ids
      )
      new_kv = None
    else:
      out, new_kv = self._attend_cache(q, k, v, positions, kv)
      out = out.astype(x.dtype)
    out = rules.constrain(out, ('batch', 'seq', 'act_heads', 'head_dim'))
    y = jnp.einsum('BTHd,HdD->BTD', out, self.o_proj[...].astype(x.dtype))
    return rules.constrain(y, ('batch', 'seq', 'act_embed')), new_kv

  def _attend_cache(
    self,
    q: Float[Array, 'B T H Dh'],
    k: Float[Array, 'B T K Dh'],
    v: Float[Array, 'B T K Dh'],
    positions: Int[Array, 'B T'],
    kv: tuple[Float[Array, 'B K S Dh'], Float[Array, 'B K S Dh']],
  ) -> tuple[Float[Array, 'B T H Dh'], tuple[Float[Array, 'B K S Dh'], Float[Array, 'B K S Dh']]]:
    """Generation: writes k, v into the cache at `positions`, then attends each query to the
    cache slots at or before its position. Returns the output in f32 and the updated cache."""
    B, T, H, Dh = q.shape
    K = self.cfg.num_kv_heads
    Q = H // K
    k_cache, v_cache = kv
    S = k_cache.shape[2]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh_lib.context_size(mesh) > 1:
      # Context parallelism: each device holds S / cp slots of the cache (its kv heads split
      # over 'tensor'); it writes the new tokens that fall in its slots and attends to those,
      # and the partial softmax statistics combine over the 'context' axis (split-K).
      split = {'mesh': mesh, 'axis': mesh_lib.CONTEXT, 'head_axis': mesh_lib.TENSOR}
      k_cache, v_cache = context_decode.sharded_cache_write(
        k_cache, v_cache, k, v, positions, **split
      )
      out = context_decode.sharded_decode_attention(
        q.reshape(B, T, K, Q, Dh), k_cache, v_cache, positions, **split
      )
      return out.reshape(B, T, H, Dh), (k_cache, v_cache)
    # Positions past the capacity are dropped (padding of a chunk that ends near the end).
    k_cache = attention.write_rows(k_cache, positions, k)
    v_cache = attention.write_rows(v_cache, positions, v)
    k_cache = rules.constrain(k_cache, KVCache.LOGICAL)
    v_cache = rules.constrain(v_cache, KVCache.LOGICAL)
    # Queries as [B, K, J, Dh] with J = Q * T: both matmuls batch over (B, K) and contract over
    # Dh, then over S, with the cache's S and Dh contiguous (no copy of the cache at any step).
    # The matmuls take the cache in its own dtype and accumulate in f32 (a bf16 cache is never
    # converted whole at each step).
    qg = q.reshape(B, T, K, Q, Dh).transpose(0, 2, 3, 1, 4).reshape(B, K, Q * T, Dh)
    scores = jnp.einsum(
      'BKJd,BKSd->BKJS', qg.astype(k_cache.dtype), k_cache, preferred_element_type=jnp.float32
    ) / jnp.sqrt(Dh)
    visible = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    visible = jnp.broadcast_to(visible[:, None], (B, Q, T, S)).reshape(B, 1, Q * T, S)
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
      'BKJS,BKSd->BKJd', probs.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32
    )
    out = out.reshape(B, K, Q, T, Dh).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, T, H, Dh), (k_cache, v_cache)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, F = cfg.hidden_size, cfg.intermediate_size
    pd = dtype_of(cfg.param_dtype)
    self.gate_proj = _param(rngs, _normal, (D, F), ('embed', 'mlp'), pd)
    self.up_proj = _param(rngs, _normal, (D, F), ('embed', 'mlp'), pd)
    self.down_proj = _param(rngs, _normal, (F, D), ('mlp', 'embed'), pd)

  def __call__(self, x: Float[Array, 'B T D']) -> Float[Array, 'B T D']:
    dtype = x.dtype
    gate = jnp.einsum('BTD,DF->BTF', x, self.gate_proj[...].astype(dtype))
    up = jnp.einsum('BTD,DF->BTF', x, self.up_proj[...].astype(dtype))
    h = rules.constrain(jax.nn.silu(gate) * up, ('batch', 'seq', 'act_mlp'))
    y = jnp.einsum('BTF,FD->BTD', h, self.down_proj[...].astype(dtype))
    return rules.constrain(y, ('batch', 'seq', 'act_embed'))


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = dtype_of(cfg.param_dtype)
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
    self.self_attn = Attention(cfg, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
      cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs
    )
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, kv, segment_ids=None):
    h, kv = self.self_attn(self.input_layernorm(x), positions, kv, segment_ids)
    x = x + h
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, kv


@functools.partial(jax.jit, static_argnums=0)
def _layer_forward(graphdef, state, x, positions, segment_ids):
  """One decoder layer without a cache (training and experience forwards), as its own traced
  function: every layer of a model has the same graph and shapes, so the L layers, and their
  derivatives under `jax.grad`, are traced and lowered once instead of L times (XLA inlines the
  calls, so the compiled program is that of the layers written out). The trace is also what a
  program loaded from the persistent cache pays, since the cache key needs it."""
  return nnx.merge(graphdef, state)(x, positions, None, segment_ids)[0]


class Qwen2(nnx.Module):
  """The decoder. `__call__` returns final hidden states; `logits` applies the LM head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = dtype_of(cfg.param_dtype)
    self.cfg = cfg
    self.embed_tokens = _param(
      rngs, _normal, (cfg.vocab_size, cfg.hidden_size), ('vocab', 'embed'), pd
    )  # [V, D]
    self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd, rngs=rngs)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(
        rngs, _normal, (cfg.hidden_size, cfg.vocab_size), ('embed', 'vocab'), pd
      )  # [D, V]

  def __call__(
    self,
    tokens: Int[Array, 'B T'],
    positions: Int[Array, 'B T'],
    cache: KVCache | None = None,
    segment_ids: Int[Array, 'B T'] | None = None,
  ) -> tuple[Float[Array, 'B T D'], KVCache | None]:
    """Final hidden states of `tokens` at `positions`; with a cache, also the updated cache.

    With a cache the new K/V are written at `positions` and `cache.lengths` is left unchanged
    (the caller knows how many of the T tokens are real). Without one, `segment_ids` marks the
    sequences packed side by side in a row (attention stays within a segment).

    On a context-parallel mesh (cp > 1) without a cache, the tokens, positions and segment ids
    are put in zig-zag order first where 2 cp divides T (`context_attention.uses_zigzag`), so
    that each device holds a chunk from each end of the sequence and the ring attention's causal
    work is balanced; the hidden states come back in sequence order.
    """
    dtype = dtype_of(self.cfg.dtype)
    cp = mesh_lib.context_size(jax.sharding.get_abstract_mesh())
    zigzag = cache is None and context_attention.uses_zigzag(tokens.shape[1], cp)
    if zigzag:
      tokens, positions = (context_attention.to_zigzag(a, cp) for a in (tokens, positions))
      if segment_ids is not None:
        segment_ids = context_attention.to_zigzag(segment_ids, cp)
    # Gather the table over FSDP first (as for every weight), so the lookup is a local gather on
    # the vocab shard plus a reduction over 'tensor'.
    table = rules.constrain(self.embed_tokens[...], ('vocab', None))
    x = jnp.take(table, tokens, axis=0).astype(dtype)
    x = rules.constrain(x, ('batch', 'seq', 'act_embed'))
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      if cache is None:
        x = _layer_forward(*nnx.split(layer), x, positions, segment_ids)
        continue
      x, (k, v) = layer(x, positions, (cache.k[i], cache.v[i]), segment_ids)
      new_k.append(k)
      new_v.append(v)
    h = self.norm(x)
    if cache is None:
      if zigzag:
        h = rules.constrain(context_attention.from_zigzag(h, cp), ('batch', 'seq', 'act_embed'))
      return h, None
    return h, dataclasses.replace(cache, k=tuple(new_k), v=tuple(new_v))

  def logits(self, h: Float[Array, '*B D']) -> Float[Array, '*B V']:
    """LM-head logits in f32."""
    h = h.astype(jnp.float32)
    if self.cfg.tie_word_embeddings:
      return jnp.einsum('...D,VD->...V', h, self.embed_tokens[...].astype(jnp.float32))
    return jnp.einsum('...D,DV->...V', h, self.lm_head[...].astype(jnp.float32))


def token_logprobs(
  model: Qwen2,
  tokens: Int[Array, 'B T'],
  temperature: float = 1.0,
  token_ids: tuple[int, ...] | None = None,
  segments: tuple[Int[Array, 'B T'], Int[Array, 'B T']] | None = None,
) -> Float[Array, 'B T']:
  """log p(tokens[b, t] | tokens[b, :t]) for t >= 1 under softmax(logits / temperature); col 0 is 0.

  `temperature` is the sampling temperature of the rollout that produced the tokens, so that
  these are the log-probs of the policy that actually sampled them (the sampler records the same).
  `token_ids` restricts the distribution to those vocabulary ids (constrained decoding: the
  softmax runs over them alone, as in `sampler.sample_token`); a token outside the set, which the
  policy can never have generated, gets log-prob 0. Right padding never changes the log-probs of
  real tokens (attention is causal). The LM head and the log-softmax run on chunks of
  `cfg.logprob_chunk` positions under `jax.checkpoint`, so the forward holds one [B, C, V] chunk
  at a time and the backward recomputes it.

  `segments` = (segment_ids, positions) of packed rows: several sequences side by side, each
  with its own positions from 0; attention stays within a segment, and the first token of a
  segment (which has no prefix in its row) gets log-prob 0, as column 0 does.
  """
  return _next_token_stats(model, tokens, temperature, token_ids, segments, entropy=False).logprobs


def token_logprobs_and_entropy(
  model: Qwen2,
  tokens: Int[Array, 'B T'],
  temperature: float = 1.0,
  token_ids: tuple[int, ...] | None = None,
  segments: tuple[Int[Array, 'B T'], Int[Array, 'B T']] | None = None,
) -> tuple[Float[Array, 'B T'], Float[Array, 'B T']]:
  """`token_logprobs`, and the entropy (nats) of the tempered distribution each token came from.

  entropy[b, t] = H(softmax(logits(tokens[b, :t]) / temperature)) for t >= 1 (over `token_ids`
  alone when given); col 0 is 0. It is computed in the same [B, C, V] chunks as the log-probs
  (one extra reduction per chunk).
  """
  stats = _next_token_stats(model, tokens, temperature, token_ids, segments, entropy=True)
  assert stats.entropy is not None
  return stats.logprobs, stats.entropy


class TokenStats(typing.NamedTuple):
  """Per token t (column 0 and each segment's first token 0): log p(tokens[t] | tokens[:t]), and,
  when asked for (else None), the entropy of that distribution and the log of the probability
  it gives a subset of tokens."""

  logprobs: Float[Array, 'B T']
  entropy: Float[Array, 'B T'] | None
  subset_logprobs: Float[Array, 'B T'] | None


def token_stats(
  model: Qwen2,
  tokens: Int[Array, 'B T'],
  temperature: float = 1.0,
  token_ids: tuple[int, ...] | None = None,
  segments: tuple[Int[Array, 'B T'], Int[Array, 'B T']] | None = None,
  *,
  entropy: bool = False,
  subset: tuple[Int[Array, 'B T'], tuple[int, ...]] | None = None,
) -> TokenStats:
  """`token_logprobs`, with the entropy when `entropy`, and with `subset` = (bits, ids) the
  log-probability of a subset of tokens: subset_logprobs[b, t] = log sum_k p(ids[k]) over the k
  whose bit is set in bits[b, t], under the distribution that tokens[b, t] came from (0 where
  no bit is set). The rules' label of the replies that are legal there (`Batch.legal_moves`
  over the environment's move tokens): one more reduction of each [B, C, V] chunk.
  """
  return _next_token_stats(
    model, tokens, temperature, token_ids, segments, entropy=entropy, subset=subset
  )


def _allowed(vocab_size: int, token_ids: tuple[int, ...]) -> np.ndarray:
  """bool [V]: True at `token_ids` (a trace-time constant)."""
  allowed = np.zeros(vocab_size, bool)
  allowed[list(token_ids)] = True
  return allowed


def restrict_logits(
  logits: Float[Array, '*B V'], token_ids: tuple[int, ...]
) -> Float[Array, '*B V']:
  """Logits outside `token_ids` set to a large finite negative (exp -> 0, no inf * 0 NaNs)."""
  return jnp.where(_allowed(logits.shape[-1], token_ids), logits, _MASKED_LOGIT)


def _next_token_stats(
  model: Qwen2,
  tokens: Int[Array, 'B T'],
  temperature: float,
  token_ids: tuple[int, ...] | None,
  segments: tuple[Int[Array, 'B T'], Int[Array, 'B T']] | None,
  *,
  entropy: bool,
  subset: tuple[Int[Array, 'B T'], tuple[int, ...]] | None = None,
) -> TokenStats:
  """The values of `token_stats`: one forward, then the LM head over chunks of C positions
  (`_chunk_stats`), shifted so column t holds token t's value."""
  B, T = tokens.shape
  if segments is None:
    segment_ids = None
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  else:
    segment_ids, positions = segments
  h, _ = model(tokens, positions, segment_ids=segment_ids)
  # Hidden state at t predicts token t + 1.
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
  C = min(model.cfg.logprob_chunk, T)
  if T % C:
    C = T  # T is a bucket length; a bucket that the chunk does not divide is done in one piece.
  num_chunks = T // C
  h_chunks = h.reshape(B, num_chunks, C, h.shape[-1]).swapaxes(0, 1)  # [num_chunks, B, C, D]
  target_chunks = targets.reshape(B, num_chunks, C).swapaxes(0, 1)  # [num_chunks, B, C]
  chunks = (h_chunks, target_chunks)
  subset_ids = None
  if subset is not None:  # the bits of token t + 1's distribution, aligned with its target
    bits, subset_ids = subset
    bits = jnp.concatenate([bits[:, 1:], jnp.zeros((B, 1), bits.dtype)], axis=1)
    chunks += (bits.reshape(B, num_chunks, C).swapaxes(0, 1),)

  @jax.checkpoint
  def chunk_stats(h_BxCxD, targets_BxC, *bits_BxC):
    return _chunk_stats(
      model,
      h_BxCxD,
      targets_BxC,
      temperature,
      token_ids,
      entropy=entropy,
      subset=(*bits_BxC, subset_ids) if bits_BxC else None,
    )

  # [num_chunks, B, C] each.
  stats = jax.lax.map(lambda args: chunk_stats(*args), chunks)
  return TokenStats(*(None if x is None else _shift_to_tokens(x, segment_ids) for x in stats))


def _chunk_stats(
  model: Qwen2,
  h_BxCxD: Float[Array, 'B C D'],
  targets_BxC: Int[Array, 'B C'],
  temperature: float,
  token_ids: tuple[int, ...] | None,
  *,
  entropy: bool,
  subset: tuple[Int[Array, 'B C'], tuple[int, ...]] | None = None,
) -> TokenStats:
  """Log-prob of each target under softmax(logits / temperature) (restricted to `token_ids`),
  with `entropy` the entropy of that distribution, and with `subset` the log of the probability
  it gives the subset's tokens (`token_stats`), for one chunk of C positions."""
  V = model.cfg.vocab_size
  logits = rules.constrain(model.logits(h_BxCxD), ('batch', 'seq', 'act_vocab'))
  if temperature != 1.0:
    logits = logits / temperature
  if token_ids is not None:
    logits = restrict_logits(logits, token_ids)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.sum(logits * jax.nn.one_hot(targets_BxC, V, dtype=logits.dtype), axis=-1)
  logp = picked - lse
  if token_ids is not None:  # targets the restricted policy cannot produce (prompt tokens)
    logp = jnp.where(jnp.asarray(_allowed(V, token_ids))[targets_BxC], logp, 0.0)
  ent = subset_logp = None
  if entropy:
    # H = lse - E_p[logits], with p = exp(logits - lse).
    mean_logit = jnp.sum(jnp.exp(logits - lse[..., None]) * logits, axis=-1)
    ent = lse - mean_logit
  if subset is not None:
    bits_BxC, subset_ids = subset
    K = len(subset_ids)
    member = (bits_BxC[..., None] >> jnp.arange(K, dtype=bits_BxC.dtype)[None, None]) & 1
    chosen = logits[..., jnp.asarray(subset_ids)]  # [B, C, K]
    subset_lse = jax.nn.logsumexp(jnp.where(member > 0, chosen, _MASKED_LOGIT), axis=-1)
    subset_logp = jnp.where(bits_BxC > 0, subset_lse - lse, 0.0)
  return TokenStats(logp, ent, subset_logp)


def _shift_to_tokens(
  per_chunk: Float[Array, 'chunks B C'], segment_ids: Int[Array, 'B T'] | None
) -> Float[Array, 'B T']:
  """[chunks, B, C] chunk values -> [B, T], moved one position right (the value for token t + 1 sits
  at t + 1); 0 at column 0 and at the first token of every segment (its prefix is another
  sequence)."""
  num_chunks, B, C = per_chunk.shape
  x = per_chunk.swapaxes(0, 1).reshape(B, num_chunks * C)
  x = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), x[:, :-1]], axis=1)
  if segment_ids is None:
    return x
  first = jnp.concatenate(
    [jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
  )
  return jnp.where(first, 0.0, x)


def abstract_model(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> tuple[nnx.GraphDef, nnx.State]:
  """The graph definition and ShapeDtypeStructs (with target shardings) of the parameters."""
  return nnx.get_abstract_model(lambda: Qwen2(cfg, rngs=nnx.Rngs(0)), mesh)


def state_shardings(abstract_state: nnx.State) -> nnx.State:
  return jax.tree.map(lambda a: a.sharding, abstract_state)


def init_model(
  cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int = 0
) -> tuple[nnx.GraphDef, nnx.State]:
  """Random parameters created directly in their sharded layout on `mesh`."""
  from earl_jax.sharding import mesh as mesh_lib

  mesh_lib.check_model_fits(mesh_lib.parallel_config_of(mesh), cfg)
  graphdef, abstract = abstract_model(cfg, mesh)

  def init():
    return nnx.state(Qwen2(cfg, rngs=nnx.Rngs(seed)))

  with jax.set_mesh(mesh):
    state = jax.jit(init, out_shardings=state_shardings(abstract))()
  return graphdef, state
