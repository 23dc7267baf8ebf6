"""Run a function in N local JAX processes joined over loopback (gloo), and collect results.

  results = multiprocess.run('tests.dispatch.mp_bodies:two_process_dispatch',
                             num_processes=2, devices_per_process=4, kwargs={'rows': 16})

The target is `module:function`. Each process calls it with `kwargs` after
`jax.distributed.initialize`; its return value must be JSON-serialisable and comes back in
process order. Children share the persistent compilation cache of the parent when
JAX_COMPILATION_CACHE_DIR is set.
"""

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from earl_jax import distributed

_RESULT_PREFIX = 'EARL_RESULT_JSON='


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
    results = distributed.launch_local(
      [sys.executable, '-m', 'earl_jax.testing.multiprocess', target, args_path],
      num_processes=num_processes,
      devices_per_process=devices_per_process,
      env=child_env,
      timeout=timeout,
    )
  out = []
  for r in results:
    lines = [line for line in r.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if not lines:
      raise distributed.LaunchError(
        f'process {r.process_id} printed no result; stderr tail:\n'
        + '\n'.join(r.stderr.splitlines()[-20:])
      )
    out.append(json.loads(lines[-1][len(_RESULT_PREFIX) :]))
  return out


def _child_main(target: str, args_path: str) -> None:
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
  print(_RESULT_PREFIX + json.dumps(result), flush=True)
  jax.distributed.shutdown()


if __name__ == '__main__':
  _child_main(sys.argv[1], sys.argv[2])
