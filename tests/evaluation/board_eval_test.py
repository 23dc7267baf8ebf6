"""A board-game policy's games against each opponent: the run's own evaluation replayed from its
checkpoint, the other opponents, and bad input."""

import os
import subprocess
import sys

import numpy as np
import pytest

from earl_jax.config import ParallelConfig
from earl_jax.evaluation import board_eval, code_eval
from earl_jax.evaluation.code_eval import PolicySource
from earl_jax.models import tokenizer as tokenizer_lib
from earl_jax.run import metrics
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.testing.configs import smoke_experiment
from earl_jax.train import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_checkpoint_replays_its_runs_evaluation_and_plays_every_opponent(tmp_path):
  """The smoke run's last evaluation (step 3, greedy, fixed seeds) played again from the step-3
  checkpoint on the same layout gives the same games; the other opponents give complete records."""
  config = smoke_experiment()
  trainer.Trainer(config, workdir=str(tmp_path), log_fn=lambda _: None).run(progress=False)
  last = metrics.read_jsonl(os.path.join(tmp_path, 'metrics.jsonl'))[-1]
  assert last['step'] == 3 and 'eval/win_rate' in last
  layout = ParallelConfig.parse(last['plan/rollout'].split('@')[0])
  mesh = mesh_lib.make_mesh(layout)
  policy = code_eval.load_policy(
    PolicySource(checkpoint=str(tmp_path), model=config.model, tokenizer=config.tokenizer), mesh
  )
  episodes = config.eval_episodes
  again = board_eval.play(
    config, policy, mesh, opponents=('random',), episodes=episodes, seed=config.eval_seed
  )['random']
  for key in ('win_rate', 'invalid_rate', 'draw_rate', 'return_mean', 'distinct_moves_mean'):
    assert again[f'eval/{key}'] == pytest.approx(last[f'eval/{key}']), key
  others = board_eval.play(
    config, policy, mesh, opponents=('greedy', 'minimax'), episodes=16, seed=5
  )
  assert list(others) == ['greedy', 'minimax']
  for r in others.values():
    assert r['games'] == 16
    outcomes = (
      r['eval/win_rate'] + r['eval/draw_rate'] + r['eval/loss_rate'] + r['eval/invalid_rate']
    )
    assert outcomes == pytest.approx(1.0)
    assert 0 <= r['eval/illegal_rate'] <= r['eval/invalid_rate']
    assert 0 <= r['eval/distinct_moves_mean'] <= r['eval/turns_mean'] <= 5
  text = board_eval.table({'random': again})
  assert text.splitlines()[2].startswith(f'| random | {episodes} | {again["eval/win_rate"]:.3f} |')


def test_bad_settings_are_refused_in_one_line():
  config = smoke_experiment()
  with pytest.raises(board_eval.BoardEvalError, match=r"opponents='random,perfect': expected"):
    board_eval.check(config, opponents=('random', 'perfect'), episodes=8, shards=8)
  with pytest.raises(board_eval.BoardEvalError, match='episodes=12: expected a positive multiple'):
    board_eval.check(config, opponents=('random',), episodes=12, shards=8)
  from experiments.configs import train as presets

  with pytest.raises(board_eval.BoardEvalError, match="config='code' evaluates on CodeEnvConfig"):
    board_eval.check(presets.code(), opponents=('random',), episodes=8, shards=8)


def test_the_app_says_a_bad_flag_in_one_line(tmp_path):
  out = subprocess.run(
    [sys.executable, 'experiments/eval_board.py', f'--checkpoint={tmp_path}', '--episodes=7'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode != 0
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert lines[-1].startswith('error: episodes=7: expected a positive multiple of the 8'), (
    out.stderr
  )
  assert 'Traceback' not in out.stderr


def test_full_column_rows_label_each_reply_with_the_full_columns_of_the_board_before_it():
  """Read back from the rows: at every agent reply, bit c is set exactly where the top row of
  the board text just before it has a stone in column c + 1, and every game meets one."""
  tokenizer = tokenizer_lib.load_tokenizer('game')
  tokens, full = board_eval.full_column_rows(6, seed=3, bucket=2048, stack=0.7)
  digits = [tokenizer.encode(str(c + 1))[0] for c in range(7)]
  act = tokenizer.turn_prompt_ids('', first=False)[-1]  # the token before every reply
  for row, labels in zip(tokens, full):
    replies = np.flatnonzero(np.isin(row, digits) & (np.roll(row, 1) == act))
    assert replies.size and (labels > 0).any()
    assert set(np.flatnonzero(labels)) <= set(replies)
    for at in replies:
      board = tokenizer.decode(row[:at].tolist()).rsplit('1234567\n', 1)[1]
      top = board.split('\n')[0]
      assert len(top) == 7
      want = sum(1 << c for c, cell in enumerate(top) if cell != '.')
      assert labels[at] == want, (at, top, labels[at])
