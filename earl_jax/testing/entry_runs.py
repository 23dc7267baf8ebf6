"""Many short runs of one entry point for the price of one import.

A test that feeds an entry point dozens of bad inputs, each refused before anything compiles,
spent most of its time importing JAX, Flax and Orbax again for every run. `run_many` starts one
zygote process that imports the entry point's libraries (never the entry module itself, whose
flags are defined when it is run), then forks one child per run. A child is what
`python -m module args` would be after its imports: its own argv, working directory, stdin from
/dev/null, stdout and stderr captured apart, the module run as `__main__`, its exit code returned.
No JAX backend is started before the fork (importing earl_jax starts none), so each child sets up
its devices as the entry point does.

  python -m earl_jax.testing.entry_runs SPEC_JSON OUT_DIR   # the zygote; `run_many` starts it
"""

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

# What the RL job and the warm start import before their `main` runs.
DEFAULT_PRELOAD = ('earl_jax.experiment', 'earl_jax.train.trainer', 'earl_jax.sft.job')


def run_many(
  module: str,
  runs: Sequence[Sequence[str]],
  *,
  cwd: str,
  env: Mapping[str, str],
  workers: int = 2,
  preload: Sequence[str] = DEFAULT_PRELOAD,
  timeout: float = 600,
) -> list[subprocess.CompletedProcess]:
  """`python -m module *args` for each `args` of `runs`, in `cwd` with `env`, `workers` at a
  time; one `CompletedProcess` (args, returncode, stdout, stderr) per run, in order."""
  with tempfile.TemporaryDirectory() as tmp:
    spec = {
      'module': module,
      'runs': [list(a) for a in runs],
      'cwd': cwd,
      'workers': workers,
      'preload': list(preload),
    }
    spec_path = os.path.join(tmp, 'spec.json')
    with open(spec_path, 'w') as f:
      json.dump(spec, f)
    zygote = subprocess.run(
      [sys.executable, '-m', 'earl_jax.testing.entry_runs', spec_path, tmp],
      env=dict(env),
      capture_output=True,
      text=True,
      timeout=timeout,
    )
    if zygote.returncode != 0:
      raise RuntimeError(f'the zygote failed ({zygote.returncode}):\n{zygote.stderr[-3000:]}')
    out = []
    for i, args in enumerate(runs):
      with open(os.path.join(tmp, f'{i}.json')) as f:
        code = json.load(f)['returncode']
      with open(os.path.join(tmp, f'{i}.out'), errors='replace') as f:
        stdout = f.read()
      with open(os.path.join(tmp, f'{i}.err'), errors='replace') as f:
        stderr = f.read()
      out.append(subprocess.CompletedProcess([module, *args], code, stdout, stderr))
  return out


def _child(module: str, args: list[str], cwd: str, out_prefix: str) -> None:
  """In a forked child: run `module` as `__main__` with `args`; never returns."""
  import importlib.util
  import runpy

  code = 1
  try:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, suffix in ((1, '.out'), (2, '.err')):
      target = os.open(out_prefix + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      os.dup2(target, fd)
      os.close(target)
    os.chdir(cwd)
    sys.argv = [importlib.util.find_spec(module).origin, *args]
    runpy.run_module(module, run_name='__main__', alter_sys=True)
    code = 0
  except SystemExit as e:  # as the interpreter ends: None is 0, another object is printed, 1
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
  except BaseException:  # an internal error: its traceback, as the interpreter would print it
    import traceback

    traceback.print_exc()
    code = 1
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _zygote(spec_path: str, out_dir: str) -> None:
  import importlib

  with open(spec_path) as f:
    spec = json.load(f)
  for name in spec['preload']:
    importlib.import_module(name)
  running: dict[int, int] = {}  # pid -> run index

  def reap_one() -> None:
    pid, status = os.wait()
    i = running.pop(pid)
    with open(os.path.join(out_dir, f'{i}.json'), 'w') as f:
      json.dump({'returncode': os.waitstatus_to_exitcode(status)}, f)

  for i, args in enumerate(spec['runs']):
    while len(running) >= spec['workers']:
      reap_one()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      _child(spec['module'], args, spec['cwd'], os.path.join(out_dir, str(i)))
    running[pid] = i
  while running:
    reap_one()


if __name__ == '__main__':
  _zygote(*sys.argv[1:3])
