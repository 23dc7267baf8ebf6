"""Greedy games of a trained board-game policy against each built-in opponent.

  python experiments/eval_board.py --checkpoint=runs/default        # random, greedy, minimax
  python experiments/eval_board.py --checkpoint=runs/default --opponents=greedy --episodes=1024
  python experiments/eval_board.py --checkpoint=runs/long --config=long

The policy is the checkpoint's latest parameters. The games are its run's evaluation
(`--config` and its overrides, as experiments/train.py takes them: the preset the run used) with
each opponent in turn ('greedy' takes a win, else blocks one, else plays at random; 'minimax'
searches `--config.eval_env.minimax_depth` plies), played greedily from fixed seeds on every
device. Prints a Markdown table (win, draw, loss, invalid and illegal rates, distinct moves and
turns a game) and writes it, with the records, to eval_board.json in the run folder (or --out).
See earl_jax/evaluation/board_eval.py.
"""

import json
import os

from absl import flags, logging

from earl_jax import config_cli, runtime
from experiments.configs import train as presets

_CHECKPOINT = flags.DEFINE_string(
  'checkpoint', None, 'A run folder of experiments/train.py (or its checkpoints folder).'
)
_OPPONENTS = flags.DEFINE_list('opponents', ['random', 'greedy', 'minimax'], 'Opponents.')
_EPISODES = flags.DEFINE_integer('episodes', 512, 'Games against each opponent.')
_SEED = flags.DEFINE_integer('seed', None, "The games' seed (default: the run's eval_seed).")
_OUT = flags.DEFINE_string('out', None, 'JSON output (default: <run>/eval_board.json).')
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', 8, 'Fake CPU devices when there is no GPU.', lower_bound=1
)
_CONFIG = config_cli.DEFINE_config('config', presets=presets.PRESETS, default='default')


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  runtime.setup(cpu_devices=_CPU_DEVICES.value)
  import jax

  from earl_jax.evaluation import board_eval, code_eval

  config = _CONFIG.value
  opponents = tuple(_OPPONENTS.value)
  board_eval.check(config, opponents=opponents, episodes=_EPISODES.value, shards=jax.device_count())
  if _CHECKPOINT.value is None:
    raise board_eval.BoardEvalError('--checkpoint: expected a run folder of experiments/train.py.')
  source = code_eval.PolicySource(
    checkpoint=_CHECKPOINT.value, model=config.model, tokenizer=config.tokenizer
  )
  mesh = code_eval.eval_mesh()
  policy = code_eval.load_policy(source, mesh)
  seed = config.eval_seed if _SEED.value is None else _SEED.value
  records = board_eval.play(
    config, policy, mesh, opponents=opponents, episodes=_EPISODES.value, seed=seed
  )
  text = board_eval.table(records)
  print(f'{policy.description}, {_EPISODES.value} greedy games each (seed {seed}):\n{text}')
  run = _CHECKPOINT.value.rstrip('/')
  if os.path.basename(run) == 'checkpoints':
    run = os.path.dirname(run)
  out = _OUT.value or os.path.join(run, 'eval_board.json')
  tmp = out + '.tmp'
  with open(tmp, 'w') as f:
    json.dump({'policy': policy.description, 'seed': seed, 'records': records, 'table': text}, f)
  os.replace(tmp, out)
  print(f'wrote {out}', flush=True)


if __name__ == '__main__':
  runtime.run(main, flags_parser=_CONFIG.flags_parser)
