"""The context-parallel attention benchmark at tiny sizes on 8 fake CPU devices."""

import json
import math
import subprocess

import pytest

from earl_jax.testing import helpers

TINY = ('--lengths=64', '--batch=8', '--kv_heads=4', '--head_dim=8', '--reps=2')


def _run(*args: str) -> subprocess.CompletedProcess:
  return helpers.run_module('experiments.context_attention_bench', *args, timeout=120)


def test_every_applicable_run_is_timed_and_the_others_say_why(tmp_path):
  # dp1.cp8 cannot run Ulysses with K = 4 kv heads: the skip the JSON must explain.
  proc = _run(*TINY, '--meshes=dp8,dp2.cp4,dp1.cp8', f'--out={tmp_path}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads((tmp_path / 'context_attention_bench.json').read_text())
  assert r['flags']['lengths'] == [64] and r['flags']['grad'] is True
  assert r['jax'] and r['date'] and r['device']['num_devices'] == 8
  runs = {(row['mesh'], row['kernel']): row for row in r['rows']}
  assert list(runs) == [
    ('dp8', 'blockwise'),
    ('dp2.cp4', 'ring'),
    ('dp2.cp4', 'ring_zigzag'),
    ('dp2.cp4', 'ulysses'),
    ('dp1.cp8', 'ring'),
    ('dp1.cp8', 'ring_zigzag'),
  ]
  for row in runs.values():
    assert math.isfinite(row['median_ms']) and row['median_ms'] > 0
    assert row['min_ms'] <= row['median_ms'] <= row['max_ms'] and len(row['times_ms']) == 2
    assert row['noise'] == pytest.approx((row['max_ms'] - row['min_ms']) / row['median_ms'])
    assert row['compile_s'] >= row['lower_s'] > 0 and row['per_device_mib'] > 0
    assert row['vs_baseline'] == pytest.approx(
      runs['dp8', 'blockwise']['median_ms'] / row['median_ms']
    )
    # The same attention everywhere: every kernel's gradients match the baseline's.
    assert row['checked_against'] == 'dp8 blockwise' and row['max_abs_diff'] < 1e-4
  assert runs['dp8', 'blockwise']['vs_baseline'] == 1.0 and not runs['dp8', 'blockwise']['tie']
  assert runs['dp2.cp4', 'ring']['per_device'] == {'rows': 4, 'tokens': 16}
  assert r['skipped'] == [
    {
      'length': 64,
      'mesh': 'dp1.cp8',
      'kernel': 'ulysses',
      'reason': 'Ulysses needs C = 8 to divide the K = 4 kv heads',
    }
  ]
  md = (tmp_path / 'context_attention_bench.md').read_text()
  assert '| mesh | kernel | median ms | noise | vs dp8 | compile s | per-device MiB |' in md
  assert '| dp8 | blockwise |' in md and 'skipped: dp1.cp8 ulysses:' in md


def test_the_baseline_at_other_tiles_is_timed_beside_it(tmp_path):
  """`--baseline_blocks`: the data-parallel baseline again at smaller tiles, rows
  'blockwise@<b>' right after it, compared with it like every kernel."""
  proc = _run(
    *TINY,
    '--meshes=dp8,dp2.cp4',
    '--kernels=ring',
    '--baseline_blocks=16,8',
    '--nograd',
    f'--out={tmp_path}',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads((tmp_path / 'context_attention_bench.json').read_text())
  assert r['flags']['baseline_blocks'] == [16, 8]
  rows = {row['kernel']: row for row in r['rows']}
  assert list(rows) == ['blockwise', 'blockwise@16', 'blockwise@8', 'ring']
  for k in ('blockwise@16', 'blockwise@8'):
    assert rows[k]['mesh'] == 'dp8' and rows[k]['max_abs_diff'] < 1e-4
    assert rows[k]['vs_baseline'] == pytest.approx(
      rows['blockwise']['median_ms'] / rows[k]['median_ms']
    )
  md = (tmp_path / 'context_attention_bench.md').read_text()
  assert '| dp8 | blockwise@8 |' in md


@pytest.mark.parametrize(
  'meshes, error',
  [
    ('dp8,dp2xcp4', "error: --meshes 'dp2xcp4': expected dpX.cpY (or dpX alone), e.g. dp2.cp4"),
    ('dp8,dp2.cp2', 'error: --meshes dp2.cp2: uses 2 x 2 = 4 devices, expected 8'),
  ],
)
def test_a_bad_mesh_ends_in_one_line(tmp_path, meshes, error):
  proc = _run(*TINY, f'--meshes={meshes}', f'--out={tmp_path}')
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == error
  assert 'Traceback' not in proc.stderr
  assert not list(tmp_path.iterdir())
