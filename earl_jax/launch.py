"""Starts N local JAX processes of one command, joined over loopback with gloo collectives.

  python -m earl_jax.launch --num_processes=8 --devices_per_process=1 -- \
      python experiments/dispatch_latency.py --out=runs/dispatch.json

The launcher owns its processes (`earl_jax.distributed.launch_local`): process 0's output
streams to this terminal (the others' is kept, and shown when one fails); SIGTERM, SIGINT and
SIGHUP to the launcher are passed on to every process (a second one kills them); when one process
dies the others are stopped within seconds, and the launcher names it, says how it ended and
shows the tail of its stderr. Exit codes: 0, 1 (a process failed or the timeout struck), 2 (a bad
argument, or the user error the processes reported, printed once), 128 + N (stopped by signal
N). The command must call `earl_jax.distributed.initialize_from_env()` first.
"""

import argparse
import math
import os
import shutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from earl_jax import distributed


class _Parser(argparse.ArgumentParser):
  def error(self, message: str) -> NoReturn:
    _exit_with(f'{message} (see {self.prog} --help)')


def _exit_with(message: str) -> NoReturn:
  print(f'error: {" ".join(message.split())}', file=sys.stderr, flush=True)
  sys.exit(2)


def _check_args(args: argparse.Namespace, command: list[str]) -> None:
  """Exits with a one-line error on an argument that cannot run."""
  for flag, value in (
    ('--num_processes/-n', args.num_processes),
    ('--devices_per_process/-d', args.devices_per_process),
  ):
    if value < 1:
      _exit_with(f'{flag}={value}: expected an int >= 1.')
  if not args.timeout > 0:  # NaN too
    _exit_with(f'--timeout={args.timeout}: expected seconds > 0 (inf: no limit).')
  if not command:
    _exit_with('no command: give the command to run after --, e.g. -- python -m experiments.train')
  program = command[0]
  if shutil.which(program) is None:
    where = 'is not an executable file' if os.sep in program else 'is not a program on PATH'
    _exit_with(f'the command {program!r} {where}: expected e.g. -- python -m experiments.train')


def main(argv: Sequence[str] | None = None) -> int:
  parser = _Parser(
    prog='python -m earl_jax.launch',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--num_processes', '-n', type=int, default=2)
  parser.add_argument('--devices_per_process', '-d', type=int, default=1)
  parser.add_argument('--timeout', type=float, default=3600.0, help='seconds (inf: no limit)')
  parser.add_argument('command', nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = list(args.command)
  if command and command[0] == '--':
    command = command[1:]
  _check_args(args, command)
  try:
    distributed.launch_local(
      command,
      num_processes=args.num_processes,
      devices_per_process=args.devices_per_process,
      timeout=None if math.isinf(args.timeout) else args.timeout,
      stream_process=0,
      forward_signals=True,
    )
  except distributed.LaunchError as e:
    message = str(e)
    if e.exit_code == 2 and message and not message.startswith('error: '):
      message = f'error: {message}'
    if message:  # empty: the processes' user error is on the terminal already
      print(message, file=sys.stderr, flush=True)
    return e.exit_code
  return 0


if __name__ == '__main__':
  sys.exit(main())
