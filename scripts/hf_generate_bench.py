"""HF transformers `generate` timing, the torch side of experiments/decode_throughput.py.

Runs in a separate environment that has torch and transformers (never earl_jax's venv):

  python3.11 -m venv /tmp/venv-torch
  /tmp/venv-torch/bin/pip install torch==2.13.0 transformers safetensors numpy
  /tmp/venv-torch/bin/python scripts/hf_generate_bench.py --model_dir D --prompts P.npy \
      --new_tokens 64 --repeats 5

Prints one JSON object: per batch size, the median seconds of a greedy generate of exactly
`new_tokens` tokens (KV cache on), the first call's seconds, and the generated ids (to check
both sides decode the same).
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')

import numpy as np
import torch
from transformers import Qwen2ForCausalLM


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--model_dir', required=True)
  parser.add_argument('--prompts', required=True, help='.npy int32 [max_batch, prompt_len]')
  parser.add_argument('--batch_sizes', default='1,8,32')
  parser.add_argument('--new_tokens', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--threads', type=int, default=0)
  args = parser.parse_args()
  if args.threads:
    torch.set_num_threads(args.threads)
  model = Qwen2ForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
  prompts = np.load(args.prompts)
  out = {'torch': torch.__version__, 'threads': torch.get_num_threads(), 'results': {}}
  for b in [int(x) for x in args.batch_sizes.split(',')]:
    ids = torch.from_numpy(prompts[:b].astype(np.int64))
    # Every prompt token is real: without an explicit all-ones mask, transformers would infer one
    # from pad_token_id and mask every prompt token whose id happens to equal it.
    kwargs = {
      'attention_mask': torch.ones_like(ids),
      'max_new_tokens': args.new_tokens,
      'min_new_tokens': args.new_tokens,
      'do_sample': False,
      'use_cache': True,
      'pad_token_id': 0,
    }
    with torch.inference_mode():
      t0 = time.perf_counter()
      gen = model.generate(ids, **kwargs)  # warm-up
      first = time.perf_counter() - t0
      times = []
      for _ in range(args.repeats):
        t0 = time.perf_counter()
        gen = model.generate(ids, **kwargs)
        times.append(time.perf_counter() - t0)
    out['results'][str(b)] = {
      'median_s': statistics.median(times),
      'times_s': times,
      'first_call_s': first,
      'tokens': gen[:, ids.shape[1] :].tolist(),
    }
  print(json.dumps(out))


if __name__ == '__main__':
  main()
