"""Tunix's train-step timing, the Tunix side of experiments/train_step_compare.py.

Runs in a separate environment that has google-tunix (never earl_jax's venv):

  python3.11 -m venv /tmp/venv-tunix
  /tmp/venv-tunix/bin/pip install google-tunix safetensors
  /tmp/venv-tunix/bin/python scripts/tunix_train_bench.py --model_dir D --tokens T.npz --repeats 5

Loads the HF checkpoint with Tunix's own safetensors loader (`tunix.models.qwen2.params`) and
times one forward and backward of the mean next-token negative log-likelihood through Tunix's
Qwen2 (`tunix.models.qwen2.model.Qwen2.__call__` with a causal mask; the log-softmax of its
logits), the gradient taken with respect to every parameter, in f32. For each token array of
the .npz (int32 [B, T]) it prints the ahead-of-time compile seconds (lower + compile, the
persistent compilation cache in --cache_dir, or off without it), the median step seconds, the
loss and the gradient's global norm, as one JSON object.
"""

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.qwen2 import params as params_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tunix_sampler_bench import _version, tunix_config


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--model_dir', required=True)
  parser.add_argument('--tokens', required=True, help='.npz of int32 [B, T] arrays')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument(
    '--cache_dir', default='', help='persistent compilation cache (as ours); empty: off'
  )
  args = parser.parse_args()
  if args.cache_dir:  # the settings of earl_jax.runtime.setup, so both sides cache alike
    jax.config.update('jax_compilation_cache_dir', args.cache_dir)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
  else:
    jax.config.update('jax_enable_compilation_cache', False)
  cfg = tunix_config(args.model_dir)
  model = params_lib.create_model_from_safe_tensors(args.model_dir, cfg, dtype=jnp.float32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, tokens):
    m = nnx.merge(graphdef, params, rest)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), jnp.bool_)), (B, T, T))
    logits, _ = m(tokens, positions, None, mask)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked)

  def step(params, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    return loss, norm, grads

  out = {'tunix_version': _version(), 'jax': jax.__version__, 'results': {}}
  with np.load(args.tokens) as arrays:
    for name in arrays.files:
      tokens = jnp.asarray(arrays[name])
      t0 = time.perf_counter()
      lowered = jax.jit(step).lower(params, tokens)
      lower_s = time.perf_counter() - t0
      compiled = lowered.compile()
      compile_s = time.perf_counter() - t0
      loss, norm, _ = jax.block_until_ready(compiled(params, tokens))  # warm-up
      times = []
      for _ in range(args.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, tokens))
        times.append(time.perf_counter() - t0)
      out['results'][name] = {
        'compile_s': compile_s,
        'lower_s': lower_s,
        'median_s': statistics.median(times),
        'times_s': times,
        'loss': float(loss),
        'grad_norm': float(norm),
      }
  print(json.dumps(out))


if __name__ == '__main__':
  main()
