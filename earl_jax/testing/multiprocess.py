"""Run a function in N local JAX processes joined over loopback (gloo), and collect results.

  results = multiprocess.run('tests.dispatch.mp_bodies:two_process_dispatch',
                             num_processes=2, devices_per_process=4, kwargs={'rows': 16})

The target is `module:function`. Each process calls it with `kwargs` after
`jax.distributed.initialize`; its return value must be JSON-serialisable and comes back in
process order. Each child writes its result to a file of its own, not to stdout: gloo's C++
code prints to the same stdout from its own threads, and can land in the middle of a line.
Children share the persistent compilation cache of the parent when JAX_COMPILATION_CACHE_DIR is
set.
"""

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from earl_jax import distributed

_RESULT_FILE = 'result_{}.json'


def run(
  target: str,
  *,
  num_processes: int,
  devices_per_process: int,
  kwargs: Mapping[str, Any] | None = None,
  timeout: float = 300.0,
  env: Mapping[str, str] | None = None,
) -> list[Any]:
  """Calls `target(**kwargs)` in every process and returns the per-process results."""
  with tempfile.TemporaryDirectory() as tmp:
    args_path = os.path.join(tmp, 'kwargs.json')
    with open(args_path, 'w') as f:
      json.dump(dict(kwargs or {}), f)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env = {
      'PYTHONPATH': os.pathsep.join(p for p in (root, os.environ.get('PYTHONPATH')) if p)
    }
    child_env.update(env or {})
    procs = distributed.launch_local(
      [sys.executable, '-m', 'earl_jax.testing.multiprocess', target, args_path, tmp],
      num_processes=num_processes,
      devices_per_process=devices_per_process,
      env=child_env,
      timeout=timeout,
    )
    out = []
    for r in procs:
      path = os.path.join(tmp, _RESULT_FILE.format(r.process_id))
      if not os.path.exists(path):
        raise distributed.LaunchError(
          f'process {r.process_id} wrote no result; stderr tail:\n'
          + '\n'.join(r.stderr.splitlines()[-20:])
        )
      with open(path) as f:
        out.append(json.load(f))
  return out


def _child_main(target: str, args_path: str, result_dir: str) -> None:
  import importlib

  distributed.initialize_from_env()
  import jax

  if os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  module_name, fn_name = target.split(':')
  fn = getattr(importlib.import_module(module_name), fn_name)
  with open(args_path) as f:
    kwargs = json.load(f)
  result = fn(**kwargs)
  path = os.path.join(result_dir, _RESULT_FILE.format(jax.process_index()))
  with open(path + '.tmp', 'w') as f:
    json.dump(result, f)
  os.replace(path + '.tmp', path)
  jax.distributed.shutdown()


if __name__ == '__main__':
  _child_main(*sys.argv[1:4])
