"""The decode benchmark on the tiny fixture, our side only (the peers need their own venvs)."""

import json
import subprocess

from earl_jax.testing import helpers

FIXTURE = helpers.fixture_path('qwen2_tiny')


def _run(*args: str) -> subprocess.CompletedProcess:
  return helpers.run_module('experiments.decode_throughput', f'--model_dir={FIXTURE}', *args)


def test_second_turn_on_the_kept_cache_decodes_what_the_whole_history_does(tmp_path):
  out = tmp_path / 'decode.json'
  proc = _run(
    '--batch_sizes=1,3',
    '--new_tokens=4',
    '--prompt_len=5',
    '--obs_len=3',
    '--repeats=1',
    '--rounds=2',
    f'--out={out}',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert [row['batch'] for row in r['rows']] == [1, 3] and r['rounds'] == 2
  assert r['cache_bucket'] == 16 and r['turn2_cache_bucket'] == 16  # 5 + 4 + 3 + 4 = 16
  for row in r['rows']:
    assert row['ours_tokens_per_s'] == row['batch'] * 4 / row['ours_median_s']
    rounds = row['ours_round_medians_s']  # one median per round, the pooled one between them
    assert len(rounds) == 2 and min(rounds) <= row['ours_median_s'] <= max(rounds)
  for row in r['turn2']:
    assert row['history_tokens'] == 5 + 4 + 3
    # Prefilling only the observation against the first turn's cache gives the same greedy
    # reply as prefilling the whole history into a fresh cache.
    assert row['kept_rebuild_token_agreement'] == 1.0


def test_bad_batch_sizes_end_in_one_line():
  proc = _run('--batch_sizes=8,x')
  assert proc.returncode == 2
  assert (
    proc.stderr.strip().splitlines()[-1] == "error: --batch_sizes: 'x' is not a positive integer."
  )
