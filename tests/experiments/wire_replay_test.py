"""The wire padding replay: the moves it reads from a run's metrics.jsonl."""

import json

import numpy as np
import pytest

from earl_jax.errors import UserError
from experiments import wire_replay


def _step(step, rollout, experience, bucket, longest):
  return {
    'step': step,
    'plan/rollout': f'{rollout}@{bucket}',
    'plan/experience': f'{experience}@{bucket}',
    'bucket': bucket,
    'ctx/turn_len_mean': 60.0,
    'ctx/turns_mean': 3.5,
    'ctx/episode_len_max': float(longest),
  }


def test_replayed_moves_follow_the_runs_layouts_buckets_and_context(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  rows = [
    {'step': 0, 'eval/win_rate': 0.0},  # an evaluation record: no move
    _step(1, 'dp4.tp2', 'dp2.tp4', 256, 240),
    _step(2, 'dp8.tp1', 'dp2.tp4', 512, 480),
  ]
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  moves = wire_replay.replayed_moves(str(path), 0, 16, seed=1)
  assert [(m['step'], m['src'], m['dst'], m['bucket']) for m in moves] == [
    (1, 'dp4.tp2', 'dp2.tp4', 256),
    (2, 'dp8.tp1', 'dp2.tp4', 512),
  ]
  for move, longest in zip(moves, (240, 480)):
    lengths = move['lengths']
    assert lengths.shape == (16,) and (lengths % 60 == 0).all()  # whole turns
    assert lengths.min() >= 60 and lengths.max() == longest <= move['bucket']
  again = wire_replay.replayed_moves(str(path), 1, 16, seed=1)
  assert len(again) == 1 and np.array_equal(again[0]['lengths'], moves[0]['lengths'])


def test_replayed_moves_refuse_a_file_without_train_steps(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text(json.dumps({'step': 0, 'eval/win_rate': 0.0}) + '\n')
  with pytest.raises(UserError, match='holds no train steps'):
    wire_replay.replayed_moves(str(path), 0, 16, seed=0)
  with pytest.raises(UserError, match='cannot be read'):
    wire_replay.replayed_moves(str(tmp_path / 'missing.jsonl'), 0, 16, seed=0)
