"""Decode tokens/s: our rollout sampler vs HF transformers `generate`, on identical weights.

  # the benchmark-sized random Qwen2 (V=4096, D=512, F=1408, L=8) from the fixture script:
  HF_HUB_OFFLINE=1 /tmp/venv-torch/bin/python scripts/make_qwen2_fixture.py --bench_dir /tmp/qwen2_bench
  python experiments/decode_throughput.py --model_dir=/tmp/qwen2_bench \
      --torch_python=/tmp/venv-torch/bin/python --out=runs/decode_throughput.json

Both sides decode greedily exactly --new_tokens tokens after the same random prompts, batch sizes
1, 8 and 32, with the KV cache, in f32 on the CPU (one JAX device; torch with the same number of
threads). Each measurement is warmed up and repeated; the median is kept. torch never enters
earl_jax's environment: the HF side runs as a subprocess of another Python (--torch_python) that
has torch and transformers (see scripts/hf_generate_bench.py). The generated tokens of both sides
are compared, which also proves the weights are the same.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from earl_jax import runtime
from earl_jax.config import ParallelConfig
from earl_jax.models import hf_import, qwen2
from earl_jax.rollout import sampler
from earl_jax.sharding import mesh as mesh_lib

_MODEL_DIR = flags.DEFINE_string('model_dir', '/tmp/qwen2_bench', 'HF Qwen2 checkpoint.')
_TORCH_PYTHON = flags.DEFINE_string(
  'torch_python', '', 'A Python with torch + transformers; empty skips the HF side.'
)
_BATCH = flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Batch sizes.')
_NEW = flags.DEFINE_integer('new_tokens', 64, 'Tokens generated per row.')
_PROMPT = flags.DEFINE_integer('prompt_len', 32, 'Prompt tokens per row.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed repetitions (after one warm-up).')
_THREADS = flags.DEFINE_integer('threads', 0, 'torch threads (0: torch default).')
_OUT = flags.DEFINE_string('out', 'runs/decode_throughput.json', 'JSON results.')


def _ours(model_dir, prompts, batch_sizes, new_tokens, repeats):
  mesh = mesh_lib.make_mesh(ParallelConfig(), jax.devices()[:1])
  cfg, graphdef, state = hf_import.load(model_dir, mesh)
  P = prompts.shape[1]
  S = 1 << (P + new_tokens - 1).bit_length()  # the cache bucket
  config = sampler.SamplingConfig(greedy=True, max_new_tokens=new_tokens)

  def generate(state, prompt, cache):
    model = nnx.merge(graphdef, state)
    n = jnp.full((prompt.shape[0],), P, jnp.int32)
    # eot = vocab_size is never sampled, so every row decodes exactly new_tokens tokens.
    return sampler.generate(
      model, cache, prompt, n, jax.random.key(0), eot_id=cfg.vocab_size, config=config
    )[0]

  gen_jit = jax.jit(generate)  # the cache is rebuilt for every call; nothing to donate
  out = {}
  with jax.set_mesh(mesh):
    for b in batch_sizes:
      prompt = jnp.asarray(prompts[:b])
      times = []
      for i in range(repeats + 1):
        cache = qwen2.KVCache.init(cfg, b, S, mesh)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        gen = jax.block_until_ready(gen_jit(state, prompt, cache))
        if i:  # the first call compiles
          times.append(time.perf_counter() - t0)
      out[str(b)] = {
        'median_s': statistics.median(times),
        'times_s': times,
        'tokens': np.asarray(gen.tokens).tolist(),
      }
  return out, S


def main(argv):
  del argv
  runtime.setup(cpu_devices=1)
  batch_sizes = [int(b) for b in _BATCH.value]
  cfg = hf_import.load_config(_MODEL_DIR.value)
  rng = np.random.RandomState(0)
  prompts = rng.randint(0, cfg.vocab_size, (max(batch_sizes), _PROMPT.value)).astype(np.int32)
  ours, S = _ours(_MODEL_DIR.value, prompts, batch_sizes, _NEW.value, _REPEATS.value)
  theirs = None
  if _TORCH_PYTHON.value:
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, 'prompts.npy')
      np.save(path, prompts)
      script = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), 'scripts', 'hf_generate_bench.py'
      )
      cmd = [
        _TORCH_PYTHON.value,
        script,
        f'--model_dir={_MODEL_DIR.value}',
        f'--prompts={path}',
        f'--batch_sizes={",".join(map(str, batch_sizes))}',
        f'--new_tokens={_NEW.value}',
        f'--repeats={_REPEATS.value}',
        f'--threads={_THREADS.value}',
      ]
      proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
      if proc.returncode:
        sys.exit(f'HF side failed ({" ".join(cmd)}):\n{proc.stderr[-3000:]}')
      theirs = json.loads(proc.stdout.strip().splitlines()[-1])

  rows = []
  print(
    f'model {cfg.name}: {cfg.num_params / 1e6:.1f}M params, prompt {_PROMPT.value}, '
    f'{_NEW.value} new tokens, cache bucket {S}, JAX {jax.__version__} on {jax.devices()[0].platform}'
  )
  print(f'{"batch":>5} {"ours tok/s":>11} {"HF tok/s":>9} {"ours/HF":>8} {"same tokens":>11}')
  for b in batch_sizes:
    n = b * _NEW.value
    ours_tps = n / ours[str(b)]['median_s']
    row = {'batch': b, 'ours_tokens_per_s': ours_tps, 'ours_median_s': ours[str(b)]['median_s']}
    if theirs:
      hf = theirs['results'][str(b)]
      hf_tps = n / hf['median_s']
      same = float(np.mean(np.asarray(hf['tokens']) == np.asarray(ours[str(b)]['tokens'])))
      row.update(
        hf_tokens_per_s=hf_tps,
        hf_median_s=hf['median_s'],
        speedup=ours_tps / hf_tps,
        token_agreement=same,
      )
      print(f'{b:>5} {ours_tps:>11.0f} {hf_tps:>9.0f} {ours_tps / hf_tps:>7.2f}x {same:>11.3f}')
    else:
      print(f'{b:>5} {ours_tps:>11.0f} {"-":>9} {"-":>8} {"-":>11}')
    rows.append(row)
  result = {
    'model_dir': _MODEL_DIR.value,
    'params': cfg.num_params,
    'prompt_len': _PROMPT.value,
    'new_tokens': _NEW.value,
    'cache_bucket': S,
    'repeats': _REPEATS.value,
    'jax': jax.__version__,
    'torch': theirs['torch'] if theirs else None,
    'torch_threads': theirs['threads'] if theirs else None,
    'rows': rows,
  }
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=2)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  runtime.run(main)
