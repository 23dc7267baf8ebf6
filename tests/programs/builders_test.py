"""The stage programs against dense single-device references: values, shardings, keys, settings."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2, tokenizer
from earl_jax.programs import builders
from earl_jax.rl import train_step as train_lib
from earl_jax.rollout import engine, sampler
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage
from earl_jax.testing import small_mesh

CFG = ModelConfig.preset('tiny')
DP2TP4 = ParallelConfig(dp=2, tp=4)
SPEC = builders.StageSpec(sampling=sampler.SamplingConfig(max_new_tokens=4), chunk=8)


def _key(stage, **kw):
  defaults = {'config': DP2TP4, 'bucket': 64, 'rows': 8}
  if stage == Stage.ROLLOUT:
    defaults['chunk'] = 8
  return builders.ProgramKey(stage=stage, **{**defaults, **kw})


def _on(program, params):
  """The one-device reference weights on the program's layout (through the host: a test helper)."""
  return jax.device_put(jax.device_get(params), program.param_shardings)


@pytest.fixture(scope='module')
def weights():
  """Random weights on one device: the dense reference's, and the source of every layout's."""
  graphdef, params = qwen2.init_model(CFG, small_mesh(), seed=4)
  return graphdef, params


def test_rollout_program_equals_sampler_generate_on_one_device(weights):
  """The sharded, AOT-compiled turn program gives the dense reference's tokens and log-probs,
  writes the same cache, and takes the end-of-turn id as an argument (-1: never stops)."""
  graphdef, params = weights
  prog = builders.build(_key(Stage.ROLLOUT), CFG, SPEC)
  compiled = prog.lower().compile()
  args = builders.make_inputs(prog, _on(prog, params), seed=1)
  # make_inputs plays episodes 0..B-1 at turn 1: each row samples with its own key.
  keys = sampler.row_keys(
    jax.random.wrap_key_data(jax.device_get(args.key_data)),
    jnp.arange(8, dtype=jnp.int32),
    jnp.ones(8, jnp.int32),
  )
  host_args = (*jax.device_get((args.cache, args.prompt, args.num_prompt)), keys)
  gen, cache = compiled(*args)
  assert np.all(np.asarray(gen.num_tokens) == 4) and not np.asarray(gen.stopped).any()
  assert np.all(np.asarray(cache.lengths) == 64)  # filled to S - P - N, then P + N more

  one = small_mesh()
  ref_cache, prompt, num_prompt, key = host_args
  with jax.set_mesh(one):

    def reference(p, c, pr, n, k):
      m = nnx.merge(graphdef, p)
      return sampler.generate(m, c, pr, n, k, eot_id=-1, config=SPEC.sampling)

    ref_gen, ref_out = jax.jit(reference)(params, ref_cache, prompt, num_prompt, key)
  np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(ref_gen.tokens))
  np.testing.assert_allclose(np.asarray(gen.logprobs), np.asarray(ref_gen.logprobs), atol=1e-5)
  for a, b in zip(cache.k + cache.v, ref_out.k + ref_out.v):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  # Shardings: rows over data, heads over tensor, the cache as it came in.
  assert gen.tokens.sharding.spec == jax.P(('data', 'fsdp'), None)
  assert cache.k[0].sharding.spec == qwen2.KVCache.shardings(CFG, prog.mesh).k[0].spec

  # The same executable stops at the end-of-turn id when it is a real token.
  args = builders.make_inputs(prog, _on(prog, params), seed=1)
  first = int(np.asarray(gen.tokens)[0, 0])
  stop = jax.device_put(np.int32(first), prog.in_shardings.eot_id)
  gen2, _ = compiled(*args._replace(eot_id=stop))
  assert np.asarray(gen2.stopped)[0] and int(np.asarray(gen2.num_tokens)[0]) == 1


def test_rollout_args_name_the_rollout_programs_arguments_in_order():
  """`sampler.RolloutArgs` is the rollout program's argument list: its fields are the step
  function's parameters in order, and each names the argument the compiled program takes in
  that position (shape, dtype, donation), so that `.prompt` or `.eot_id` can never silently
  refer to another argument."""
  key = _key(Stage.ROLLOUT, rows=8, bucket=64, chunk=16)
  prog = builders.build(key, CFG, SPEC)
  assert isinstance(prog.abstract_args, sampler.RolloutArgs)
  assert isinstance(prog.in_shardings, sampler.RolloutArgs)
  assert tuple(inspect.signature(prog.fn).parameters) == sampler.RolloutArgs._fields
  (positional, keywords) = prog.lower().args_info
  assert keywords == {} and len(positional) == len(sampler.RolloutArgs._fields)
  compiled = sampler.RolloutArgs(*positional)
  B, P = key.rows, key.chunk

  def info(field):
    leaves = jax.tree.leaves(getattr(compiled, field))
    return [(leaf.shape, leaf.dtype, leaf.donated) for leaf in leaves]

  assert info('prompt') == [((B, P), jnp.int32, False)]
  assert info('num_prompt') == [((B,), jnp.int32, False)]
  assert info('key_data') == [((2,), jnp.uint32, False)]
  assert info('episode_ids') == info('turns') == [((B,), jnp.int32, False)]
  assert info('eot_id') == [((), jnp.int32, False)]
  cache = qwen2.KVCache.abstract(CFG, B, key.bucket)
  want_cache = [(a.shape, a.dtype, True) for a in jax.tree.leaves(cache)]
  assert info('cache') == want_cache
  params = jax.tree.leaves(qwen2.abstract_model(CFG, prog.mesh)[1])
  assert info('params') == [(a.shape, a.dtype, False) for a in params]
  # The shardings travel under the same names (the engine reads the prompt's to find its rows).
  assert prog.in_shardings.prompt.spec == jax.P(('data', 'fsdp'), None)


def test_experience_program_equals_the_dense_forward(weights):
  graphdef, params = weights
  prog = builders.build(_key(Stage.EXPERIENCE), CFG, SPEC)
  params_s = _on(prog, params)
  (_, tokens) = builders.make_inputs(prog, params_s, seed=2)
  logp = prog.lower().compile()(params_s, tokens)
  with jax.set_mesh(small_mesh()):
    ref = jax.jit(lambda p, t: qwen2.token_logprobs(nnx.merge(graphdef, p), t))(
      params, jax.device_get(tokens)
    )
  np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), atol=1e-5)
  assert logp.sharding.spec == jax.P(('data', 'fsdp'), None)
  assert prog.tokens == 8 * 64


def test_train_program_equals_the_dense_update(weights):
  """One update on the sharded layout matches the same update on one device."""
  graphdef, params = weights
  prog = builders.build(_key(Stage.TRAIN, bucket=32), CFG, SPEC)
  state, batch = builders.make_inputs(prog, _on(prog, params), seed=3)
  host_batch = jax.device_get(batch)
  new_state, metrics = prog.lower().compile()(state, batch)
  optimizer = train_lib.make_optimizer(SPEC.optim)
  with jax.set_mesh(small_mesh()):
    ref_state = train_lib.init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    step = train_lib.make_train_step(graphdef, optimizer, SPEC.loss)
    ref_state, ref_metrics = step(ref_state, jax.tree.map(jnp.asarray, host_batch))
  np.testing.assert_allclose(float(metrics['loss']), float(ref_metrics['loss']), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  # The moments stay sharded like their parameters.
  mu = new_state.opt_state[1][0].mu['layers'][0]['mlp']['up_proj'][...]
  assert mu.addressable_data(0).shape == (CFG.hidden_size, CFG.intermediate_size // 4)


def test_program_keys_validate_and_name_themselves(weights):
  key = _key(Stage.ROLLOUT, greedy=True)
  assert str(key) == 'rollout/dp2.tp4/S64/R8/P8/greedy'
  assert str(_key(Stage.TRAIN)) == 'train/dp2.tp4/S64/R8'
  with pytest.raises(ValueError, match='chunk of a rollout program must be >= 1'):
    builders.ProgramKey(stage=Stage.ROLLOUT, config=DP2TP4, bucket=64, rows=8)
  with pytest.raises(ValueError, match='chunk and greedy are rollout settings'):
    builders.ProgramKey(stage=Stage.TRAIN, config=DP2TP4, bucket=64, rows=8, chunk=8)
  with pytest.raises(ValueError, match='bucket must be a positive int'):
    builders.ProgramKey(stage=Stage.TRAIN, config=DP2TP4, bucket=0, rows=8)
  assert str(_key(Stage.EXPERIENCE, objective='sft')) == 'experience/dp2.tp4/S64/R8/sft'
  with pytest.raises(ValueError, match="objective='sft' for rollout: expected rl, or sft for"):
    _key(Stage.ROLLOUT, objective='sft')
  with pytest.raises(ValueError, match="objective='ppo' for train"):
    _key(Stage.TRAIN, objective='ppo')
  with pytest.raises(mesh_lib.ShardingError, match='rows \\(responses\\)=7 is not divisible'):
    builders.build(_key(Stage.EXPERIENCE, rows=7), CFG, SPEC)
  with pytest.raises(ValueError, match='built on a mesh of shape'):
    builders.build(_key(Stage.EXPERIENCE), CFG, SPEC, mesh_lib.make_mesh(ParallelConfig(dp=8)))
  prog = builders.build(_key(Stage.ROLLOUT, bucket=8), CFG, SPEC)
  with pytest.raises(ValueError, match='must be longer than chunk 8 \\+ decode_tokens 4'):
    builders.make_inputs(prog, _on(prog, weights[1]))


def test_stage_spec_follows_the_rollout_config():
  tok = tokenizer.GameTokenizer()
  rollout = engine.RolloutConfig(
    sampling=sampler.SamplingConfig(temperature=0.7, max_new_tokens=3),
    prompt_buckets=(32, 64),
    reply_tokens=('1', '2'),
  )
  spec = builders.StageSpec.for_rollout(rollout, tok, 64, micro_batches=2)
  assert spec.sampling == rollout.sampling and spec.temperature == 0.7 and spec.decode_tokens == 3
  assert spec.chunk == 32 and spec.micro_batches == 2
  assert spec.token_ids == tuple(sorted(tok.encode(t)[0] for t in '12'))
  assert (
    builders.StageSpec.for_rollout(dataclasses.replace(rollout, reply_tokens=()), tok, 64).token_ids
    is None
  )
  with pytest.raises(ValueError, match=r'StageSpec\.chunk must be an int >= 1'):
    builders.StageSpec(chunk=0)
  with pytest.raises(ValueError, match='non-empty tuple of ids'):
    builders.StageSpec(token_ids=())
