"""Scripted agents through the `swe` environment: the gold patch must solve every instance and
doing nothing must solve none. Checks SWE-bench-style instances from elsewhere before training.

  python -m experiments.swe_agents --instances=runs/swe_tasks/instances.jsonl
  python -m experiments.swe_agents --instances=swe_gym.jsonl --format=swebench \
      --repos_dir=/data/repos --python=/data/venv/bin/python --valid_out=runs/swe_gym_valid.jsonl

Two agents play every instance through `SWEEnv` (plain commands), in batches of --batch:
  gold    `diff` + the instance's gold patch, then `submit`;
  no-op   `submit` at once.
An instance is valid when gold wins and no-op loses. Prints the solve rates, the invalid
instances with why, and the test runs' latency (the sandbox's seconds of each run, median and
p90); --valid_out gets the valid instances' JSONL lines, unchanged, to train on.
"""

import json
import os
import statistics
import time

import numpy as np
from absl import flags

from earl_jax import errors, runtime
from earl_jax.envs import base, swe_env
from earl_jax.sandbox import SandboxConfig
from earl_jax.swe import instances as instances_lib

_INSTANCES = flags.DEFINE_string('instances', 'runs/swe_tasks/instances.jsonl', 'The JSONL.')
_FORMAT = flags.DEFINE_enum('format', 'earl', instances_lib.FORMATS, "The JSONL's format.")
_REPOS = flags.DEFINE_string('repos_dir', '', "The repositories ('' = repos/ beside the JSONL).")
_PYTHON = flags.DEFINE_string('python', '', "The tests' interpreter ('' = a cached virtualenv).")
_BATCH = flags.DEFINE_integer('batch', 16, 'Episodes per environment step.', lower_bound=1)
_WORKERS = flags.DEFINE_integer('workers', 0, 'Test runs at once (0: the CPUs).', lower_bound=0)
_LIMIT = flags.DEFINE_integer(
  'limit', 0, 'Play only the first N instances (0: all).', lower_bound=0
)
_VALID_OUT = flags.DEFINE_string('valid_out', '', 'Where to write the valid instances (JSONL).')
_OUT = flags.DEFINE_string('out', '', 'Where to write the report (JSON).')


def main(argv):
  del argv
  try:
    tasks = instances_lib.load(
      _INSTANCES.value, format=_FORMAT.value, repos_dir=_REPOS.value or None
    )
  except (instances_lib.InstanceError, FileNotFoundError) as e:
    raise errors.UserError(str(e)) from None
  if _LIMIT.value:
    tasks = tasks[: _LIMIT.value]
  config = base.CodeEnvConfig(
    task='swe', swe_tasks=_INSTANCES.value, swe_format=_FORMAT.value, swe_repos=_REPOS.value,
    swe_python=_PYTHON.value, max_turns=2, max_reply_chars=1 << 20,
    sandbox=SandboxConfig(workers=_WORKERS.value),
  )  # fmt: skip
  started = time.perf_counter()
  _, invalid, played = swe_env.check(config, tasks, batch=_BATCH.value)
  seconds = time.perf_counter() - started
  report = {'instances': len(tasks), 'seconds': round(seconds, 1), 'agents': {}}
  run_seconds = []
  for agent, results in played.items():
    rewards = np.array([r['reward'] for r in results.values()])
    report['agents'][agent] = {'solved': float(rewards.mean()), 'count': int(rewards.sum())}
    run_seconds += [r['test_s'] / max(r['runs'], 1) for r in results.values()]
  report['run_seconds_median'] = statistics.median(run_seconds)
  report['run_seconds_p90'] = float(np.percentile(run_seconds, 90))
  report['invalid'] = invalid
  print(f'{len(tasks)} instances from {_INSTANCES.value} in {seconds:.0f} s')
  for agent, row in report['agents'].items():
    print(f'  {agent:<6} solves {row["count"]:>5} ({row["solved"]:.1%})')
  print(
    f'  test run: median {report["run_seconds_median"]:.2f} s, p90 '
    f"{report['run_seconds_p90']:.2f} s (the sandbox's time of each run)"
  )
  for instance_id, why in invalid:
    print(f'  invalid: {instance_id}: {why}')
  if _VALID_OUT.value:
    bad = {i for i, _ in invalid}
    with open(_INSTANCES.value) as f, open(_VALID_OUT.value, 'w') as out:
      for line in f:
        if line.strip() and json.loads(line)['instance_id'] not in bad:
          out.write(line)
    print(f'  wrote {len(tasks) - len(bad)} valid instances to {_VALID_OUT.value}')
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, 'w') as f:
      json.dump(report, f, indent=1)


if __name__ == '__main__':
  runtime.run(main)
