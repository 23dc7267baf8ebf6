"""Sequence packing and token balancing in the main job: what each does to the stage times.

  python experiments/packing_balance.py --out=runs/packing_balance.json          # default preset
  python experiments/packing_balance.py --config=long --steps=20 --out=/tmp/p.json

Runs the same preset and seed three ways, one after the other in this process, for --steps steps
each: unpacked (one episode per row, padded to the bucket), packed without balancing, and packed
with the rows balanced by real tokens across the ranks that pack them. The first --warmup steps
of each run (compiles, profiling) are left out; the table gives the median per-step experience
and train time of the rest, the packed rows and their fill, and the learning metrics, so that a
speed-up that changed the learning would show.
"""

import dataclasses
import json
import os
import shutil
import statistics
import time

from absl import app, flags, logging

from earl_jax import config_cli, runtime
from experiments.configs import train as presets

_STEPS = flags.DEFINE_integer('steps', 16, 'Train steps per run.')
_WARMUP = flags.DEFINE_integer('warmup', 4, 'Steps of each run left out of the medians.')
_OUT = flags.DEFINE_string('out', 'runs/packing_balance.json', 'Results JSON.')
_WORKDIR = flags.DEFINE_string('workdir', '/tmp/earl_packing_balance', 'Runs write here.')
_CONFIG = config_cli.DEFINE_config('config', presets=presets.PRESETS, default='default')

VARIANTS = {
  'unpacked': {'pack': False, 'balance': False},
  'packed': {'pack': True, 'balance': False},
  'packed+balanced': {'pack': True, 'balance': True},
}


def _median(rows, key):
  values = [r[key] for r in rows if key in r]
  return statistics.median(values) if values else None


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  runtime.setup(cpu_devices=8)
  from earl_jax.run import metrics
  from earl_jax.train import trainer

  if _STEPS.value <= _WARMUP.value:
    raise app.UsageError(f'--steps={_STEPS.value} must exceed --warmup={_WARMUP.value}.')
  base = dataclasses.replace(_CONFIG.value, steps=_STEPS.value, eval_every=0, checkpoint_every=0)
  results = {}
  for name, changes in VARIANTS.items():
    config = dataclasses.replace(base, **changes)
    workdir = os.path.join(_WORKDIR.value, name)
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run each time
    t0 = time.perf_counter()
    t = trainer.Trainer(config, workdir=workdir, log_fn=lambda _: None)
    t.run(progress=False)
    records = metrics.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
    rows = [r for r in records if 'plan/train' in r][_WARMUP.value :]
    results[name] = {
      'wall_s': time.perf_counter() - t0,
      'steps_measured': len(rows),
      'train_s': _median(rows, 'time/train_s'),
      'experience_s': _median(rows, 'time/experience_s'),
      'pack_s': _median(rows, 'time/pack_s'),
      'step_s': _median(rows, 'time/step_s'),
      'rows': _median(rows, 'pack/rows') or config.rollout.num_episodes,
      'fill': _median(rows, 'pack/fill'),
      'bucket': _median(rows, 'bucket'),
      'win_rate_last': rows[-1]['win_rate'],
      'loss_last': rows[-1]['loss/loss'],
      'episode_len_mean': _median(rows, 'ctx/episode_len_mean'),
    }
    print(f'{name}: {json.dumps(results[name])}', flush=True)
  base_t = results['unpacked']['train_s'] + results['unpacked']['experience_s']
  print(
    f'\n{config.name}, {_STEPS.value} steps, medians of steps {_WARMUP.value + 1}-{_STEPS.value}'
  )
  print(
    f'{"run":>16} {"rows":>5} {"fill":>5} {"experience s":>12} {"train s":>8} {"pack s":>7} '
    f'{"exp+train vs unpacked":>22}'
  )
  for name, r in results.items():
    total = r['train_s'] + r['experience_s']
    fill = '-' if r['fill'] is None else f'{r["fill"]:.2f}'
    pack = '-' if r['pack_s'] is None else f'{r["pack_s"]:.3f}'
    print(
      f'{name:>16} {r["rows"]:>5.0f} {fill:>5} {r["experience_s"]:>12.3f} {r["train_s"]:>8.3f} '
      f'{pack:>7} {base_t / total:>21.2f}x'
    )
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump({'config': base.name, 'steps': _STEPS.value, 'runs': results}, f, indent=2)


if __name__ == '__main__':
  runtime.run(main, flags_parser=_CONFIG.flags_parser)
