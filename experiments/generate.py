"""Forward and generate with a Qwen2 checkpoint on a mesh: the smallest end-to-end demo.

  python experiments/generate.py                      # the committed tiny checkpoint, 8 CPU devices
  python experiments/generate.py --model_dir=/ckpt/Qwen2.5-0.5B-Instruct --mesh=1x1 --dtype=bfloat16

It loads the checkpoint straight onto the mesh, scores a chat prompt (per-token log-probs, computed
in chunks), checks that the score does not depend on the mesh, and generates a reply through the
KV cache (prefill, then one token at a time), printing timings for each step.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from earl_jax import buckets, runtime
from earl_jax.config import BucketConfig, ParallelConfig
from earl_jax.models import hf_import, qwen2, tokenizer
from earl_jax.rollout import sampler
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.testing import fixture_path

_MODEL_DIR = flags.DEFINE_string(
  'model_dir', fixture_path('qwen2_tiny'), 'HF Qwen2 checkpoint dir.'
)
_MESH = flags.DEFINE_string('mesh', 'dp2.tp4', "Parallel config, e.g. 'dp2.tp4' or '2x4'.")
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Parameter dtype.')
_PROMPT = flags.DEFINE_string(
  'prompt',
  'Connect four. You are X. Board:\n.......\n.......\n.......\n...O...\n..XO...\n..XO.X.\nYour move?',
  'The user message.',
)
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 24, 'Tokens to generate.')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.0, '0 means greedy.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Fake CPU devices when there is no GPU.')

BUCKETS = BucketConfig(lengths=(64, 128, 256, 512, 1024, 2048, 4096))


def _timed(label, fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  print(f'  {label:<28s} {1e3 * (time.perf_counter() - t0):9.1f} ms')
  return out


def main(argv):
  del argv
  runtime.setup(cpu_devices=_CPU_DEVICES.value)
  parallel = ParallelConfig.parse(_MESH.value)
  mesh = mesh_lib.make_mesh(parallel)
  cfg = hf_import.load_config(_MODEL_DIR.value, param_dtype=_DTYPE.value, dtype=_DTYPE.value)
  mesh_lib.check_model_fits(parallel, cfg)
  tok = tokenizer.load_tokenizer(_MODEL_DIR.value)
  print(
    f'model {cfg.name}: {cfg.num_params / 1e6:.2f}M params, mesh {parallel} on {jax.devices()[0].platform}'
  )

  t0 = time.perf_counter()
  _, graphdef, state = hf_import.load(_MODEL_DIR.value, mesh, param_dtype=_DTYPE.value)
  print(f'  {"load onto mesh":<28s} {1e3 * (time.perf_counter() - t0):9.1f} ms')

  ids = tok.turn_prompt_ids(_PROMPT.value, first=True)
  prompt, T = buckets.pad_to_bucket(
    np.asarray([ids] * parallel.batch_shards, np.int32), BUCKETS, axis=1
  )
  S = BUCKETS.bucket_for(T + _MAX_NEW.value)
  B = prompt.shape[0]
  print(f'prompt: {len(ids)} tokens (bucket {T}), cache capacity {S}, batch {B}')

  def score(state, tokens):
    return qwen2.token_logprobs(nnx.merge(graphdef, state), tokens)

  config = sampler.SamplingConfig(
    greedy=_TEMPERATURE.value == 0,
    temperature=_TEMPERATURE.value or 1.0,
    max_new_tokens=_MAX_NEW.value,
  )

  def generate(state, prompt, n, key):
    model = nnx.merge(graphdef, state)
    cache = qwen2.KVCache.init(cfg, B, S, mesh)
    return sampler.generate(model, cache, prompt, n, key, eot_id=tok.eot_id, config=config)

  with jax.set_mesh(mesh):
    tokens = jnp.asarray(prompt)
    score_jit = jax.jit(score)
    _timed('score: compile + run', score_jit, state, tokens)
    lp = _timed('score: run', score_jit, state, tokens)
    gen_jit = jax.jit(generate)
    args = (state, tokens, jnp.full((B,), len(ids), jnp.int32), jax.random.key(_SEED.value))
    _timed('generate: compile + run', gen_jit, *args)
    gen, _ = _timed('generate: run', gen_jit, *args)
  nll = -float(np.asarray(lp)[0, 1 : len(ids)].mean())
  print(f'mean NLL of the prompt on {parallel}: {nll:.4f}')

  # The same score on a single device: sharding changes the layout, never the values.
  single = mesh_lib.make_mesh(ParallelConfig(), jax.devices()[:1])
  _, _, state1 = hf_import.load(_MODEL_DIR.value, single, param_dtype=_DTYPE.value)
  with jax.set_mesh(single):
    lp1 = jax.jit(score)(state1, jnp.asarray(prompt[:1]))
  diff = float(np.abs(np.asarray(lp1)[0, : len(ids)] - np.asarray(lp)[0, : len(ids)]).max())
  print(f'max |log-prob difference| vs one device: {diff:.2e}')

  n = int(gen.num_tokens[0])
  reply = tok.decode(np.asarray(gen.tokens[0, :n]).tolist())
  print(f'generated {n} tokens in {(np.asarray(gen.logprobs[0, :n])).sum():.2f} nats:')
  print(repr(reply))


if __name__ == '__main__':
  runtime.run(main)
