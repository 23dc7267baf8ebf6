"""The parameters' move between two stage layouts: XLA's direct move and the staged one (through
a fully sharded intermediate, `sharding.reshard._spread`), side by side for every ordered pair of
candidate layouts.

  python experiments/reshard_paths.py --out=/tmp/reshard_paths.json
  python experiments/reshard_paths.py --config=long --candidates=dp8,fsdp8 --repeats=101

For each pair: each path's median move time (and quartiles) over --repeats moves after
--warmup, its temporary and output bytes from XLA's memory analysis, whether XLA's partitioner
warned that it rebuilds whole leaves ('Involuntary full rematerialization', counted on file
descriptor 2 while compiling), and the path the `Resharder` takes. The model is the preset's
(the main job's by default), on 8 fake CPU devices.
"""

import json
import os
import statistics
import tempfile
import time

from absl import flags

from earl_jax import config_cli, runtime
from experiments.configs import train as presets

_CONFIG = config_cli.DEFINE_config('config', presets=presets.PRESETS, default='default')
_CANDIDATES = flags.DEFINE_list('candidates', ['dp8', 'dp4.tp2', 'dp2.tp4', 'fsdp8'], 'Layouts.')
_WARMUP = flags.DEFINE_integer('warmup', 5, 'Moves before timing.', lower_bound=0)
_REPEATS = flags.DEFINE_integer('repeats', 41, 'Timed moves per path.', lower_bound=3)
_OUT = flags.DEFINE_string('out', None, 'Write the results JSON here.')


def _compile_counting_warnings(fn, abstract, targets):
  """The compiled move and the rematerialization warnings XLA wrote while compiling it."""
  import jax

  with tempfile.TemporaryFile() as held:
    saved = os.dup(2)
    os.dup2(held.fileno(), 2)
    try:
      compiled = jax.jit(fn, out_shardings=targets).lower(abstract).compile()
    finally:
      os.dup2(saved, 2)
      os.close(saved)
    held.seek(0)
    warnings = held.read().decode(errors='replace').count('Involuntary full rematerialization')
  return compiled, warnings


def _timed(compiled, tree) -> dict:
  import jax

  for _ in range(_WARMUP.value):
    jax.block_until_ready(compiled(tree))
  ms = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(tree))
    ms.append(1e3 * (time.perf_counter() - t0))
  q1, _, q3 = statistics.quantiles(ms, n=4)
  memory = compiled.memory_analysis()
  return {
    'median_ms': statistics.median(ms),
    'q1_ms': q1,
    'q3_ms': q3,
    'temp_bytes': int(memory.temp_size_in_bytes),
    'output_bytes': int(memory.output_size_in_bytes),
  }


def _pair(executables, tree, dst) -> dict:
  """Both paths of moving `tree` (parameters) to `dst`'s parameter layout."""
  import jax

  from earl_jax.sharding import mesh as mesh_lib
  from earl_jax.sharding import reshard

  targets = executables.param_shardings(dst)
  abstract = mesh_lib.abstract_arrays(tree)
  leaves, treedef = jax.tree.flatten(abstract)
  stages = [reshard._spread(t, x.shape) for t, x in zip(treedef.flatten_up_to(targets), leaves)]

  def staged(t):
    moved = [
      x if m is None else jax.lax.with_sharding_constraint(x, m)
      for x, m in zip(jax.tree.leaves(t), stages)
    ]
    return jax.tree.unflatten(treedef, moved)

  out = {}
  for name, fn in (('direct', lambda t: t), ('staged', staged if any(stages) else None)):
    if fn is not None:
      compiled, warnings = _compile_counting_warnings(fn, abstract, targets)
      out[name] = {**_timed(compiled, tree), 'rematerialization_warnings': warnings}
  resharder = reshard.Resharder()
  resharder.prepare(tree, targets, donate=False)
  key, _ = resharder._key(tree, targets, False)
  taken = resharder._compiled.get(key).memory_analysis().temp_size_in_bytes
  out['resharder_takes'] = 'direct' if taken == out['direct']['temp_bytes'] else 'staged'
  return out


def main(argv):
  del argv
  runtime.setup(cpu_devices=8, cache_dir=tempfile.mkdtemp(prefix='reshard_paths_cache_'))
  import itertools

  from earl_jax.config import ParallelConfig
  from earl_jax.programs import Executables
  from earl_jax.train import assembly
  from earl_jax.train.placement import StagePlacement

  config = _CONFIG.value
  model, tok = assembly.load_model(config)
  executables = Executables(model, spec=assembly.stage_spec(config, tok, model))
  layouts = [ParallelConfig.parse(c) for c in _CANDIDATES.value]
  results = []
  for src, dst in itertools.permutations(layouts, 2):
    placement = StagePlacement.initialize(config, model, executables, src)
    row = {'src': src.name, 'dst': dst.name, **_pair(executables, placement.state.params, dst)}
    results.append(row)
    staged = row.get('staged')
    print(
      f'{src.name:>12} -> {dst.name:<12} direct {row["direct"]["median_ms"]:6.2f} ms '
      f'temp {row["direct"]["temp_bytes"]:>8,} B warn {row["direct"]["rematerialization_warnings"]:>2}'
      + (
        f' | staged {staged["median_ms"]:6.2f} ms temp {staged["temp_bytes"]:>8,} B '
        f'warn {staged["rematerialization_warnings"]}'
        if staged
        else ' | no staged path'
      )
      + f' | takes {row["resharder_takes"]}',
      flush=True,
    )
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump({'config': config.name, 'pairs': results}, f, indent=2)


if __name__ == '__main__':
  runtime.run(main, flags_parser=_CONFIG.flags_parser)
