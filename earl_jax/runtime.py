"""Process-wide settings, applied by entry points (experiments, notebooks), never on import.

def main(argv):
  runtime.setup(cpu_devices=8)     # before any other JAX call
  ...

if __name__ == '__main__':
  runtime.run(main)                # app.run, with user errors as one line and exit code 2

A job's entry point (experiments/train.py, experiments/sft.py) defines its run flags at once:

_RUN = runtime.define_run_flags()  # --cpu_devices, --workdir, --resume, --move_aside

def main(argv):
  _RUN.start()                     # quiet logs, jax.distributed from the environment, setup
  workdir = _RUN.workdir_for(config.name)
  job = Trainer(config, **_RUN.job_args(workdir))
"""

import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import logging

from earl_jax import errors

DEFAULT_CACHE_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '.jax_cache'
)


def setup(*, cpu_devices: int | None = None, cache_dir: str | None = None) -> None:
  """Persistent compilation cache, and `cpu_devices` fake devices when running on CPU.

  Must run before JAX initialises its backends. Multi-process entry points call
  `distributed.initialize_from_env()` first (it sets the device count itself).
  """
  import jax  # imported here, after the caller had a chance to set environment variables

  cache_dir = cache_dir or os.environ.get('JAX_COMPILATION_CACHE_DIR') or DEFAULT_CACHE_DIR
  jax.config.update('jax_compilation_cache_dir', cache_dir)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
  platforms = os.environ.get('JAX_PLATFORMS', '')
  wants_fake_devices = (
    cpu_devices
    and platforms in ('', 'cpu')
    and 'host_platform_device_count' not in os.environ.get('XLA_FLAGS', '')
    and (platforms == 'cpu' or not _has_accelerator())
  )
  if wants_fake_devices:
    jax.config.update('jax_num_cpu_devices', cpu_devices)
  logging.info('JAX %s, devices: %s', jax.__version__, jax.devices())


def _has_accelerator() -> bool:
  """Whether a GPU/TPU plugin is installed (without initialising any backend)."""
  import importlib.util

  return any(
    importlib.util.find_spec(name) is not None
    for name in ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'libtpu', 'jax_rocm60_plugin')
  )


@dataclasses.dataclass(frozen=True)
class RunFlags:
  """The flags every job's entry point takes (`define_run_flags`)."""

  cpu_devices: Any  # absl FlagHolders
  workdir: Any
  resume: Any
  move_aside: Any

  def start(self) -> None:
    """SIGTERM and Ctrl-C stop at once until the loop steps (`preemption.StopAtOnce`), absl's
    log at WARNING unless `--verbosity` is given (the job prints its step lines),
    `jax.distributed` from the launcher's environment, then `setup` (fake CPU devices only in a
    single process)."""
    from absl import flags

    from earl_jax import distributed
    from earl_jax.run import preemption

    preemption.StopAtOnce().install()
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)
    env = distributed.initialize_from_env()
    setup(cpu_devices=None if env else self.cpu_devices.value)

  def workdir_for(self, name: str) -> str:
    """--workdir, or runs/<name>."""
    return self.workdir.value or os.path.join('runs', name)

  def job_args(self, workdir: str) -> dict[str, Any]:
    """A job's `workdir`, `resume`, `move_aside` and `log_fn` (absl's info) from the flags."""
    return {
      'workdir': workdir,
      'resume': self.resume.value,
      'move_aside': self.move_aside.value,
      'log_fn': logging.info,
    }


def define_run_flags() -> RunFlags:
  """Defines --cpu_devices, --workdir, --resume and --move_aside (an entry point's, once)."""
  from absl import flags

  workdir = flags.DEFINE_string('workdir', None, 'Output folder (default: runs/<config.name>).')
  flags.register_validator(
    'workdir',
    lambda workdir: workdir is None or bool(workdir.strip()),
    message='--workdir is empty: expected a folder (or no --workdir, for runs/<config.name>).',
  )
  return RunFlags(
    cpu_devices=flags.DEFINE_integer(
      'cpu_devices', 8, 'Fake CPU devices when there is no GPU.', lower_bound=1
    ),
    workdir=workdir,
    resume=flags.DEFINE_bool('resume', False, 'Continue from the latest checkpoint in --workdir.'),
    move_aside=flags.DEFINE_bool(
      'move_aside',
      False,
      'Rename a --workdir that holds a run to <workdir>.<time>, then start afresh.',
    ),
  )


def run(main: Callable[[list[str]], Any], *, flags_parser: Callable | None = None) -> None:
  """`absl.app.run(main)`, with every user error ending the program in one line.

  A bad flag, an `app.UsageError`, or a `earl_jax.errors.UserError` raised while parsing or
  inside `main` (bad config values, presets, checkpoints, model directories, meshes), prints
  `error: <message>` to stderr and exits with code 2, absl's `UsageError` convention, instead of
  a traceback. A KeyboardInterrupt (Ctrl-C where nothing handles it, or the second one during
  training) prints one line and exits with 130 at once. `--debug` (or `--verbosity=1` and up)
  shows the traceback. A job stopped at a saved step (`preemption.Stopped`: SIGTERM, or the first
  Ctrl-C) prints its line on process 0 and exits with 128 + the signal. Other exceptions are
  internal errors and keep theirs.
  """
  from absl import app, flags

  if 'debug' not in flags.FLAGS:
    flags.DEFINE_bool('debug', False, 'Show the traceback of user errors too.')
  parse = flags_parser or flags.FLAGS

  def debugging(argv: Sequence[str] | None = None) -> bool:
    if argv is not None:  # the flags are not parsed yet
      return any(a in ('--debug', '--debug=true', '--debug=1') for a in argv) or any(
        a.startswith(('--verbosity=', '-v=')) and a.split('=', 1)[1] not in ('0', '-1')
        for a in argv
      )
    return bool(flags.FLAGS.debug) or flags.FLAGS.verbosity >= 1

  def parse_or_exit(argv: Sequence[str]) -> Any:
    try:
      return parse(argv)
    except (flags.Error, errors.UserError) as e:
      if debugging(argv):
        raise
      _exit_with(e)

  def main_or_exit(argv: list[str]) -> Any:
    from earl_jax.run import preemption

    try:
      return main(argv)
    except preemption.Stopped as stopped:  # SIGTERM or Ctrl-C: the step is saved
      import jax

      if jax.process_index() == 0:
        print(stopped, flush=True)
      sys.exit(stopped.exit_code)
    except (errors.UserError, app.UsageError) as e:
      if debugging():
        raise
      _exit_with(e)
    except KeyboardInterrupt:
      if debugging():
        raise
      # At once, as asked: os._exit leaves the background threads (a checkpoint being
      # written, whose temporary folder a resume never reads) instead of joining them.
      print(
        'interrupted: stopped at once; --resume continues from the last complete checkpoint',
        file=sys.stderr,
        flush=True,
      )
      sys.stdout.flush()
      os._exit(128 + signal.SIGINT)

  app.run(main_or_exit, flags_parser=parse_or_exit)


def _exit_with(error: Exception) -> NoReturn:
  message = ' '.join(str(error).split())  # one line
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(2)
