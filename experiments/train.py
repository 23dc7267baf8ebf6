"""The main job: agentic RL on Connect Four with the EARL loop (selector + dispatcher).

  python -m experiments.train                                  # the embedded default
  python experiments/train.py                                  # the same
  python experiments/train.py --config=long --workdir=runs/long
  python experiments/train.py --config.optim.learning_rate=1e-3 --config.steps=30
  python experiments/train.py --workdir=runs/default --resume  # continue the latest checkpoint
  python experiments/train.py --config=qwen --config.model_dir=/ckpt/Qwen2.5-0.5B-Instruct

Prints one line per step (win rate, return, context lengths, tokens/s, the plan of every stage,
stage times), writes metrics.jsonl + TensorBoard events and Orbax checkpoints under --workdir,
and finishes with PNG plots of the learning curve and the context lengths. SIGTERM or Ctrl-C
stops it at the end of the step, saved (exit code 143 or 130); a second Ctrl-C stops at once.
"""

import json
import os
import sys

from absl import flags, logging

from earl_jax import config_cli, distributed, runtime
from experiments.configs import train as presets

_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', 8, 'Fake CPU devices when there is no GPU.', lower_bound=1
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output folder (default: runs/<preset>).')
flags.register_validator(
  'workdir',
  lambda workdir: workdir is None or bool(workdir.strip()),
  message='--workdir is empty: expected a folder (or no --workdir, for runs/<config.name>).',
)
_RESUME = flags.DEFINE_bool('resume', False, 'Continue from the latest checkpoint in --workdir.')
_MOVE_ASIDE = flags.DEFINE_bool(
  'move_aside', False, 'Rename a --workdir that holds a run to <workdir>.<time>, then start afresh.'
)
_CONFIG = config_cli.DEFINE_config('config', presets=presets.PRESETS, default='default')


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # the step lines are printed; --verbosity=0 for more
  env = distributed.initialize_from_env()
  runtime.setup(cpu_devices=None if env else _CPU_DEVICES.value)
  from earl_jax import plotting, preemption, trainer  # after the runtime is set up

  config = _CONFIG.value
  workdir = _WORKDIR.value or os.path.join('runs', config.name)
  print(f'earl_jax: {config.name} -> {workdir}', flush=True)
  # Checks the workdir (and the checkpoint to resume) before anything compiles.
  t = trainer.Trainer(
    config,
    workdir=workdir,
    resume=_RESUME.value,
    log_fn=logging.info,
    move_aside=_MOVE_ASIDE.value,
  )
  if t.is_main:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      json.dump(config.to_json(), f, indent=2)
  try:
    summary = t.run()
  except preemption.Stopped as stopped:  # SIGTERM or Ctrl-C: the step is saved
    if t.is_main:
      print(stopped, flush=True)
    sys.exit(stopped.exit_code)
  if t.is_main:
    paths = plotting.plot_training(os.path.join(workdir, 'metrics.jsonl'), workdir)
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      json.dump(summary, f, indent=2, default=str)
    first, last = summary['eval_win_rate_first'], summary['eval_win_rate_last']
    evals = (
      f'eval win rate vs {config.eval_env.opponent}: {first:.3f} -> {last:.3f}'
      if first is not None
      else 'no evaluation'
    )
    moved = summary['moves']['experience_train']
    print(
      f'done: {summary["steps"]} steps in {summary["wall_s"]:.0f} s; {evals}; skipped steps: '
      f'{summary["skipped_steps"]}; stage layouts differed in {moved["layouts_differ"]} '
      f'of {moved["steps"]} experience -> train moves, bytes moved in '
      f'{moved["bytes_moved_steps"]}; plots: {", ".join(paths)}',
      flush=True,
    )


if __name__ == '__main__':
  runtime.run(main, flags_parser=_CONFIG.flags_parser)
