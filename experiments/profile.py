"""Writes the profile of a preset's model and mesh once: every bucket, load and candidate layout
of its profiled stages, compiled and timed (the paper's offline table).

  python -m experiments.profile                                 # the default -> its cache file
  python -m experiments.profile --config=think --out=/tmp/think_profile.json --rounds=3
  python -m experiments.selector_regret --run=runs/think --profile=/tmp/think_profile.json
  python -m experiments.train --config=think --config.selector.profile.cache=/tmp/think_profile.json

A run started from the table (`--config.selector.profile.cache=<file>`, or the preset's own cache
path, the default `--out`) decides on its measurements from the first step and measures nothing
it holds. The file is keyed by what its figures depend on: device kind and count, software,
model, candidates, bucket table, load, budget and program shapes
(`profiling.profiler.profile_key`). It can be copied to another machine of the same kind; a run whose setup differs
refuses it in one line naming the differing fields, and measures its own. How carefully it was
timed (`--repeats`, `--rounds`, `--min_seconds`, by default the preset's) is not part of the
key: a table timed more carefully offline serves runs that would time less.
"""

import dataclasses
import os
import time

from absl import flags

from earl_jax import config_cli, distributed, errors, runtime
from experiments.configs import train as presets

_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', 8, 'Fake CPU devices when there is no GPU.', lower_bound=1
)
_OUT = flags.DEFINE_string(
  'out', None, "The table's JSON (default: the preset's selector.profile.cache)."
)
_REPEATS = flags.DEFINE_integer('repeats', None, 'Timed calls per visit (default: the preset).')
_ROUNDS = flags.DEFINE_integer('rounds', None, 'Visits per layout and cell (default: the preset).')
_MIN_SECONDS = flags.DEFINE_float(
  'min_seconds', None, 'Time a visit for at least this long (default: the preset).'
)
_CONFIG = config_cli.DEFINE_config('config', presets=presets.PRESETS, default='default')


def _measure(config):
  """The preset's measurement settings, with the flags' overrides."""
  overrides = {
    name: flag.value
    for name, flag in (('repeats', _REPEATS), ('rounds', _ROUNDS), ('min_seconds', _MIN_SECONDS))
    if flag.value is not None
  }
  try:
    return dataclasses.replace(config.selector.profile.measure, **overrides)
  except errors.UserError as e:  # named as the flag that set it
    e.args = (' '.join(f'--{k}={v}' for k, v in overrides.items()) + f': {e}',)
    raise


def main(argv):
  del argv
  env = distributed.initialize_from_env()
  runtime.setup(cpu_devices=None if env else _CPU_DEVICES.value)
  import jax

  from earl_jax.errors import UserError
  from earl_jax.profiling import profiler
  from earl_jax.programs import Executables
  from earl_jax.train import assembly

  config = _CONFIG.value
  settings = config.selector.profile
  if not settings.stages:
    raise UserError(
      f'--config={config.name} profiles no stage (selector.profile.stages is empty): nothing to '
      'write; set --config.selector.profile.stages=rollout,experience,train.'
    )
  out = _OUT.value or settings.cache
  if not out:
    raise UserError('No --out and no selector.profile.cache in the preset: where to write?')
  model, tok = assembly.load_model(config)
  spec = assembly.stage_spec(config, tok, model)
  with Executables(model, spec=spec) as exe:
    measurer = profiler.Profiler.for_selector(
      config.selector,
      model=model,
      buckets=config.buckets,
      rows=assembly.load_rows(config),
      spec=spec,
      executables=exe,
      stage_rows=assembly.rollout_rows(config),
    )
    grid = dataclasses.replace(measurer.config, measure=_measure(config))
    t0 = time.perf_counter()
    profile = profiler.run(model, grid, executables=exe, cache_path=out, progress=_progress)
    seconds = time.perf_counter() - t0
  if jax.process_index() == 0:
    _report(profile, out, seconds)


def _progress(cell) -> None:
  import jax

  if jax.process_index() == 0:
    what = 'OOM' if cell.oom else f'{cell.throughput:10.1f} tok/s/dev'
    print(
      f'{cell.stage:>10} {cell.bucket:>6} x {cell.rows:<4} {cell.config:>14} {what}', flush=True
    )


def _report(profile, out: str, seconds: float) -> None:
  """The fastest layout of every stage and bucket, the calls' spread, and where the table went."""
  from earl_jax.profiling import table

  print(f'\n{len(profile.cells)} cells in {seconds:.0f} s -> {os.path.abspath(out)}')
  print(table.report(profile))
  print(f'run from it: --config.selector.profile.cache={out}')


if __name__ == '__main__':
  runtime.run(main, flags_parser=_CONFIG.flags_parser)
