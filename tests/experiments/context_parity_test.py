"""The context-parallel parity report: every layout within 1e-5 of the unsplit model."""

import json

from earl_jax.testing import helpers


def test_a_ring_layout_equals_the_unsplit_model_one_sequence_and_packed(tmp_path):
  proc = helpers.run_module(
    'experiments.context_parity',
    '--layouts=dp2.cp4,dp1.cp8',
    '--pads=0,4',
    f'--out={tmp_path}',
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads((tmp_path / 'context_parity.json').read_text())
  got = [(row['layout'], row['tokens'], row['zigzag'], row['packed']) for row in r['rows']]
  assert got == [
    ('dp2.tp1.cp4', 32, True, False),
    ('dp2.tp1.cp4', 32, True, True),
    ('dp2.tp1.cp4', 36, False, False),
    ('dp2.tp1.cp4', 36, False, True),
    ('dp1.tp1.cp8', 32, True, False),
    ('dp1.tp1.cp8', 32, True, True),
  ]
  assert r['skipped'] == ['dp1.tp1.cp8 at T = 36: cp = 8 does not divide it']
  for row in r['rows']:
    assert 0 <= row['logits_max_abs_diff'] <= 1e-5 and row['logits_max_abs'] > 1.0
    assert row['loss_rel_diff'] <= 1e-5 and row['grad_max_rel_diff'] <= 1e-5


def test_a_layout_without_context_parallelism_is_refused_in_one_line(tmp_path):
  proc = helpers.run_module('experiments.context_parity', '--layouts=dp8', f'--out={tmp_path}')
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith('error: --layouts: dp8.tp1 is not a')
