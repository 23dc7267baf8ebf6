"""The run directory without compiling a program: who may write it, which checkpoint a resume
continues from (and on which profile), what a restore hands back, and --move_aside."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax import rundir
from earl_jax.config import ParallelConfig
from earl_jax.rl.losses import LossConfig
from earl_jax.selector.profile import Profile
from earl_jax.testing.configs import smoke_experiment

CONFIG = smoke_experiment(steps=4, checkpoint_every=1, eval_every=0)
STATE = {'w': jnp.arange(8, dtype=jnp.float32), 'step': jnp.zeros((), jnp.int32)}
PROFILE = Profile(
  key={'stages': ['rollout'], 'candidates': {}, 'buckets': [64], 'rows': [8]}, cells={}
)


def _open(workdir, config=CONFIG, resume=False, lines=None):
  log = (lines if lines is not None else []).append
  return rundir.RunDir.open(str(workdir), config, resume=resume, log=log)


def _saved_run(workdir, steps=(1, 2, 3), rows=4):
  """A run that saved `steps` and logged `rows` metrics rows (as if it died after them)."""
  run_dir, point = _open(workdir)
  assert point is None
  for step in steps:
    state = {**STATE, 'step': jnp.asarray(step, jnp.int32)}
    run_dir.save(
      step,
      state,
      selector_state={'stages': {}, 'refused': {}},
      train_config=ParallelConfig(dp=4, tp=2),
      prev_stats={'episode_lengths': [step], 'num_responses': 8},
      profile=PROFILE.to_json(),
    )
  run_dir.wait()
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for step in range(rows + 1):
      f.write(json.dumps({'step': step, 'win_rate': step / 10}) + '\n')
  return run_dir


def _abstract(config: ParallelConfig):
  assert config == ParallelConfig(dp=4, tp=2)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), STATE)


def test_a_used_or_unwritable_workdir_is_refused(tmp_path):
  run_dir, point = _open(tmp_path / 'fresh')
  # Nothing on disk until the first use of the checkpoints (a run refused before writes nothing).
  assert point is None and not os.path.exists(tmp_path / 'fresh')
  assert run_dir.checkpointer is not None and os.path.isdir(tmp_path / 'fresh' / 'checkpoints')
  assert not os.path.exists(tmp_path / 'fresh' / 'metrics.jsonl')
  # Without checkpoints nothing is opened on disk.
  quiet = dataclasses.replace(CONFIG, checkpoint_every=0)
  run_dir, _ = _open(tmp_path / 'quiet', quiet)
  assert run_dir.checkpointer is None and not os.path.exists(tmp_path / 'quiet')
  (tmp_path / 'used').mkdir()
  (tmp_path / 'used' / 'metrics.jsonl').write_text('{"step": 1}\n')
  with pytest.raises(rundir.WorkdirError, match=r'holds a run \(metrics.jsonl\)'):
    _open(tmp_path / 'used')
  (tmp_path / 'a_file').write_text('x')
  with pytest.raises(rundir.WorkdirError, match='is a file: expected a folder'):
    rundir.check_writable(str(tmp_path / 'a_file' / 'run'))
  # An empty metrics file or checkpoints folder is no run.
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'empty' / 'metrics.jsonl').write_text('')
  (tmp_path / 'empty' / 'checkpoints').mkdir()
  _open(tmp_path / 'empty')


def test_resume_needs_a_readable_checkpoint_of_the_same_config(tmp_path):
  with pytest.raises(rundir.ResumeError, match='no checkpoint in'):
    _open(tmp_path / 'nothing', resume=True)
  _saved_run(tmp_path / 'run')
  other = dataclasses.replace(CONFIG, loss=LossConfig(kl_coef=0.5))
  with pytest.raises(rundir.ResumeError, match=r'\(step 3\) was made by another config'):
    _open(tmp_path / 'run', other, resume=True)
  _, point = _open(tmp_path / 'run', resume=True)
  assert point.steps == (3, 2, 1)
  assert point.profile is not None and point.profile.key == PROFILE.key


def test_an_unreadable_newest_checkpoint_is_skipped_and_the_history_cut(tmp_path):
  _saved_run(tmp_path / 'run', rows=5)
  # The newest step's metadata is gone: the resume point is the step before.
  meta = tmp_path / 'run' / 'checkpoints' / '3' / 'meta'
  for name in os.listdir(meta):
    os.remove(meta / name)
  lines = []
  run_dir, point = _open(tmp_path / 'run', resume=True, lines=lines)
  assert point.steps == (2, 1)
  assert any('checkpoint step 3' in x and 'unreadable' in x and 'skipped' in x for x in lines)
  restored = run_dir.restore(point, _abstract)
  assert restored.step == 2 and int(restored.state['step']) == 2
  np.testing.assert_array_equal(restored.state['w'], np.arange(8))
  assert restored.train_config == ParallelConfig(dp=4, tp=2)
  assert restored.prev_stats == {'episode_lengths': [2], 'num_responses': 8}
  assert restored.selector_state == {'stages': {}, 'refused': {}}
  # What the run logged after its checkpoint is dropped; step 3 is kept aside to be saved again.
  assert [r['step'] for r in restored.rows] == [0, 1, 2]
  assert lines[-1].startswith('resumed from step 2')
  names = os.listdir(tmp_path / 'run' / 'checkpoints')
  assert '3' not in names and any(n.startswith('3.unreadable-') for n in names)


def test_move_aside_keeps_the_old_run_under_a_dated_name(tmp_path):
  assert rundir.move_aside(str(tmp_path / 'missing')) is None
  (tmp_path / 'empty').mkdir()
  assert rundir.move_aside(str(tmp_path / 'empty')) is None
  (tmp_path / 'run').mkdir()
  (tmp_path / 'run' / 'metrics.jsonl').write_text('{"step": 1}\n')
  aside = rundir.move_aside(str(tmp_path / 'run') + os.sep)
  assert aside is not None and os.path.basename(aside).startswith('run.')
  assert not os.path.exists(tmp_path / 'run')
  assert (tmp_path / os.path.basename(aside) / 'metrics.jsonl').read_text() == '{"step": 1}\n'
