"""The main job: agentic RL with the EARL loop (selector + dispatcher): Connect Four, or code.

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

from earl_jax import config_cli, runtime
from experiments.configs import train as presets

_RUN = runtime.define_run_flags()
_CONFIG = config_cli.DEFINE_config('config', presets=presets.PRESETS, default='default')


def main(argv):
  del argv
  _RUN.start()
  from earl_jax.run import plotting
  from earl_jax.train import trainer

  config = _CONFIG.value
  workdir = _RUN.workdir_for(config.name)
  print(f'earl_jax: {config.name} -> {workdir}', flush=True)
  # Checks the workdir (and the checkpoint to resume) before anything compiles.
  t = trainer.Trainer(config, **_RUN.job_args(workdir))
  summary = t.run()  # SIGTERM or Ctrl-C: preemption.Stopped, saved (`runtime.run` exits)
  if t.is_main:
    paths = plotting.plot_training(os.path.join(workdir, 'metrics.jsonl'), workdir)
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      json.dump(summary, f, indent=2, default=str)
    evals = _evals(config, summary)
    moved = summary['moves']['experience_train']
    print(
      f'done: {summary["steps"]} steps in {summary["wall_s"]:.0f} s; {evals}; skipped steps: '
      f'{summary["skipped_steps"]}; stage layouts differed in {moved["layouts_differ"]} '
      f'of {moved["steps"]} experience -> train moves, bytes moved in '
      f'{moved["bytes_moved_steps"]}; plots: {", ".join(paths)}',
      flush=True,
    )


def _evals(config, summary: dict) -> str:
  """'eval win rate vs random: 0.31 -> 0.62', or a code task's pass rates, first and last."""
  first, last = summary['eval_first'], summary['eval_last']
  if first is None:
    return 'no evaluation'
  if 'pass_final_rate' in first:
    task = config.eval_env.task  # HumanEval has one set of tasks, the generated ones splits
    tasks = task if task == 'humaneval' else f'{config.eval_env.split} {task}'
    return (
      f'eval ({tasks}, greedy) first-turn pass rate '
      f'{first.get("pass_first_rate", float("nan")):.3f} -> '
      f'{last.get("pass_first_rate", float("nan")):.3f}, final pass rate '
      f'{first["pass_final_rate"]:.3f} -> {last["pass_final_rate"]:.3f}'
    )
  against = getattr(config.eval_env, 'opponent', None)
  return f'eval win rate vs {against}: {first["win_rate"]:.3f} -> {last["win_rate"]:.3f}'


if __name__ == '__main__':
  runtime.run(main, flags_parser=_CONFIG.flags_parser)
