"""The supervised warm start of code RL: next-token training on the code tasks' reference
solutions (prompt tokens masked), on the train layout the selector picks.

  python experiments/sft.py --config=code                      # runs/code_sft
  python experiments/sft.py --config=code --config.steps=300 --workdir=runs/sft
  python experiments/sft.py --config=code --workdir=runs/sft --resume
  python experiments/train.py ... --config.init_from=runs/code_sft/checkpoints   # RL from it

Prints the layout, then one line per `log_every` steps (train loss, the latest held-out loss and
pass rate, tokens/s, seconds) above a progress bar; writes metrics.jsonl + TensorBoard events,
Orbax checkpoints (the RL job's TrainState) and summary.json under --workdir.
"""

import json
import os

from absl import flags, logging

from earl_jax import config_cli, distributed, runtime
from experiments.configs import sft as presets

_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', 8, 'Fake CPU devices when there is no GPU.', lower_bound=1
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output folder (default: runs/<config.name>).')
flags.register_validator(
  'workdir',
  lambda workdir: workdir is None or bool(workdir.strip()),
  message='--workdir is empty: expected a folder (or no --workdir, for runs/<config.name>).',
)
_RESUME = flags.DEFINE_bool('resume', False, 'Continue from the latest checkpoint in --workdir.')
_CONFIG = config_cli.DEFINE_config('config', presets=presets.PRESETS, default='code')


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # the step lines are printed; --verbosity=0 for more
  env = distributed.initialize_from_env()
  runtime.setup(cpu_devices=None if env else _CPU_DEVICES.value)
  from earl_jax import sft  # after the runtime is set up

  config = _CONFIG.value
  workdir = _WORKDIR.value or os.path.join('runs', config.name)
  # Checks the model, the examples, the workdir (and the checkpoint to resume) before compiling.
  run = sft.SFTRun(config, workdir=workdir, resume=_RESUME.value, log_fn=logging.info)
  if run.is_main:
    print(
      f'earl_jax sft: {config.name} -> {workdir}; {len(run.train_set)} train and '
      f'{len(run.heldout_set)} held-out examples; train layout {run.decision.config.name} '
      f'({run.decision.reason})',
      flush=True,
    )
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      json.dump(config.to_json(), f, indent=2)
  summary = run.run()
  if run.is_main:
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      json.dump(summary, f, indent=2)
    passes = (
      f'; greedy pass rate {summary["pass_rate_first"]:.3f} -> {summary["pass_rate_last"]:.3f}'
      if summary['pass_rate_first'] is not None
      else ''
    )
    first, last = summary['heldout_loss_first'], summary['heldout_loss_last']
    losses = f'; held-out loss {first:.3f} -> {last:.3f}' if first is not None else ''
    print(
      f'done: {summary["steps"]} steps in {summary["wall_s"]:.0f} s{losses}{passes}; '
      f'{summary["tokens_per_s"]:,.0f} tok/s (median); checkpoints: {summary["checkpoints"]}',
      flush=True,
    )


if __name__ == '__main__':
  runtime.run(main, flags_parser=_CONFIG.flags_parser)
