"""The main job on 1, 2, 4 and 8 processes, with the layout-aware dispatcher and the baselines.

  python experiments/loop_processes.py --out=runs/loop_processes.json
  python experiments/loop_processes.py --groups=4x2,8x1 --strategies=layout_aware,gather_scatter

For every process group (N processes x D fake CPU devices, N x D = 8, joined by
`jax.distributed` over loopback) and every dispatch strategy, runs `python -m experiments.train`
with the preset (--config, default 'default') for --steps steps, with the same seed, and reads
its metrics.jsonl: per-stage times (medians of the steps after --warmup), the bytes and time of
each stage move, and the learning metrics (which must not depend on the strategy). Runs go one
after the other; each prints a progress line.

All runs share the persistent compilation cache and the selector's profile cache, so whichever
run of a group went first would pay the compiles and the profiling for the others. With --prime
(the default) every (group, strategy) runs once unmeasured first, so that every measured run
finds the same warm caches: the figures are steady-state steps, not compile time.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from absl import app, flags

from earl_jax import distributed, runtime

_GROUPS = flags.DEFINE_list('groups', ['1x8', '2x4', '4x2', '8x1'], 'N x D process groups.')
_STRATEGIES = flags.DEFINE_list(
  'strategies', ['layout_aware', 'gather_scatter'], 'Dispatch strategies of the stage moves.'
)
_CONFIG = flags.DEFINE_string('config', 'default', 'Preset of experiments/configs/train.py.')
_STEPS = flags.DEFINE_integer('steps', 8, 'Train steps per run.')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Steps of each run left out of the medians.')
_WORKDIR = flags.DEFINE_string('workdir', '/tmp/earl_loop_processes', 'Runs write here.')
_OUT = flags.DEFINE_string('out', 'runs/loop_processes.json', 'Results JSON.')
_TIMEOUT = flags.DEFINE_float('timeout', 1800.0, 'Seconds per run.')
_PRIME = flags.DEFINE_bool(
  'prime', True, 'Run every (group, strategy) once unmeasured first, to warm the shared caches.'
)
_SUMMARIZE = flags.DEFINE_bool(
  'summarize_only', False, 'Read the runs already in --workdir instead of running them.'
)

STAGES = ('rollout', 'put', 'experience', 'dispatch', 'pack', 'advantages', 'train', 'profile')
MOVES = ('rollout_experience', 'experience_train')


def _group(text: str) -> tuple[int, int]:
  try:
    n, d = (int(x) for x in text.lower().split('x'))
  except ValueError:
    raise app.UsageError(f'--groups entry {text!r}: expected NxD, e.g. 4x2.') from None
  if n < 1 or d < 1:
    raise app.UsageError(f'--groups entry {text!r}: N and D must be positive.')
  return n, d


def _run(n: int, d: int, strategy: str, workdir: str) -> float:
  argv = [
    sys.executable,
    '-m',
    'experiments.train',
    f'--config={_CONFIG.value}',
    f'--config.steps={_STEPS.value}',
    '--config.eval_every=0',
    '--config.checkpoint_every=0',
    f'--config.dispatch.strategy={strategy}',
    f'--workdir={workdir}',
  ]
  t0 = time.perf_counter()
  if n == 1:
    subprocess.run(
      [*argv, f'--cpu_devices={d}'], check=True, capture_output=True, timeout=_TIMEOUT.value
    )
  else:
    distributed.launch_local(argv, num_processes=n, devices_per_process=d, timeout=_TIMEOUT.value)
  return time.perf_counter() - t0


def _summary(workdir: str, wall_s: float) -> dict:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  rows = [r for r in rows if 'plan/train' in r]
  measured = rows[_WARMUP.value :]

  def med(key):
    values = [r[key] for r in measured if key in r]
    return statistics.median(values) if values else 0.0

  work = [r['time/step_s'] - r.get('time/profile_s', 0.0) for r in measured]
  return {
    'wall_s': wall_s,
    # A step's time without the profiling of a bucket reached for the first time ('profile' is
    # the run's total profiling time: zero when the cache was warm).
    'stage_s': {
      **{s: med(f'time/{s}_s') for s in STAGES if s != 'profile'},
      'profile': sum(r.get('time/profile_s', 0.0) for r in rows),
      'step': statistics.median(work) if work else 0.0,
    },
    'moves': {
      m: {'bytes': med(f'dispatch/{m}/bytes'), 'ms': med(f'dispatch/{m}/ms')} for m in MOVES
    },
    'strategy': sorted({r.get('dispatch/experience_train/strategy', '?') for r in rows}),
    'win_rate': [r['win_rate'] for r in rows],
    'return_mean': [r['return_mean'] for r in rows],
    'loss': [r['loss/loss'] for r in rows],
    'plans': [[r[f'plan/{s}'] for s in ('rollout', 'experience', 'train')] for r in rows],
  }


def main(argv):
  del argv
  if _STEPS.value <= _WARMUP.value:
    raise app.UsageError(f'--steps={_STEPS.value} must exceed --warmup={_WARMUP.value}.')
  groups = [_group(g) for g in _GROUPS.value]
  results = {}
  for n, d in groups:
    if _PRIME.value and not _SUMMARIZE.value:
      for strategy in _STRATEGIES.value:
        print(f'priming {n}x{d}/{strategy} ...', flush=True)
        prime_dir = os.path.join(_WORKDIR.value, f'{n}x{d}_{strategy}_prime')
        shutil.rmtree(prime_dir, ignore_errors=True)
        _run(n, d, strategy, prime_dir)
    for strategy in _STRATEGIES.value:
      name = f'{n}x{d}/{strategy}'
      workdir = os.path.join(_WORKDIR.value, f'{n}x{d}_{strategy}')
      if _SUMMARIZE.value:
        results[name] = _summary(workdir, float('nan'))
        continue
      shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, not appended to an old one
      print(f'running {name} ...', flush=True)
      wall = _run(n, d, strategy, workdir)
      results[name] = _summary(workdir, wall)
      s = results[name]['stage_s']
      print(
        f'  {name}: {wall:.0f} s, step {s["step"]:.2f} s, dispatch {s["dispatch"] * 1e3:.0f} ms',
        flush=True,
      )
  print(
    f'\n{_CONFIG.value}, {_STEPS.value} steps, medians of steps {_WARMUP.value + 1}-; step '
    f'excludes profiling; profile = total profiling s; caches primed: {_PRIME.value}'
  )
  head = ' '.join(f'{s:>10}' for s in (*STAGES, 'step'))
  print(f'{"run":>22} {head} {"r>e MB":>8} {"r>e ms":>7} {"e>t MB":>8} {"e>t ms":>7}')
  for name, r in results.items():
    cols = ' '.join(f'{r["stage_s"][s]:>10.3f}' for s in (*STAGES, 'step'))
    mv = r['moves']
    print(
      f'{name:>22} {cols} {mv["rollout_experience"]["bytes"] / 1e6:>8.2f} '
      f'{mv["rollout_experience"]["ms"]:>7.1f} {mv["experience_train"]["bytes"] / 1e6:>8.2f} '
      f'{mv["experience_train"]["ms"]:>7.1f}'
    )
  same = {json.dumps((r['win_rate'], r['return_mean'])) for r in results.values()}
  print(f'\nlearning curves (win rate, return) identical across runs: {len(same) == 1}')
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(
      {'config': _CONFIG.value, 'steps': _STEPS.value, 'primed': _PRIME.value, 'runs': results},
      f,
      indent=2,
    )


if __name__ == '__main__':
  runtime.run(main)
