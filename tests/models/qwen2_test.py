"""The Qwen2 decoder: parity with HF on four meshes, KV-cache decode, padding, traces, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax import buckets
from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.models import context_attention, hf_import, qwen2
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.testing import fixture_path, logprob_fn, small_mesh

MESHES = [(1, 1), (8, 1), (2, 4), (4, 2)]  # (dp, tp)


@pytest.fixture(scope='module')
def reference():
  return dict(np.load(fixture_path('qwen2_tiny_reference.npz')))


def _rows_for(mesh, tokens):
  """Repeat the reference rows so the batch divides the mesh's batch shards."""
  shards = mesh_lib.parallel_config_of(mesh).batch_shards
  rows = -(-tokens.shape[0] // shards) * shards
  return np.resize(tokens, (rows, tokens.shape[1]))


def _full_logits(graphdef, state, tokens):
  model = nnx.merge(graphdef, state)
  T = tokens.shape[1]
  h, _ = model(tokens, jnp.broadcast_to(jnp.arange(T), tokens.shape))
  return model.logits(h)


@pytest.mark.parametrize(
  'checkpoint,key', [('qwen2_tiny', 'logits_untied'), ('qwen2_tiny_tied', 'logits_tied')]
)
@pytest.mark.parametrize('dp,tp', MESHES)
def test_matches_hf_reference_logits(reference, checkpoint, key, dp, tp):
  mesh = small_mesh(dp=dp, tp=tp)
  cfg, graphdef, state = hf_import.load(fixture_path(checkpoint), mesh)
  n = reference['tokens'].shape[0]
  tokens = _rows_for(mesh, reference['tokens'])
  with jax.set_mesh(mesh):
    logits = jax.jit(_full_logits, static_argnums=0)(graphdef, state, jnp.asarray(tokens))
  assert logits.shape == (tokens.shape[0], tokens.shape[1], cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(logits)[:n], reference[key], atol=1e-4, rtol=0)
  # The logits and the parameters really are split over the mesh.
  q = state['layers'][0]['self_attn']['q_proj'][...]
  assert q.sharding.spec == jax.sharding.PartitionSpec('fsdp', 'tensor', None)
  assert q.addressable_data(0).shape == (cfg.hidden_size, cfg.num_heads // tp, cfg.head_dim)


@pytest.mark.parametrize('dp,tp,cp,pad', [(2, 1, 4, 0), (2, 2, 2, 0), (2, 1, 4, 4)])
def test_context_parallel_layouts_match_the_reference_in_values_and_gradients(
  reference, dp, tp, cp, pad
):
  """Each sequence split over 'context' (ring attention around it, kv heads over 'tensor'): the
  HF reference's logits, and the gradients of a weighted log-prob sum equal to the unsplit
  mesh's. T = 32 runs in zig-zag order (2 cp divides it); padded to 36 over cp = 4, in the
  contiguous order."""
  mesh = small_mesh(dp=dp, tp=tp, cp=cp)
  _, graphdef, state = hf_import.load(fixture_path('qwen2_tiny'), mesh)
  n = reference['tokens'].shape[0]
  tokens = np.pad(_rows_for(mesh, reference['tokens']), ((0, 0), (0, pad)), constant_values=7)
  assert context_attention.uses_zigzag(tokens.shape[1], cp) == (pad == 0)
  tokens = jnp.asarray(tokens)
  with jax.set_mesh(mesh):
    logits = jax.jit(_full_logits, static_argnums=0)(graphdef, state, tokens)
  np.testing.assert_allclose(
    np.asarray(logits)[:n, :32], reference['logits_untied'], atol=1e-4, rtol=0
  )
  assert logits.sharding.spec[1] == 'context'  # the tokens really are split
  with jax.set_mesh(mesh):
    hlo = jax.jit(_full_logits, static_argnums=0).lower(graphdef, state, tokens).as_text()
  assert 'collective_permute' in hlo  # the kv shards go around the ring
  T = tokens.shape[1]
  assert logits.addressable_data(0).shape[1] == T // cp

  weights = jnp.asarray(np.random.default_rng(0).standard_normal(tokens.shape), jnp.float32)

  def loss(state):
    return jnp.sum(qwen2.token_logprobs(nnx.merge(graphdef, state), tokens) * weights)

  with jax.set_mesh(mesh):
    value, grads = jax.jit(jax.value_and_grad(loss))(state)
  one = small_mesh(dp=dp)
  _, graphdef1, state1 = hf_import.load(fixture_path('qwen2_tiny'), one)

  def loss1(state):
    return jnp.sum(qwen2.token_logprobs(nnx.merge(graphdef1, state), tokens) * weights)

  with jax.set_mesh(one):
    value1, grads1 = jax.jit(jax.value_and_grad(loss1))(state1)
  np.testing.assert_allclose(float(value), float(value1), rtol=1e-5)
  # Within 1e-5 of each leaf's scale: f32 sums in another order, as between any two layouts
  # (dp2 against dp4 differ by 3.3e-5 on gradients up to 37).
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, float(np.max(np.abs(b))))


@pytest.mark.parametrize('dp,tp', [(1, 1), (2, 4)])
def test_token_logprobs_match_log_softmax_of_reference(reference, dp, tp):
  mesh = small_mesh(dp=dp, tp=tp)
  _, graphdef, state = hf_import.load(fixture_path('qwen2_tiny'), mesh)
  tokens = _rows_for(mesh, reference['tokens'])
  n = reference['tokens'].shape[0]
  with jax.set_mesh(mesh):
    lp = np.asarray(jax.jit(logprob_fn(graphdef))(state, jnp.asarray(tokens)))[:n]
  ref_logp = jax.nn.log_softmax(reference['logits_untied'], axis=-1)
  expected = np.take_along_axis(np.asarray(ref_logp)[:, :-1], reference['tokens'][:, 1:, None], -1)
  np.testing.assert_allclose(lp[:, 1:], expected[..., 0], atol=1e-4, rtol=0)
  assert np.all(lp[:, 0] == 0)


@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_entropy_matches_dense_softmax(temperature):
  """The chunked entropy equals H(softmax(logits / temperature)) of the full forward."""
  cfg = ModelConfig.preset('tiny').replace(logprob_chunk=16)
  mesh = small_mesh(dp=2, tp=2)
  graphdef, state = qwen2.init_model(cfg, mesh, seed=5)
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (4, 64)), jnp.int32)

  def both(state, tokens):
    model = nnx.merge(graphdef, state)
    return qwen2.token_logprobs_and_entropy(model, tokens, temperature), qwen2.token_logprobs(
      model, tokens, temperature
    )

  with jax.set_mesh(mesh):
    (lp, ent), lp_only = jax.jit(both)(state, tokens)
    logits = jax.jit(_full_logits, static_argnums=0)(graphdef, state, tokens)
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64) / temperature, axis=-1)
  expected = -np.sum(np.exp(logp) * logp, axis=-1)  # [B, T]: the distribution of token t + 1
  np.testing.assert_allclose(np.asarray(ent)[:, 1:], expected[:, :-1], atol=1e-4, rtol=1e-5)
  assert np.all(np.asarray(ent)[:, 0] == 0)
  assert np.all(np.asarray(ent)[:, 1:] > 0) and np.all(np.asarray(ent) <= np.log(cfg.vocab_size))
  np.testing.assert_array_equal(np.asarray(lp), np.asarray(lp_only))


def test_restricted_vocabulary_matches_dense_softmax_over_the_subset():
  """token_ids: log-probs and entropy of softmax over those ids alone; other targets get 0."""
  cfg = ModelConfig.preset('tiny').replace(logprob_chunk=16)
  mesh = small_mesh(dp=2, tp=2)
  graphdef, state = qwen2.init_model(cfg, mesh, seed=6)
  ids = (3, 7, 8, 20, 41)
  rng = np.random.RandomState(2)
  tokens = rng.randint(0, cfg.vocab_size, (4, 64)).astype(np.int32)
  tokens[:, 1::2] = rng.choice(ids, (4, 32))  # half the targets are in the set

  def fn(state, tokens):
    return qwen2.token_logprobs_and_entropy(nnx.merge(graphdef, state), tokens, 0.8, ids)

  def grads(state, tokens):
    loss = lambda s: jnp.sum(fn(s, tokens)[0]) + jnp.sum(fn(s, tokens)[1])  # noqa: E731
    return jax.grad(loss)(state)

  with jax.set_mesh(mesh):
    lp, ent = jax.jit(fn)(state, jnp.asarray(tokens))
    g = jax.jit(grads)(state, jnp.asarray(tokens))
    logits = jax.jit(_full_logits, static_argnums=0)(graphdef, state, jnp.asarray(tokens))
  sub = np.asarray(logits, np.float64)[..., list(ids)] / 0.8
  logp_sub = jax.nn.log_softmax(sub, axis=-1)  # [B, T, 5]
  targets = tokens[:, 1:]
  in_set = np.isin(targets, ids)
  index = np.searchsorted(ids, np.where(in_set, targets, ids[0]))
  expected = np.where(in_set, np.take_along_axis(logp_sub[:, :-1], index[..., None], -1)[..., 0], 0)
  np.testing.assert_allclose(np.asarray(lp)[:, 1:], expected, atol=1e-4)
  assert in_set.any() and (~in_set).any()
  expected_ent = -np.sum(np.exp(logp_sub) * logp_sub, axis=-1)[:, :-1]
  np.testing.assert_allclose(np.asarray(ent)[:, 1:], expected_ent, atol=1e-4)
  assert np.asarray(ent).max() <= np.log(len(ids)) + 1e-5
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))


@pytest.mark.parametrize('token_ids', [None, (3, 7, 8, 20, 41, 42, 50)])
def test_subset_logprobs_are_the_dense_mass_of_the_subset(token_ids):
  """token_stats(subset=(bits, ids)): at column t, log of the probability that the distribution
  of token t gives the ids whose bit is set at t (under the restriction to `token_ids` when
  given); 0 where no bit is set; log-probs as without it; finite gradients."""
  cfg = ModelConfig.preset('tiny').replace(logprob_chunk=16)
  mesh = small_mesh(dp=2, tp=2)
  graphdef, state = qwen2.init_model(cfg, mesh, seed=7)
  move_ids = (3, 7, 8, 20, 41, 42, 50)
  rng = np.random.RandomState(3)
  tokens = rng.randint(0, cfg.vocab_size, (4, 64)).astype(np.int32)
  bits = (rng.randint(0, 128, (4, 64)) * (rng.rand(4, 64) < 0.4)).astype(np.int32)

  def fn(state):
    model = nnx.merge(graphdef, state)
    return qwen2.token_stats(
      model, jnp.asarray(tokens), 0.8, token_ids, subset=(jnp.asarray(bits), move_ids)
    )

  def grads(state):
    return jax.grad(lambda s: jnp.sum(fn(s).subset_logprobs))(state)

  def logprobs(state):
    return qwen2.token_logprobs(nnx.merge(graphdef, state), jnp.asarray(tokens), 0.8, token_ids)

  with jax.set_mesh(mesh):
    stats = jax.jit(fn)(state)
    g = jax.jit(grads)(state)
    lp = jax.jit(logprobs)(state)
    logits = jax.jit(_full_logits, static_argnums=0)(graphdef, state, jnp.asarray(tokens))
  logits = np.asarray(logits, np.float64) / 0.8
  if token_ids is not None:
    logits = np.where(np.isin(np.arange(cfg.vocab_size), token_ids), logits, -np.inf)
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))  # [B, T, V]: token t + 1's distribution
  member = (bits[:, 1:, None] >> np.arange(7)) & 1  # [B, T - 1, 7]
  mass = np.sum(np.exp(logp[:, :-1][..., list(move_ids)]) * member, axis=-1)
  expected = np.where(bits[:, 1:] > 0, np.log(np.maximum(mass, 1e-300)), 0.0)
  got = np.asarray(stats.subset_logprobs)
  np.testing.assert_allclose(got[:, 1:], expected, atol=1e-4)
  assert np.all(got[:, 0] == 0) and (bits[:, 1:] > 0).any()
  assert stats.entropy is None
  np.testing.assert_array_equal(np.asarray(stats.logprobs), np.asarray(lp))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))


def test_chunked_logprobs_equal_unchunked():
  """The chunk size changes memory, never values."""
  cfg = ModelConfig.preset('tiny')
  mesh = small_mesh(dp=2, tp=2)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (4, 128)), jnp.int32)
  out = []
  for chunk in (16, 128):
    graphdef, state = qwen2.init_model(cfg.replace(logprob_chunk=chunk), mesh, seed=3)
    with jax.set_mesh(mesh):
      out.append(np.asarray(jax.jit(logprob_fn(graphdef))(state, tokens)))
  np.testing.assert_allclose(out[0], out[1], atol=1e-5)


def test_right_padding_does_not_change_real_logprobs():
  cfg = ModelConfig.preset('tiny')
  mesh = small_mesh(dp=2, tp=2)
  graphdef, state = qwen2.init_model(cfg, mesh, seed=1)
  rng = np.random.RandomState(0)
  real = rng.randint(0, cfg.vocab_size, (4, 37)).astype(np.int32)
  padded, bucket = buckets.pad_to_bucket(real, BucketConfig(lengths=(32, 64)), axis=1)
  assert bucket == 64
  junk = padded.copy()
  junk[:, 37:] = rng.randint(0, cfg.vocab_size, (4, 64 - 37))
  fn = jax.jit(logprob_fn(graphdef))
  with jax.set_mesh(mesh):
    a = np.asarray(fn(state, jnp.asarray(padded)))
    b = np.asarray(fn(state, jnp.asarray(junk)))
  np.testing.assert_allclose(a[:, :37], b[:, :37], atol=1e-6)
  assert not np.allclose(a[:, 38:], b[:, 38:])  # the padding itself does differ


def test_one_trace_per_bucket():
  cfg = ModelConfig.preset('tiny')
  mesh = small_mesh(dp=2, tp=2)
  graphdef, state = qwen2.init_model(cfg, mesh)
  table = BucketConfig(lengths=(16, 32, 64))
  traces = []
  inner = logprob_fn(graphdef)

  def counted(state, tokens):
    traces.append(tokens.shape)
    return inner(state, tokens)

  fn = jax.jit(counted)
  rng = np.random.RandomState(0)
  with jax.set_mesh(mesh):
    for length in (17, 20, 31, 32, 5, 9, 40):
      x, _ = buckets.pad_to_bucket(rng.randint(0, 512, (4, length)).astype(np.int32), table, axis=1)
      fn(state, jnp.asarray(x)).block_until_ready()
  assert traces == [(4, 32), (4, 16), (4, 64)]


def test_layers_of_a_forward_without_cache_are_traced_once(monkeypatch):
  """The L identical layers of a training / experience forward (and its gradient) trace one
  layer; the train step's loss and gradients are those of the layers written out."""
  cfg = ModelConfig.preset('tiny')
  assert cfg.num_layers > 1
  mesh = small_mesh(dp=2, tp=2)
  graphdef, state = qwen2.init_model(cfg, mesh)
  calls = []
  layer_call = qwen2.DecoderLayer.__call__

  def counted(self, *args, **kwargs):
    calls.append(args[2] is None)  # kv
    return layer_call(self, *args, **kwargs)

  monkeypatch.setattr(qwen2.DecoderLayer, '__call__', counted)
  qwen2._layer_forward.clear_cache()  # an earlier test may have traced these shapes
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (4, 32)).astype(np.int32))

  def loss(state):
    return -jnp.mean(qwen2.token_logprobs(nnx.merge(graphdef, state), tokens))

  with jax.set_mesh(mesh):
    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    assert calls == [True]
    # The same model with its layers inline (the path a KV-cache forward takes).
    monkeypatch.setattr(
      qwen2, '_layer_forward', lambda g, s, *a: nnx.merge(g, s)(a[0], a[1], None, a[2])[0]
    )
    calls.clear()
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(state)
    assert calls == [True] * cfg.num_layers
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('dtype,atol', [('float32', 1e-4), ('bfloat16', 0.15)])
def test_kv_cache_decode_matches_full_forward(reference, dtype, atol):
  """Prefill a ragged prefix per row, then feed one token at a time: same logits as a full pass
  (in bf16 up to bf16 rounding, logits up to ~6 here: the decode matmuls take the bf16 cache as
  it is, with bf16 probabilities and f32 accumulation; bf16 against f32 decode differs by 0.099
  at most, 0.088 when the matmuls took an f32 copy of the cache)."""
  mesh = small_mesh(dp=2, tp=2)
  cfg, graphdef, state = hf_import.load(fixture_path('qwen2_tiny'), mesh, param_dtype=dtype)
  tokens = jnp.asarray(np.concatenate([reference['tokens'], reference['tokens'][:1]]))  # [4, 32]
  B, T = tokens.shape
  prefix = jnp.asarray([5, 9, 12, 1], jnp.int32)  # a different prefix length per row
  P = 16  # the prefill chunk (a bucket); rows use only their first prefix[b] tokens

  def run(state, tokens):
    model = nnx.merge(graphdef, state)
    full = model.logits(model(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)))[0])  # [B, T, V]
    cache = qwen2.KVCache.init(cfg, B, 64, mesh)
    pos = jnp.broadcast_to(jnp.arange(P), (B, P))
    h, cache = model(tokens[:, :P], pos, cache)
    first = model.logits(jnp.take_along_axis(h, (prefix - 1)[:, None, None], axis=1)[:, 0])
    steps = []
    for s in range(10):  # decode tokens prefix[b] + s, one at a time, at per-row positions
      p = prefix + s
      tok = jnp.take_along_axis(tokens, p[:, None], axis=1)
      h, cache = model(tok, p[:, None], cache)
      steps.append(model.logits(h[:, 0]))
    return full, first, jnp.stack(steps, axis=1)

  with jax.set_mesh(mesh):
    full, first, steps = jax.jit(run)(state, tokens)
  full = np.asarray(full)
  rows = np.arange(B)
  np.testing.assert_allclose(np.asarray(first), full[rows, np.asarray(prefix) - 1], atol=atol)
  for s in range(10):
    np.testing.assert_allclose(
      np.asarray(steps)[:, s], full[rows, np.asarray(prefix) + s], atol=atol, err_msg=f'step {s}'
    )


def test_init_is_sharded_and_deterministic():
  cfg = ModelConfig.preset('tiny')
  mesh = small_mesh(dp=2, fsdp=2, tp=2)
  _, a = qwen2.init_model(cfg, mesh, seed=7)
  _, b = qwen2.init_model(cfg, small_mesh(dp=1, tp=1), seed=7)
  up = a['layers'][1]['mlp']['up_proj'][...]
  assert up.sharding.spec == jax.sharding.PartitionSpec('fsdp', 'tensor')
  assert up.addressable_data(0).shape == (cfg.hidden_size // 2, cfg.intermediate_size // 2)
  # Same seed, different mesh: the same values (partitionable RNG).
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_init_never_materialises_a_full_replicated_copy():
  """Per-device memory of the sharded init is a fraction of the whole model."""
  cfg = ModelConfig.preset('tiny').replace(vocab_size=4096, intermediate_size=1024)
  mesh = small_mesh(dp=1, fsdp=8, tp=1)
  _, abstract = qwen2.abstract_model(cfg, mesh)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))

  def init():
    return nnx.state(qwen2.Qwen2(cfg, rngs=nnx.Rngs(0)))

  with jax.set_mesh(mesh):
    compiled = jax.jit(init, out_shardings=qwen2.state_shardings(abstract)).lower().compile()
  mem = compiled.memory_analysis()
  # Each device outputs its 1/8 (plus a few replicated norm scales) ...
  assert mem.output_size_in_bytes < 1.01 * total / 8, (mem.output_size_in_bytes, total)
  # ... generates only its own random bits (temporaries are well under the full model) ...
  assert mem.output_size_in_bytes + mem.temp_size_in_bytes < total / 2
  # ... and nothing is gathered.
  assert 'all-gather' not in compiled.as_text()


@pytest.mark.parametrize(
  'dp,fsdp,tp,message',
  [
    (1, 1, 8, r'num_kv_heads \(K\)=4 is not divisible by tp=8'),
    (1, 3, 1, r'hidden_size \(D\)=64 is not divisible by fsdp=3'),
  ],
)
def test_mesh_that_does_not_fit_the_model_is_refused_before_loading(dp, fsdp, tp, message):
  pc = ParallelConfig(dp=dp, fsdp=fsdp, tp=tp)
  mesh = mesh_lib.make_mesh(pc, mesh_lib.canonical_devices()[: pc.num_devices])
  with pytest.raises(mesh_lib.ShardingError, match=message):
    hf_import.load(fixture_path('qwen2_tiny'), mesh)
  with pytest.raises(mesh_lib.ShardingError, match=message):
    qwen2.init_model(ModelConfig.preset('tiny'), mesh)


@pytest.mark.parametrize('block', [8, 16, 64])
def test_blockwise_causal_attention_matches_dense_values_and_grads(block):
  rng = np.random.RandomState(0)
  q = jnp.asarray(rng.randn(2, 64, 8, 16), jnp.float32)
  k = jnp.asarray(rng.randn(2, 64, 4, 16), jnp.float32)
  v = jnp.asarray(rng.randn(2, 64, 4, 16), jnp.float32)

  def loss(impl, q, k, v):
    out = qwen2.causal_attention(q, k, v, block=block, impl=impl)
    return jnp.sum(jnp.sin(out)), out

  (la, a), ga = jax.value_and_grad(
    lambda *x: loss('blockwise', *x), argnums=(0, 1, 2), has_aux=True
  )(q, k, v)
  (lb, b), gb = jax.value_and_grad(
    lambda *x: loss('dot_product', *x), argnums=(0, 1, 2), has_aux=True
  )(q, k, v)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
  np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
  for x, y in zip(ga, gb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-4)
  # Causality: the output at t does not depend on keys after t.
  k2 = k.at[:, 40:].set(0.0)
  c = qwen2.causal_attention(q, k2, v, block=block)
  np.testing.assert_allclose(np.asarray(c)[:, :40], np.asarray(a)[:, :40], atol=1e-6)


def test_cudnn_on_packed_rows_is_xlas_attention_with_the_segment_mask():
  """cuDNN's masks are causal and padding only: packed rows under 'cudnn' take XLA's attention
  (so this runs on the CPU too), and equal the blockwise attention's values."""
  rng = np.random.default_rng(3)
  B, T, H, K, Dh = 2, 32, 4, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, Dh)), jnp.float32) for n in (H, K, K))
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 14 + [3] * 8], B, axis=0), jnp.int32)
  a = qwen2.causal_attention(q, k, v, block=0, impl='cudnn', segment_ids=seg)
  b = qwen2.causal_attention(q, k, v, block=8, impl='blockwise', segment_ids=seg)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize(
  'impl,block,cp',
  [('blockwise', 8, 1), ('blockwise', 0, 1), ('dot_product', 0, 1), ('blockwise', 4, 4)],
)
def test_packed_rows_equal_unpacked_sequences_in_values_and_gradients(impl, block, cp):
  """Three sequences packed side by side into one row (segment ids, positions from 0 in each)
  give every token the log-prob it has alone in its own row, and the same parameter gradients;
  with cp = 4 each row is split over a ring of 4 devices, the segments across its shards."""
  cfg = ModelConfig.preset('tiny').replace(attention_impl=impl, attention_block=block)
  mesh = small_mesh(cp=cp)
  graphdef, params = qwen2.init_model(cfg, mesh, seed=5)
  rng = np.random.default_rng(0)
  T, lengths = 32, (5, 9, 14)
  seqs = [rng.integers(1, cfg.vocab_size, n).astype(np.int32) for n in lengths]
  weights = [rng.standard_normal(n).astype(np.float32) for n in lengths]
  alone = np.zeros((3, T), np.int32)
  w_alone = np.zeros((3, T), np.float32)
  packed = np.zeros((1, T), np.int32)
  w_packed = np.zeros((1, T), np.float32)
  segment_ids = np.zeros((1, T), np.int32)
  positions = np.zeros((1, T), np.int32)
  start = 0
  for i, (x, w) in enumerate(zip(seqs, weights)):
    n = len(x)
    alone[i, :n], w_alone[i, :n] = x, w
    packed[0, start : start + n], w_packed[0, start : start + n] = x, w
    segment_ids[0, start : start + n] = i + 1
    positions[0, start : start + n] = np.arange(n)
    start += n

  def loss(params, tokens, w, segments):
    lp = qwen2.token_logprobs(nnx.merge(graphdef, params), tokens, 0.8, None, segments)
    return jnp.sum(lp * w), lp

  with jax.set_mesh(mesh):
    fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=())
    (v1, lp1), g1 = fn(params, alone, w_alone, None)
    (v2, lp2), g2 = fn(params, packed, w_packed, (segment_ids, positions))
  lp1, lp2 = np.asarray(lp1), np.asarray(lp2)
  start = 0
  for i, n in enumerate(lengths):
    np.testing.assert_allclose(lp2[0, start : start + n], lp1[i, :n], atol=2e-5)
    assert lp2[0, start] == 0.0  # a segment's first token has no prefix
    start += n
  np.testing.assert_allclose(float(v2), float(v1), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
