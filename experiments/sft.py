"""The supervised warm start of code RL: next-token training on the code tasks' reference
solutions (prompt tokens masked), on the train layout the selector picks.

  python experiments/sft.py --config=code                      # runs/code_sft
  python experiments/sft.py --config=code --config.steps=300 --workdir=runs/sft
  python experiments/sft.py --config=code --workdir=runs/sft --resume
  python experiments/sft.py --config=code --workdir=runs/sft --move_aside   # keep the old one
  python experiments/train.py ... --config.init_from=runs/code_sft/checkpoints   # RL from it

Prints the layout, then one line per `log_every` steps (train loss, the latest held-out loss and
pass rate, tokens/s, seconds) above a progress bar; writes metrics.jsonl + TensorBoard events,
Orbax checkpoints (the RL job's TrainState) and summary.json under --workdir. As the RL job:
one run per workdir (a lock), and SIGTERM or Ctrl-C stops it at the end of the step, saved (exit
code 143 or 130); a second Ctrl-C stops at once.
"""

import json
import os

from earl_jax import config_cli, runtime
from experiments.configs import sft as presets

_RUN = runtime.define_run_flags()
_CONFIG = config_cli.DEFINE_config('config', presets=presets.PRESETS, default='code')


def main(argv):
  del argv
  _RUN.start()
  from earl_jax.sft.job import SFTRun  # after the runtime is set up

  config = _CONFIG.value
  workdir = _RUN.workdir_for(config.name)
  # Checks the model, the examples, the workdir (and the checkpoint to resume) before compiling.
  run = SFTRun(config, **_RUN.job_args(workdir))
  if run.is_main:
    print(
      f'earl_jax sft: {config.name} -> {workdir}; {len(run.train_set)} train and '
      f'{len(run.heldout_set)} held-out examples; train layout {run.decision.config.name} '
      f'({run.decision.reason})',
      flush=True,
    )
  summary = run.run()  # SIGTERM or Ctrl-C: preemption.Stopped, saved (`runtime.run` exits)
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
