"""`experiments/train.py` as a user runs it: every bad input ends in one line, exit code 2, and
leaves the workdir as it was."""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from earl_jax import metrics
from earl_jax.testing import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (case, extra arguments, a fragment the one-line error must contain). Each runs in its own
# process on the `smoke` preset; '{tmp}' is the test's folder.
BAD_INPUTS = [
  ('unknown preset', ['--config=nope'], '--config=nope'),
  ('unknown field', ['--config.nope=1'], "no field 'nope'"),
  ('unknown nested field', ['--config.optim.nope=1'], "OptimConfig has no field 'nope'"),
  ('not an int', ['--config.steps=abc'], "'abc' is not an int"),
  ('zero steps', ['--config.steps=0'], 'steps must be a positive int, got 0'),
  ('negative steps', ['--config.steps=-3'], 'steps must be a positive int, got -3'),
  ('override without value', ['--config.steps'], 'overrides need a value'),
  ('infinite learning rate', ['--config.optim.learning_rate=inf'], 'learning_rate=inf'),
  ('learning rate past float32', ['--config.optim.learning_rate=1e39'], 'learning_rate=1e+39'),
  ('negative learning rate', ['--config.optim.learning_rate=-1'], 'learning_rate must be > 0'),
  ('not a number', ['--config.optim.b1=fast'], "'fast' is not a number"),
  ('unknown schedule', ['--config.optim.schedule=cubic'], "'cubic' is not one of"),
  ('not a bool', ['--config.pack=maybe'], "'maybe' is not a bool"),
  ('buckets out of order', ['--config.buckets.lengths=512,256'], 'strictly increasing'),
  ('no buckets', ['--config.buckets.lengths='], 'lengths is empty'),
  ('unknown model preset', ['--config.model=huge'], "Unknown model preset 'huge'"),
  ('missing model dir', ['--config.model_dir={tmp}/no_model'], 'no_model'),
  ('unknown game', ['--config.env.game=chess'], 'chess'),
  ('unknown opponent', ['--config.eval_env.opponent=alphazero'], 'alphazero'),
  ('unknown strategy', ['--config.dispatch.strategy=teleport'], 'teleport'),
  ('negative temperature', ['--config.rollout.sampling.temperature=-1'], 'temperature'),
  ('micro-batches that do not divide', ['--config.micro_batches=3'], 'micro_batches=3'),
  ('unparsable layout', ['--config.selector.candidates=dp3x'], 'dp3x'),
  ('layout over too many devices', ['--config.selector.candidates=dp16'], 'dp16'),
  ('layout that does not divide the model', ['--config.selector.candidates=dp1.tp8'], 'tp=8'),
  ('negative budget', ['--config.selector.budget_mib=-5'], 'budget_mib'),
  ('unknown flag', ['--nosuchflag'], 'nosuchflag'),
  ('no fake devices', ['--cpu_devices=0'], 'cpu_devices'),
  ('resume without a checkpoint', ['--resume'], 'no checkpoint in'),
  ('workdir under a file', ['--workdir={tmp}/a_file/run'], 'is a file'),
  ('used workdir', ['--workdir={tmp}/used'], 'holds a run'),
]


def _run(args: list[str]) -> subprocess.CompletedProcess:
  return helpers.run_module('experiments.train', '--config=smoke', *args, timeout=300)


def _listing(folder) -> dict[str, int]:
  out = {}
  for dirpath, _, files in os.walk(folder):
    for f in files:
      path = os.path.join(dirpath, f)
      out[os.path.relpath(path, folder)] = os.path.getsize(path)
  return out


def test_every_bad_input_ends_in_one_line(tmp_path):
  (tmp_path / 'a_file').write_text('not a folder')
  (tmp_path / 'used').mkdir()
  (tmp_path / 'used' / 'metrics.jsonl').write_text('{"step": 1}\n')
  cases = []
  for name, args, fragment in BAD_INPUTS:
    workdir = tmp_path / name.replace(' ', '_')
    args = [a.format(tmp=tmp_path) for a in args]
    if not any(a.startswith('--workdir') for a in args):
      args.append(f'--workdir={workdir}')
    cases.append((name, args, fragment))
  before = _listing(tmp_path)
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    results = list(pool.map(lambda c: _run(c[1]), cases))
  failures = []
  for (name, args, fragment), r in zip(cases, results):
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith('error: ')]
    ok = (
      r.returncode == 2
      and 'Traceback' not in r.stderr
      and len(errors) == 1
      and fragment in errors[0]
    )
    if not ok:
      failures.append(f'{name} {args}: rc={r.returncode}, stderr tail: {lines[-3:]}')
  assert not failures, '\n'.join(failures)
  assert len(BAD_INPUTS) >= 25
  # Nothing half-written: no workdir was created or changed by a refused run.
  assert _listing(tmp_path) == before


def test_debug_shows_the_traceback(tmp_path):
  r = _run(['--config.steps=0', '--debug', f'--workdir={tmp_path}/w'])
  assert r.returncode != 0 and 'Traceback' in r.stderr and 'ConfigError' in r.stderr


@pytest.mark.parametrize('flag', ['--move_aside'])
def test_a_used_workdir_is_moved_aside_on_request(tmp_path, flag):
  used = tmp_path / 'run'
  used.mkdir()
  (used / 'metrics.jsonl').write_text('{"step": 1}\n')
  r = _run([flag, f'--workdir={used}', '--config.steps=1', '--config.eval_every=0'])
  assert r.returncode == 0, r.stderr[-2000:]
  aside = [p for p in os.listdir(tmp_path) if p.startswith('run.')]
  assert len(aside) == 1
  assert (tmp_path / aside[0] / 'metrics.jsonl').read_text() == '{"step": 1}\n'
  assert os.path.exists(used / 'metrics.jsonl') and os.path.exists(used / 'config.json')


def _final_checksums(workdir) -> list[int]:
  """The array checksums in the newest checkpoint's meta: the parameters and moments, bitwise."""
  ckpts = workdir / 'checkpoints'
  step = max(int(p) for p in os.listdir(ckpts) if p.isdigit())
  for dirpath, _, files in os.walk(ckpts / str(step) / 'meta'):
    for f in files:
      if 'metadata' in f:
        with open(os.path.join(dirpath, f)) as fh:
          return json.load(fh)['array_checksums']
  raise AssertionError(f'no meta in {ckpts / str(step)}')


def test_kill_during_a_save_then_resume_equals_an_uninterrupted_run(tmp_path):
  """A real training process killed with SIGKILL while Orbax writes a checkpoint; `--resume`
  continues from the newest complete one, and ends where an uninterrupted run ends, bitwise."""
  run = ['--config.steps=4', '--config.checkpoint_every=1', '--config.eval_every=2']
  ref = _run([*run, f'--workdir={tmp_path}/ref'])
  assert ref.returncode == 0, ref.stderr[-2000:]

  workdir = tmp_path / 'killed'
  env = {**os.environ, 'PYTHONPATH': ROOT}
  env.pop('XLA_FLAGS', None)
  proc = subprocess.Popen(
    [sys.executable, '-m', 'experiments.train', '--config=smoke', *run, f'--workdir={workdir}'],
    cwd=ROOT,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  killed_in = None
  deadline = time.monotonic() + 300
  while proc.poll() is None and time.monotonic() < deadline:
    ckpts = workdir / 'checkpoints'
    names = os.listdir(ckpts) if ckpts.is_dir() else []
    tmp = [n for n in names if 'orbax-checkpoint-tmp' in n]
    if tmp and [n for n in names if n.isdigit()]:  # a later save, one checkpoint complete
      proc.kill()
      killed_in = tmp[0]
      break
  proc.wait()
  assert killed_in is not None, 'the run ended before a save could be interrupted'
  assert proc.returncode == -signal.SIGKILL

  resumed = _run([*run, f'--workdir={workdir}', '--resume'])
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  keep = ('step', 'win_rate', 'return_mean', 'loss/loss', 'eval/win_rate')

  def rows(d):
    return [{k: r.get(k) for k in keep} for r in metrics.read_jsonl(str(d / 'metrics.jsonl'))]

  assert rows(workdir) == rows(tmp_path / 'ref')
  assert _final_checksums(workdir) == _final_checksums(tmp_path / 'ref')
