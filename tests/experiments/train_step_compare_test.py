"""The train-step comparison on the tiny fixture, our side only (Tunix needs its own venv)."""

import json
import subprocess

import numpy as np

from earl_jax.testing import helpers

FIXTURE = helpers.fixture_path('qwen2_tiny')
REFERENCE = helpers.fixture_path('qwen2_tiny_reference.npz')


def _run(*args: str, env=None) -> subprocess.CompletedProcess:
  return helpers.run_module(
    'experiments.train_step_compare', f'--model_dir={FIXTURE}', *args, env=env
  )


def test_our_step_loss_is_hf_next_token_nll(tmp_path):
  ref = np.load(REFERENCE)
  tokens, logits = ref['tokens'], ref['logits_untied'].astype(np.float64)
  path = tmp_path / 'tokens.npz'
  np.savez(path, **{'3x32': tokens})
  proc = _run(
    '--side=ours', f'--tokens={path}', '--repeats=1', env={'EARL_BENCH_CACHE_DIR': str(tmp_path)}
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])['results']['3x32']
  # transformers' logits of the same tokens: the mean NLL of every next token.
  logp = logits[:, :-1] - np.log(np.exp(logits[:, :-1]).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
  assert abs(got['loss'] - nll) < 1e-5
  assert got['grad_norm'] > 0 and got['compile_s'] >= got['lower_s'] > 0


def test_rounds_pool_the_steps_and_the_second_round_compiles_from_the_cache(tmp_path):
  out = tmp_path / 'compare.json'
  proc = _run('--shapes=2x16,1x32', '--repeats=2', '--rounds=2', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert [row['shape'] for row in r['rows']] == ['2x16', '1x32'] and r['tunix'] is None
  for row in r['rows']:
    ours = row['ours']
    assert len(ours['round_medians_s']) == len(ours['compile_s']) == 2
    assert min(ours['round_medians_s']) <= ours['median_s'] <= max(ours['round_medians_s'])
    assert ours['tokens_per_s'] == row['tokens'] / ours['median_s']
    # The second process loads the program the first one compiled.
    assert ours['cached_over_cold_compile'] < 1.0


def test_bad_shape_ends_in_one_line():
  proc = _run('--shapes=8x512,8by512')
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == (
    "error: --shapes: '8by512': expected rows x tokens, e.g. 8x512 (tokens >= 2)"
  )
