"""Train step: our Qwen2 against Tunix's on identical weights (compile seconds, tokens/s, exactness).

  # the benchmark-sized random Qwen2 (V=4096, D=512, F=1408, L=8) from the fixture script:
  HF_HUB_OFFLINE=1 /tmp/venv-torch/bin/python scripts/make_qwen2_fixture.py --bench_dir /tmp/qwen2_bench
  python experiments/train_step_compare.py --model_dir=/tmp/qwen2_bench \
      --tunix_python=/tmp/venv-tunix/bin/python

The step is one forward and backward of the mean next-token negative log-likelihood of random
tokens, the gradient with respect to every parameter, in f32 on one CPU device: ours through
`qwen2.token_logprobs` (blockwise causal attention, chunked vocabulary log-probs, both under
`jax.lax` loops), Tunix's through its `Qwen2.__call__` with a causal mask and a log-softmax of the
logits (scripts/tunix_train_bench.py, run by another Python that has google-tunix; Tunix never
enters earl_jax's environment). Each side runs in its own process, one at a time, in --rounds
rounds (every other one in reverse order); step medians pool the rounds.

Compile seconds are ahead-of-time `lower` + `compile`. Each side runs with the persistent
compilation cache in a fresh directory of its own, set up alike (every program cached): its
first round compiles cold (and writes the cache), every later round is a new process that loads
the programs from that cache, which is what a second run of an experiment pays. Cold is
compared with cold, and cached with cached. The first-step loss and gradient norm of both sides
are reported and compared.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from earl_jax import runtime
from earl_jax.errors import ConfigError

_MODEL_DIR = flags.DEFINE_string('model_dir', '/tmp/qwen2_bench', 'HF Qwen2 checkpoint.')
_TUNIX_PYTHON = flags.DEFINE_string(
  'tunix_python', '', 'A Python with google-tunix; empty skips the Tunix side.'
)
_SHAPES = flags.DEFINE_list('shapes', ['8x512', '2x2048'], 'Token batches, rows x tokens.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed steps per shape (after one warm-up).')
_ROUNDS = flags.DEFINE_integer(
  'rounds', 2, 'Rounds over the sides, every other one in reverse order; medians pool them all.'
)
_OUT = flags.DEFINE_string('out', 'runs/train_step_compare.json', 'JSON results.')
# Internal: one side's process.
_SIDE = flags.DEFINE_string('side', '', 'Internal: run our side on --tokens and print JSON.')
_TOKENS = flags.DEFINE_string('tokens', '', 'Internal: the .npz of token arrays.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_shape(text: str) -> tuple[int, int]:
  rows, sep, length = text.partition('x')
  if not sep or not rows.isdigit() or not length.isdigit() or int(rows) < 1 or int(length) < 2:
    raise ConfigError(f'--shapes: {text!r}: expected rows x tokens, e.g. 8x512 (tokens >= 2)')
  return int(rows), int(length)


def _our_side(model_dir: str, tokens_path: str, repeats: int) -> dict:
  """Compile and time our step on every token array (this process, one CPU device)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  from earl_jax.config import ParallelConfig
  from earl_jax.models import hf_import, qwen2
  from earl_jax.sharding import mesh as mesh_lib

  mesh = mesh_lib.make_mesh(ParallelConfig(), jax.devices()[:1])
  cfg, graphdef, params = hf_import.load(model_dir, mesh)

  def loss_fn(params, tokens):
    logprobs = qwen2.token_logprobs(nnx.merge(graphdef, params), tokens)
    return -jnp.mean(logprobs[:, 1:])  # column 0 has no prefix

  def step(params, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    return loss, optax.global_norm(grads), grads

  out = {
    'jax': jax.__version__,
    'attention': f'{cfg.attention_impl}, block {cfg.attention_block}',
    'logprob_chunk': cfg.logprob_chunk,
    'results': {},
  }
  with jax.set_mesh(mesh), np.load(tokens_path) as arrays:
    for name in arrays.files:
      tokens = jnp.asarray(arrays[name])
      t0 = time.perf_counter()
      lowered = jax.jit(step).lower(params, tokens)
      lower_s = time.perf_counter() - t0
      compiled = lowered.compile()
      compile_s = time.perf_counter() - t0
      loss, norm, _ = jax.block_until_ready(compiled(params, tokens))  # warm-up
      times = []
      for _ in range(repeats):
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
  return out


def _run_side(cmd: list[str], env: dict | None = None) -> dict:
  print(f'running {os.path.basename(cmd[1])} ...', flush=True)
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
  if proc.returncode:
    sys.exit(f'error: {" ".join(cmd)} failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def check_flags() -> list[tuple[int, int]]:
  shapes = [parse_shape(s) for s in _SHAPES.value]
  if _REPEATS.value < 1 or _ROUNDS.value < 1:
    raise ConfigError(
      f'--repeats and --rounds must be >= 1, got {_REPEATS.value}, {_ROUNDS.value}.'
    )
  if not os.path.isfile(os.path.join(_MODEL_DIR.value, 'config.json')):
    raise ConfigError(f'--model_dir: {_MODEL_DIR.value!r} has no config.json (an HF checkpoint).')
  if _TUNIX_PYTHON.value and not os.access(_TUNIX_PYTHON.value, os.X_OK):
    raise ConfigError(f'--tunix_python: {_TUNIX_PYTHON.value!r} is not an executable Python.')
  return shapes


def main(argv):
  del argv
  if _SIDE.value == 'ours':  # a side's process: its cache directory comes from the parent
    runtime.setup(cpu_devices=1, cache_dir=os.environ['EARL_BENCH_CACHE_DIR'])
    print(json.dumps(_our_side(_MODEL_DIR.value, _TOKENS.value, _REPEATS.value)))
    return
  shapes = check_flags()
  import numpy as np

  from earl_jax.models import hf_import

  cfg = hf_import.load_config(_MODEL_DIR.value)
  rng = np.random.RandomState(0)
  names = [f'{b}x{t}' for b, t in shapes]
  with tempfile.TemporaryDirectory() as tmp:
    tokens_path = os.path.join(tmp, 'tokens.npz')
    np.savez(
      tokens_path,
      **{n: rng.randint(0, cfg.vocab_size, s).astype(np.int32) for n, s in zip(names, shapes)},
    )
    ours_cmd = [
      sys.executable,
      os.path.abspath(__file__),
      '--side=ours',
      f'--model_dir={_MODEL_DIR.value}',
      f'--tokens={tokens_path}',
      f'--repeats={_REPEATS.value}',
    ]
    env = {**os.environ, 'EARL_BENCH_CACHE_DIR': os.path.join(tmp, 'jax_cache')}
    tunix_cmd = [
      _TUNIX_PYTHON.value,
      os.path.join(ROOT, 'scripts', 'tunix_train_bench.py'),
      f'--model_dir={_MODEL_DIR.value}',
      f'--tokens={tokens_path}',
      f'--repeats={_REPEATS.value}',
      f'--cache_dir={os.path.join(tmp, "tunix_jax_cache")}',
    ]
    sides = ['ours', 'tunix'] if _TUNIX_PYTHON.value else ['ours']
    runs = {side: [] for side in sides}
    for r in range(_ROUNDS.value):
      order = sides if r % 2 == 0 else sides[::-1]
      print(f'round {r + 1} of {_ROUNDS.value}: {", ".join(order)}', flush=True)
      for side in order:
        runs[side].append(_run_side(ours_cmd, env) if side == 'ours' else _run_side(tunix_cmd))
  report = summarize(runs, names)
  report.update(
    model_dir=_MODEL_DIR.value,
    params=cfg.num_params,
    repeats=_REPEATS.value,
    rounds=_ROUNDS.value,
    attention=runs['ours'][0]['attention'],
    tunix=runs['tunix'][0]['tunix_version'] if 'tunix' in runs else None,
  )
  print(format_table(report))
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)) or '.', exist_ok=True)
    with open(_OUT.value, 'w') as f:
      json.dump(report, f, indent=2)
    print(f'wrote {_OUT.value}')


def summarize(runs: dict[str, list[dict]], names: list[str]) -> dict:
  """Per shape and side: pooled step median, tokens/s, compile seconds per round, loss, norm."""
  rows = []
  for name in names:
    b, t = (int(x) for x in name.split('x'))
    row: dict = {'shape': name, 'tokens': b * t}
    for side, results in runs.items():
      per = [run['results'][name] for run in results]
      times = [x for p in per for x in p['times_s']]
      row[side] = {
        'median_s': statistics.median(times),
        'round_medians_s': [p['median_s'] for p in per],
        'tokens_per_s': b * t / statistics.median(times),
        'compile_s': [p['compile_s'] for p in per],
        'lower_s': [p['lower_s'] for p in per],
        'loss': per[0]['loss'],
        'grad_norm': per[0]['grad_norm'],
      }
    # A side's later rounds load the programs its first one put in the persistent cache.
    for side in runs:
      compile_s = row[side]['compile_s']
      if len(compile_s) > 1:
        row[side]['cached_over_cold_compile'] = min(compile_s[1:]) / compile_s[0]
    ours = row['ours']
    if 'tunix' in row:
      tunix = row['tunix']
      row['ours_over_tunix_tokens_per_s'] = ours['tokens_per_s'] / tunix['tokens_per_s']
      row['tunix_over_ours_cold_compile'] = tunix['compile_s'][0] / ours['compile_s'][0]
      if len(ours['compile_s']) > 1:
        row['tunix_over_ours_cached_compile'] = min(tunix['compile_s'][1:]) / min(
          ours['compile_s'][1:]
        )
      row['loss_abs_diff'] = abs(ours['loss'] - tunix['loss'])
      row['grad_norm_rel_diff'] = abs(ours['grad_norm'] - tunix['grad_norm']) / tunix['grad_norm']
    rows.append(row)
  return {'experiment': 'train_step_compare', 'rows': rows}


def format_table(report: dict) -> str:
  lines = [
    f'train step (forward + backward, f32, one CPU device), {report.get("attention", "")}; '
    'compile s = lower + compile (each side: cold, then from its persistent cache)'
  ]
  head = f'{"shape":>8} {"ours tok/s":>11} {"ours compile s":>15} {"ours loss":>10}'
  has_tunix = any('tunix' in r for r in report['rows'])
  if has_tunix:
    head += f' {"tunix tok/s":>12} {"tunix compile s":>16} {"speed":>7} {"|dloss|":>9} {"dnorm":>9}'
  lines.append(head)
  for r in report['rows']:
    o = r['ours']
    compile_text = ' / '.join(f'{c:.2f}' for c in o['compile_s'])
    line = f'{r["shape"]:>8} {o["tokens_per_s"]:>11.0f} {compile_text:>15} {o["loss"]:>10.6f}'
    if 'tunix' in r:
      t = r['tunix']
      tunix_compile = ' / '.join(f'{c:.2f}' for c in t['compile_s'])
      line += (
        f' {t["tokens_per_s"]:>12.0f} {tunix_compile:>16} '
        f'{r["ours_over_tunix_tokens_per_s"]:>6.2f}x {r["loss_abs_diff"]:>9.1e} '
        f'{r["grad_norm_rel_diff"]:>9.1e}'
      )
    lines.append(line)
  return '\n'.join(lines)


if __name__ == '__main__':
  runtime.run(main)
