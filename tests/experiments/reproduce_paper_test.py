"""The paper scripts as a user runs them: bad input ends in one line and exit code 2, and the
simulation reproduces the memory cells and states its fit."""

import json
import os
import subprocess

import pytest

from earl_jax.testing import helpers


def _run(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
  return helpers.run_module(module, *args, timeout=timeout)


@pytest.mark.parametrize(
  'module,args,fragment',
  [
    ('experiments.reproduce_paper', ['--artefacts=fig9'], '--artefacts fig9: expected any of'),
    ('experiments.simulate_paper', ['--nomeasure', '--tp=3,8'], 'num_heads (H)=64 is not divis'),
    ('experiments.simulate_paper', ['--nomeasure', '--lengths=8192'], 'one value per --lengths'),
    ('experiments.simulate_paper', ['--nomeasure', '--model=huge'], '--model huge'),
    ('experiments.data_volume', ['--lengths=1k'], '--lengths 1k: expected integers'),
    ('experiments.context_cap', ['--cap=6'], '--cap 6: expected at least the first turn'),
    ('experiments.context_cap', ['--opponent=alphazero'], "'alphazero' is not one of"),
    ('experiments.dispatch_latency', ['--lengths=8192', '--payload_mib=1,2'], 'one value per'),
    ('experiments.dispatch_latency', ['--strategies=teleport'], '--strategies teleport'),
    ('experiments.dispatch_latency', ['--src=dp4'], '--src dp4: expected a layout over 8'),
    ('experiments.dispatch_latency', ['--lengths=abc'], '--lengths abc / --payload_mib'),
  ],
)
def test_bad_input_is_one_line_and_exit_code_2(module, args, fragment, tmp_path):
  dirs = ('experiments.reproduce_paper', 'experiments.context_cap')
  out = f'--out_dir={tmp_path}/o' if module in dirs else f'--out={tmp_path}/x.json'
  r = _run(module, *args, out)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [x for x in r.stderr.splitlines() if x.startswith('error:')]
  assert len(lines) == 1 and fragment in lines[0], r.stderr[-2000:]
  assert 'Traceback' not in r.stderr
  assert not os.path.exists(tmp_path / 'x.json') and not os.path.exists(tmp_path / 'o')


def test_simulation_reproduces_the_memory_cells_and_states_its_fit(tmp_path):
  r = _run('experiments.simulate_paper', '--nomeasure', f'--out={tmp_path}/s.json')
  assert r.returncode == 0, r.stderr[-2000:]
  report = json.loads((tmp_path / 's.json').read_text())
  mem = report['memory']
  # The TP4 / TP8 flip from the K/V capacity alone, in every cell the paper measured.
  assert mem['winner_agrees'] == 29 and mem['oom_agrees'] == 30
  assert 0.3e6 < mem['engines']['TP4']['kv_capacity_tokens'] < 0.52e6
  lo, hi = mem['oom_bracket']
  assert lo < mem['oom_ratio'] <= hi
  fitted = {v['variant']: v for v in report['dispatch']}['fitted to the paper at 8K']
  assert abs(fitted['rows'][0]['ratio'] - 9.7) < 0.05  # the fit
  assert all(x['within_15pct'] for x in fitted['rows'])  # the predictions at 16K and 32K
  # At the measured TCP rate the controller is far slower than the paper's baseline.
  tcp = report['dispatch'][0]
  assert tcp['variant'].startswith('tcp') and tcp['rows'][0]['ratio'] > 30


# The quick reproduction itself runs in CI through notebooks/paper_figures.py
# (tests/notebooks_test.py checks its files and key figures).
