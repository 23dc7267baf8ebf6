"""Decode tokens/s: our rollout sampler vs Tunix's sampler and HF `generate`, on identical weights.

  # the benchmark-sized random Qwen2 (V=4096, D=512, F=1408, L=8) from the fixture script:
  HF_HUB_OFFLINE=1 /tmp/venv-torch/bin/python scripts/make_qwen2_fixture.py --bench_dir /tmp/qwen2_bench
  python experiments/decode_throughput.py --model_dir=/tmp/qwen2_bench \
      --tunix_python=/tmp/venv-tunix/bin/python --torch_python=/tmp/venv-torch/bin/python

Every side decodes greedily exactly --new_tokens tokens after the same random prompts, at each
batch size, with a KV cache, in f32 on the CPU (one JAX device). Each measurement is warmed up
and repeated, in --rounds rounds over the sides, every other round in reverse order (so that no
side always runs first or last); the median pools every round, and the first call (compile +
run) of the first round is reported. Tunix and torch never enter earl_jax's environment: each
peer runs as a subprocess of another Python that has it (scripts/tunix_sampler_bench.py,
scripts/hf_generate_bench.py), one side at a time, so no two sides share the cores. The generated tokens are compared with ours, which also proves the weights
are the same.

The multi-turn case: a second turn appends an observation of --obs_len tokens after the first
turn's prompt and reply, then decodes --new_tokens more. Ours prefills only the observation
against the kept cache (as the rollout engine does); the peers' samplers take a prompt and build
a fresh cache per call, so they prefill the whole history. `ours_rebuild` is our own program fed
the whole history the same way, to separate the kept cache's gain from the rest.
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
from earl_jax.errors import ConfigError
from earl_jax.models import hf_import, qwen2
from earl_jax.rollout import sampler
from earl_jax.sharding import mesh as mesh_lib

_MODEL_DIR = flags.DEFINE_string('model_dir', '/tmp/qwen2_bench', 'HF Qwen2 checkpoint.')
_TUNIX_PYTHON = flags.DEFINE_string(
  'tunix_python', '', 'A Python with google-tunix; empty skips the Tunix side.'
)
_TORCH_PYTHON = flags.DEFINE_string(
  'torch_python', '', 'A Python with torch + transformers; empty skips the HF side.'
)
_BATCH = flags.DEFINE_list('batch_sizes', ['1', '8', '32', '64'], 'Batch sizes.')
_NEW = flags.DEFINE_integer('new_tokens', 64, 'Tokens generated per row and turn.')
_PROMPT = flags.DEFINE_integer('prompt_len', 32, 'First-turn prompt tokens per row.')
_OBS = flags.DEFINE_integer('obs_len', 32, 'Second-turn observation tokens per row (0: no turn 2).')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed repetitions (after one warm-up).')
_ROUNDS = flags.DEFINE_integer(
  'rounds', 2, 'Rounds over the sides, every other one in reverse order; medians pool them all.'
)
_THREADS = flags.DEFINE_integer('threads', 0, 'torch threads (0: torch default).')
_OUT = flags.DEFINE_string('out', 'runs/decode_throughput.json', 'JSON results.')


def _bucket(n: int) -> int:
  return 1 << (n - 1).bit_length()


def _timed(fn, repeats):
  """(median seconds, all timed seconds, first call seconds, last result)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times, first, out


def _ours(model_dir, prompts, obs, batch_sizes, new_tokens, repeats):
  mesh = mesh_lib.make_mesh(ParallelConfig(), jax.devices()[:1])
  cfg, graphdef, state = hf_import.load(model_dir, mesh)
  P, N = prompts.shape[1], new_tokens
  n_obs = obs.shape[1]
  S1 = _bucket(P + N)  # the first turn's cache bucket
  S2 = _bucket(P + N + n_obs + N)  # room for both turns
  config = sampler.SamplingConfig(greedy=True, max_new_tokens=N)

  @jax.jit
  def generate(state, prompt, cache):
    model = nnx.merge(graphdef, state)
    n = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    # eot = vocab_size is never sampled, so every row decodes exactly N tokens.
    return sampler.generate(
      model, cache, prompt, n, jax.random.key(0), eot_id=cfg.vocab_size, config=config
    )

  out = {}
  with jax.set_mesh(mesh):
    for b in batch_sizes:
      prompt = jnp.asarray(prompts[:b])
      empty1 = qwen2.KVCache.init(cfg, b, S1, mesh)
      med, times, first, (gen, _) = _timed(
        lambda p=prompt, c=empty1: generate(state, p, c), repeats
      )
      row = {'median_s': med, 'times_s': times, 'first_call_s': first}
      row['tokens'] = np.asarray(gen.tokens).tolist()
      if n_obs:
        # Turn 2 against the kept cache: prefill the observation only, then decode.
        empty2 = qwen2.KVCache.init(cfg, b, S2, mesh)
        gen1, kept = generate(state, prompt, empty2)
        observation = jnp.asarray(obs[:b])
        med, times, first, (gen2, _) = _timed(
          lambda p=observation, c=kept: generate(state, p, c), repeats
        )
        row['turn2_kept'] = {'median_s': med, 'times_s': times, 'first_call_s': first}
        row['turn2_kept']['tokens'] = np.asarray(gen2.tokens).tolist()
        # Turn 2 rebuilt: a fresh cache, the whole history as the prompt.
        history = np.concatenate([prompts[:b], np.asarray(gen1.tokens), obs[:b]], axis=1)
        row['history'] = history
        hist = jnp.asarray(history)
        med, times, first, (gen3, _) = _timed(
          lambda p=hist, c=empty2: generate(state, p, c), repeats
        )
        row['turn2_rebuild'] = {'median_s': med, 'times_s': times, 'first_call_s': first}
        row['turn2_rebuild']['tokens'] = np.asarray(gen3.tokens).tolist()
      out[b] = row
  return cfg, out, S1, S2


def _peer(python, script, model_dir, prompts, batch_sizes, new_tokens, repeats, extra=()):
  """Runs a peer's timing script on `prompts`; returns its JSON (results keyed by batch)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'prompts.npy')
    np.save(path, prompts)
    cmd = [
      python,
      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts', script),
      f'--model_dir={model_dir}',
      f'--prompts={path}',
      f'--batch_sizes={",".join(map(str, batch_sizes))}',
      f'--new_tokens={new_tokens}',
      f'--repeats={repeats}',
      *extra,
    ]
    print(f'running {script} on {prompts.shape[1]}-token prompts ...', flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
      sys.exit(f'error: {script} failed ({" ".join(cmd)}):\n{proc.stderr[-3000:]}')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pool(into, more):
  """`into` with `more`'s timings appended wherever both have `times_s` (medians recomputed);
  everything else (tokens, first calls) stays as `into` had it. None: `more` itself."""
  if into is None:
    _note_rounds(more)
    return more
  for k, v in into.items():
    if isinstance(v, dict) and isinstance(more.get(k), dict):
      _pool(v, more[k])
  if 'times_s' in into and 'times_s' in more:
    into['times_s'] = [*into['times_s'], *more['times_s']]
    into['median_s'] = statistics.median(into['times_s'])
    into['round_medians_s'] = [*into['round_medians_s'], more['median_s']]
  return into


def _note_rounds(tree) -> None:
  """Starts `round_medians_s` (one median per round) wherever a first round has `times_s`."""
  for v in tree.values():
    if isinstance(v, dict):
      _note_rounds(v)
  if 'times_s' in tree:
    tree['round_medians_s'] = [tree['median_s']]


def _agreement(a, b) -> float:
  return float(np.mean(np.asarray(a) == np.asarray(b)))


def check_flags() -> None:
  for b in _BATCH.value:
    if not b.isdigit() or int(b) < 1:
      raise ConfigError(f'--batch_sizes: {b!r} is not a positive integer.')
  for name, flag, lo in (('new_tokens', _NEW, 1), ('prompt_len', _PROMPT, 1), ('obs_len', _OBS, 0)):
    if flag.value < lo:
      raise ConfigError(f'--{name} must be >= {lo}, got {flag.value}.')
  if _REPEATS.value < 1 or _ROUNDS.value < 1:
    raise ConfigError(
      f'--repeats and --rounds must be >= 1, got {_REPEATS.value}, {_ROUNDS.value}.'
    )
  if not os.path.isfile(os.path.join(_MODEL_DIR.value, 'config.json')):
    raise ConfigError(f'--model_dir: {_MODEL_DIR.value!r} has no config.json (an HF checkpoint).')
  for name, flag in (('tunix_python', _TUNIX_PYTHON), ('torch_python', _TORCH_PYTHON)):
    if flag.value and not os.access(flag.value, os.X_OK):
      raise ConfigError(f'--{name}: {flag.value!r} is not an executable Python.')


def main(argv):
  del argv
  check_flags()
  runtime.setup(cpu_devices=1)
  batch_sizes = [int(b) for b in _BATCH.value]
  cfg = hf_import.load_config(_MODEL_DIR.value)
  rng = np.random.RandomState(0)
  B, N = max(batch_sizes), _NEW.value
  prompts = rng.randint(0, cfg.vocab_size, (B, _PROMPT.value)).astype(np.int32)
  obs = rng.randint(0, cfg.vocab_size, (B, _OBS.value)).astype(np.int32)
  peer_sides = [
    (name, python, script, extra)
    for name, python, script, extra in (
      ('tunix', _TUNIX_PYTHON.value, 'tunix_sampler_bench.py', ()),
      ('hf', _TORCH_PYTHON.value, 'hf_generate_bench.py', (f'--threads={_THREADS.value}',)),
    )
    if python
  ]
  sides = ['ours', *(side[0] for side in peer_sides)]
  ours, peers, history = None, {}, None
  for r in range(_ROUNDS.value):
    order = sides if r % 2 == 0 else sides[::-1]
    print(f'round {r + 1} of {_ROUNDS.value}: {", ".join(order)}', flush=True)
    for side in order:
      if side == 'ours':
        cfg, got, S1, S2 = _ours(_MODEL_DIR.value, prompts, obs, batch_sizes, N, _REPEATS.value)
        ours = _pool(ours, got)
        history = ours[B].get('history')
        continue
      # The peers' second turn takes the history our first turn produced (ours runs first in
      # the first round; the greedy tokens agree).
      name, python, script, extra = next(p for p in peer_sides if p[0] == side)
      args = (python, script, _MODEL_DIR.value)
      got = {'turn1': _peer(*args, prompts, batch_sizes, N, _REPEATS.value, extra)}
      if _OBS.value:
        turn2_extra = (*extra, f'--cache_size={S2}') if name == 'tunix' else extra
        got['turn2'] = _peer(*args, history, batch_sizes, N, _REPEATS.value, turn2_extra)
      peers[name] = _pool(peers.get(name), got)

  print(
    f'model {cfg.name}: {cfg.num_params / 1e6:.1f}M params, prompt {_PROMPT.value}, {N} new '
    f'tokens, cache bucket {S1}, JAX {jax.__version__} on {jax.devices()[0].platform}'
  )
  head = f'{"batch":>5} {"ours tok/s":>11}'
  for name in peers:
    head += f' {name + " tok/s":>11} {"ours/" + name:>10} {"same":>6}'
  print(head)
  rows = []
  for b in batch_sizes:
    o = ours[b]
    tps = b * N / o['median_s']
    row = {
      'batch': b,
      'ours_tokens_per_s': tps,
      'ours_median_s': o['median_s'],
      'ours_round_medians_s': o['round_medians_s'],
      'ours_first_call_s': o['first_call_s'],
    }
    line = f'{b:>5} {tps:>11.0f}'
    for name, peer in peers.items():
      r = peer['turn1']['results'][str(b)]
      peer_tps = b * N / r['median_s']
      same = _agreement(r['tokens'], o['tokens'])
      row.update(
        {
          f'{name}_tokens_per_s': peer_tps,
          f'{name}_median_s': r['median_s'],
          f'{name}_round_medians_s': r['round_medians_s'],
          f'{name}_first_call_s': r.get('first_call_s'),
          f'ours_over_{name}': tps / peer_tps,
          f'{name}_token_agreement': same,
        }
      )
      line += f' {peer_tps:>11.0f} {tps / peer_tps:>9.2f}x {same:>6.3f}'
    print(line)
    rows.append(row)

  turn2 = []
  if history is not None:
    print(
      f'\nturn 2: {_OBS.value}-token observation after {history.shape[1] - _OBS.value} tokens '
      f'of history, {N} new tokens (cache bucket {S2}); seconds per turn'
    )
    head = f'{"batch":>5} {"ours kept":>10} {"ours rebuilt":>13} {"kept gain":>10}'
    for name in peers:
      head += f' {name:>8} {"ours/" + name:>10}'
    print(head)
    for b in batch_sizes:
      kept, rebuilt = ours[b]['turn2_kept'], ours[b]['turn2_rebuild']
      row = {
        'batch': b,
        'history_tokens': int(history.shape[1]),
        'ours_kept_s': kept['median_s'],
        'ours_rebuild_s': rebuilt['median_s'],
        'kept_over_rebuild': rebuilt['median_s'] / kept['median_s'],
        'kept_rebuild_token_agreement': _agreement(kept['tokens'], rebuilt['tokens']),
      }
      line = (
        f'{b:>5} {kept["median_s"]:>10.3f} {rebuilt["median_s"]:>13.3f} '
        f'{row["kept_over_rebuild"]:>9.2f}x'
      )
      for name, peer in peers.items():
        r = peer['turn2']['results'][str(b)]
        row.update(
          {
            f'{name}_s': r['median_s'],
            f'ours_kept_over_{name}': r['median_s'] / kept['median_s'],
            f'{name}_token_agreement': _agreement(r['tokens'], rebuilt['tokens']),
          }
        )
        line += f' {r["median_s"]:>8.3f} {row[f"ours_kept_over_{name}"]:>9.2f}x'
      print(line)
      turn2.append(row)

  result = {
    'model_dir': _MODEL_DIR.value,
    'params': cfg.num_params,
    'prompt_len': _PROMPT.value,
    'obs_len': _OBS.value,
    'new_tokens': N,
    'cache_bucket': S1,
    'turn2_cache_bucket': S2,
    'repeats': _REPEATS.value,
    'rounds': _ROUNDS.value,
    'jax': jax.__version__,
    'tunix': peers['tunix']['turn1']['tunix_version'] if 'tunix' in peers else None,
    'torch': peers['hf']['turn1']['torch'] if 'hf' in peers else None,
    'torch_threads': peers['hf']['turn1']['threads'] if 'hf' in peers else None,
    'rows': rows,
    'turn2': turn2,
  }
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=2)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  runtime.run(main)
