"""The paper-scale context-fit view at a tiny scale: the analytic grid, XLA's check, the files."""

import json

import pytest

from earl_jax.testing import helpers

# tiny-game (f32, 2 layers) on 8 fake devices, a 0.5 MB device (x 0.9 usable): the train update
# holds every layer's activations, so it outgrows the budget first, and context parallelism,
# which splits the one sequence of a batch shard over devices, lets it reach further.
TINY = (
  '--model=tiny-game',
  '--dtype=float32',
  '--hbm_gb=0.03',
  '--contexts=256,512,1K,2K,4K',
)


def _run(*args: str):
  return helpers.run_module('experiments.context_fit', *args, timeout=300)


def test_the_longest_fit_of_each_stage_with_and_without_cp(tmp_path):
  proc = _run(*TINY, '--xla_stages=train', f'--out={tmp_path}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads((tmp_path / 'context_fit.json').read_text())
  assert r['model'] == 'tiny-game' and r['devices'] == 8 and r['contexts'][-1] == 4096
  assert r['budget'] == int(0.03e9 * 0.9)
  stages = {s['stage']: s for s in r['stages']}
  assert list(stages) == ['rollout', 'experience', 'train']
  for s in stages.values():
    # The longest fit of each layout is the last context whose need (with the margin) fits.
    for name, row in s['needs'].items():
      fitting = [t for t in r['contexts'] if row[str(t)] * 1.05 <= r['budget']]
      assert s['longest'][name] == (max(fitting) if fitting else None), (s['stage'], name)
    without, with_cp = s['best_without_cp'], s['best_with_cp']
    assert 'cp' not in without['layout']
    assert with_cp['context'] >= without['context']
  train = stages['train']
  assert 'cp' in train['best_with_cp']['layout']
  assert train['best_with_cp']['context'] > train['best_without_cp']['context']
  # XLA compiled the train step at each best layout's longest fit and the context above it.
  checked = [(x['layout'], x['context'], x['with_cp']) for x in r['xla']]
  for key in ('best_without_cp', 'best_with_cp'):
    best = train[key]
    assert (best['layout'], best['context'], key == 'best_with_cp') in checked
  assert all(x['stage'] == 'train' and x['xla_peak'] > 0 for x in r['xla'])
  for key, with_cp in (('xla_without_cp', False), ('xla_with_cp', True)):
    fitting = [x['context'] for x in r['xla'] if x['with_cp'] == with_cp and x['fits']]
    assert train[key]['context'] == max(fitting, default=None)
  assert 'xla_with_cp' not in stages['rollout']
  md = (tmp_path / 'context_fit.md').read_text()
  assert '| train |' in md and 'XLA compile-only check' in md and 'not checked' in md
  assert (tmp_path / 'context_fit.png').stat().st_size > 10_000


@pytest.mark.parametrize(
  ('args', 'error'),
  [
    (('--contexts=4K,2K',), '--contexts must increase'),
    (('--contexts=4Q',), "--contexts: '4Q' is not a token count"),
    (('--stages=train', '--xla_stages=rollout'), 'must be among --stages'),
    (('--xla_layers=28',), '--xla_layers=28: expected 0 (the whole model) or 2 to 27 (qwen2.5-7b'),
    (('--model=tiny-game', '--xla_layers=2'), 'expected 0 (the whole model) (tiny-game has 2'),
  ],
)
def test_bad_flags_are_refused_in_one_line(tmp_path, args, error):
  proc = _run(*args, f'--out={tmp_path}')
  assert proc.returncode == 2 and error in proc.stderr
  assert 'Traceback' not in proc.stderr
