"""The refill benchmark's code preset: its policy is the code warm start, which it needs before
anything compiles, and both schedules play the same episodes from it."""

import dataclasses
import json
import subprocess

import pytest

from earl_jax.sft.job import SFTRun
from earl_jax.testing import helpers
from experiments.configs import sft as sft_presets


def _run(*args: str) -> subprocess.CompletedProcess:
  return helpers.run_module('experiments.rollout_refill', '--presets=code', *args)


@pytest.fixture(scope='module')
def warm_start(tmp_path_factory) -> str:
  """One SFT step of the code model: replies that are still mostly wrong, so that episodes
  run one or two turns."""
  workdir = tmp_path_factory.mktemp('sft') / 'run'
  config = dataclasses.replace(sft_presets.smoke(), steps=1, eval_every=0, checkpoint_every=1)
  SFTRun(config, workdir=str(workdir)).run(progress=False)
  return str(workdir / 'checkpoints')


def test_code_without_its_warm_start_ends_in_one_line(tmp_path):
  missing = tmp_path / 'code_sft' / 'checkpoints'
  proc = _run(f'--code_checkpoint={missing}', f'--out={tmp_path / "r.json"}')
  assert proc.returncode == 2, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("error: --code_checkpoint (the 'code' preset's policy): ")
  assert str(missing) in last and '`python experiments/sft.py --config=code`' in last
  assert 'Compiling' not in proc.stderr and not (tmp_path / 'r.json').exists()


def test_code_plays_the_same_episodes_on_both_schedules(warm_start, tmp_path):
  out = tmp_path / 'r.json'
  proc = _run(
    f'--code_checkpoint={warm_start}',
    '--slots=8',
    '--ratios=2',
    '--repeats=1',
    '--nocontrol',
    f'--out={out}',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r['code_checkpoint'] == warm_start
  (case,) = r['cases']
  assert (case['preset'], case['slots'], case['episodes']) == ('code', 8, 16)
  assert case['identical'] and case['max_logprob_gap'] <= 1e-5
  for schedule in ('lockstep', 'refill'):
    m = case['schedules'][schedule]['median']
    assert m['compiles'] == 0 and 0 < m['slot_occupancy'] <= 1
    # 16 episodes of 1 or 2 turns on 8 slots: at least 2 calls, at most 4.
    assert 2 <= m['calls'] <= 4
