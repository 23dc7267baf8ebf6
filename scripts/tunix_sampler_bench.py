"""Tunix's vanilla sampler timing, the Tunix side of experiments/decode_throughput.py.

Runs in a separate environment that has google-tunix (never earl_jax's venv):

  python3.11 -m venv /tmp/venv-tunix
  /tmp/venv-tunix/bin/pip install google-tunix safetensors
  /tmp/venv-tunix/bin/python scripts/tunix_sampler_bench.py --model_dir D --prompts P.npy \
      --new_tokens 64 --repeats 5

Loads the HF checkpoint with Tunix's own safetensors loader (`tunix.models.qwen2.params`) and
times `tunix.generate.sampler.Sampler.__call__` (its prefill program, then its decode
`while_loop`, the KV cache donated), greedy, exactly `new_tokens` tokens per row. The prompts are
token ids, handed to the sampler through a tokenizer that maps a string of ids to those ids, so
both sides see the same tokens. Its pad id is -1: Tunix masks every token equal to the pad id, and
no real token is -1. Its end-of-sequence id is the vocabulary size, never sampled.

Prints one JSON object: per batch size, the median seconds, the seconds of the first call
(compile + run), and the generated ids.
"""

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen2 import model as model_lib
from tunix.models.qwen2 import params as params_lib


class IdTokenizer:
  """'12 7 99' <-> [12, 7, 99]: lets token-id prompts through Tunix's string interface."""

  def encode(self, text: str, **kwargs) -> list[int]:
    del kwargs
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs) -> str:
    del kwargs
    return ' '.join(str(int(t)) for t in ids)

  def bos_id(self) -> int:
    return 0  # falsy: the sampler prepends nothing

  def eos_id(self) -> int:
    return -2

  def pad_id(self) -> int:
    return -1


def tunix_config(model_dir: str) -> model_lib.ModelConfig:
  with open(os.path.join(model_dir, 'config.json')) as f:
    hf = json.load(f)
  return model_lib.ModelConfig(
    num_layers=hf['num_hidden_layers'],
    vocab_size=hf['vocab_size'],
    embed_dim=hf['hidden_size'],
    hidden_dim=hf['intermediate_size'],
    num_heads=hf['num_attention_heads'],
    head_dim=hf.get('head_dim') or hf['hidden_size'] // hf['num_attention_heads'],
    num_kv_heads=hf['num_key_value_heads'],
    rope_theta=int(hf.get('rope_theta', (hf.get('rope_parameters') or {}).get('rope_theta', 1e4))),
    norm_eps=hf['rms_norm_eps'],
    use_tied_embedding=hf.get('tie_word_embeddings', False),
    dtype=jnp.float32,
    param_dtype=jnp.float32,
  )


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--model_dir', required=True)
  parser.add_argument('--prompts', required=True, help='.npy int32 [max_batch, prompt_len]')
  parser.add_argument('--batch_sizes', default='1,8,32')
  parser.add_argument('--new_tokens', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--cache_size', type=int, default=0, help='0: next power of 2 >= P + N')
  args = parser.parse_args()
  cfg = tunix_config(args.model_dir)
  model = params_lib.create_model_from_safe_tensors(args.model_dir, cfg, dtype=jnp.float32)
  prompts = np.load(args.prompts)
  P, N = prompts.shape[1], args.new_tokens
  cache_size = args.cache_size or 1 << (P + N - 1).bit_length()
  sampler = sampler_lib.Sampler(
    model,
    IdTokenizer(),
    sampler_lib.CacheConfig(
      cache_size=cache_size,
      num_layers=cfg.num_layers,
      num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
    ),
  )
  out = {'tunix_version': _version(), 'jax': jax.__version__, 'cache_size': cache_size}
  out['results'] = {}
  for b in [int(x) for x in args.batch_sizes.split(',')]:
    strings = [' '.join(map(str, row)) for row in prompts[:b]]

    def call(strings=strings):
      return sampler(
        strings,
        max_generation_steps=N,
        max_prompt_length=P,
        eos_tokens=[cfg.vocab_size],
        temperature=0.0,
      )

    t0 = time.perf_counter()
    res = call()  # warm-up: compiles prefill and decode for this batch
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      res = call()
      times.append(time.perf_counter() - t0)
    tokens = [np.asarray(t).tolist() for t in res.tokens]
    if any(len(t) != N for t in tokens):
      raise SystemExit(f'error: Tunix generated {sorted({len(t) for t in tokens})} tokens, not {N}')
    out['results'][str(b)] = {
      'median_s': statistics.median(times),
      'times_s': times,
      'first_call_s': first,
      'tokens': tokens,
    }
  print(json.dumps(out))


def _version() -> str:
  from importlib import metadata

  return metadata.version('google-tunix')


if __name__ == '__main__':
  main()
