"""Starts N local JAX processes of one command, joined over loopback with gloo collectives.

  python -m earl_jax.launch --num_processes=8 --devices_per_process=1 -- \
      python experiments/dispatch_latency.py --out=runs/dispatch.json

Process 0's output streams to this terminal; the others are collected and shown only if a
process fails. The command must call `earl_jax.distributed.initialize_from_env()` first.
"""

import argparse
import sys
from collections.abc import Sequence

from earl_jax import distributed


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m earl_jax.launch', description=__doc__)
  parser.add_argument('--num_processes', '-n', type=int, default=2)
  parser.add_argument('--devices_per_process', '-d', type=int, default=1)
  parser.add_argument('--timeout', type=float, default=3600.0)
  parser.add_argument('command', nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = list(args.command)
  if command and command[0] == '--':
    command = command[1:]
  if not command:
    parser.error('give the command to run after --')
  try:
    distributed.launch_local(
      command,
      num_processes=args.num_processes,
      devices_per_process=args.devices_per_process,
      timeout=args.timeout,
      stream_process=0,
    )
  except distributed.LaunchError as e:
    print(e, file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
