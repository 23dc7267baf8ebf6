"""The run directory without compiling a program: who may write it (its lock: one run per
workdir), which checkpoint a resume continues from (and on which profile, refused under which
changes), what a restore hands back (with a damaged metrics history), and --move_aside."""

import dataclasses
import json
import os
import socket
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.config import ParallelConfig
from earl_jax.profiling.table import Profile
from earl_jax.run import rundir
from earl_jax.testing.configs import smoke_experiment

CONFIG = smoke_experiment(steps=4, checkpoint_every=1, eval_every=0)
STATE = {'w': jnp.arange(8, dtype=jnp.float32), 'step': jnp.zeros((), jnp.int32)}
PROFILE = Profile(
  key={'stages': ['rollout'], 'candidates': {}, 'buckets': [64], 'rows': [8]}, cells={}
)


def _open(workdir, config=CONFIG, resume=False, lines=None):
  log = (lines if lines is not None else []).append
  return rundir.RunDir.open(str(workdir), config, resume=resume, log=log)


def _saved_run(workdir, steps=(1, 2, 3), rows=4, config=CONFIG):
  """A run that saved `steps` and logged `rows` metrics rows (as if it died after them)."""
  run_dir, point = _open(workdir, config)
  assert point is None
  for step in steps:
    state = {**STATE, 'step': jnp.asarray(step, jnp.int32)}
    meta = {
      'selector': {'stages': {}, 'refused': {}},
      'train_config': 'dp4.tp2',
      'prev_stats': {'episode_lengths': [step], 'num_responses': 8},
      'profile': PROFILE.to_json(),
    }
    run_dir.save(step, state, meta)
  run_dir.close()
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for step in range(rows + 1):
      f.write(json.dumps({'step': step, 'win_rate': step / 10}) + '\n')
  return run_dir


def _abstract(meta: dict):
  assert ParallelConfig.parse(meta['train_config']) == ParallelConfig(dp=4, tp=2)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), STATE)


def test_a_used_or_unwritable_workdir_is_refused(tmp_path):
  run_dir, point = _open(tmp_path / 'fresh')
  # Only the lock until the first use of the checkpoints (a run refused before writes nothing).
  assert point is None and os.listdir(tmp_path / 'fresh') == ['.lock']
  assert run_dir.checkpointer is not None and os.path.isdir(tmp_path / 'fresh' / 'checkpoints')
  assert not os.path.exists(tmp_path / 'fresh' / 'metrics.jsonl')
  run_dir.close()
  assert os.listdir(tmp_path / 'fresh') == ['checkpoints']
  # Without checkpoints nothing is opened on disk; the folder made for the lock goes with it.
  quiet = dataclasses.replace(CONFIG, checkpoint_every=0)
  run_dir, _ = _open(tmp_path / 'quiet' / 'run', quiet)
  assert run_dir.checkpointer is None and os.listdir(tmp_path / 'quiet' / 'run') == ['.lock']
  run_dir.close()
  run_dir.close()  # again: nothing more
  assert not os.path.exists(tmp_path / 'quiet')
  (tmp_path / 'used').mkdir()
  (tmp_path / 'used' / 'metrics.jsonl').write_text('{"step": 1}\n')
  with pytest.raises(rundir.WorkdirError, match=r'holds a run \(metrics.jsonl\)'):
    _open(tmp_path / 'used')
  assert os.listdir(tmp_path / 'used') == ['metrics.jsonl']  # the refused run took no lock
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
  with_lr = lambda lr, **kw: dataclasses.replace(  # noqa: E731
    CONFIG, optim=dataclasses.replace(CONFIG.optim, learning_rate=lr), **kw
  )
  _saved_run(tmp_path / 'run', config=with_lr(0.003))
  other = with_lr(0.001, loss=dataclasses.replace(CONFIG.loss, kl_coef=0.5))
  with pytest.raises(rundir.ResumeError) as refused:
    _open(tmp_path / 'run', other, resume=True)
  # Every differing field is named, in path order; the refused resume leaves no lock.
  assert str(refused.value).startswith(
    f'--resume: the checkpoint in {tmp_path / "run"} (step 3) was made by another config '
    '(loss.kl_coef: 0.01 -> 0.5; optim.learning_rate: 0.003 -> 0.001): expected the values'
  )
  assert '\n' not in str(refused.value) and '.lock' not in os.listdir(tmp_path / 'run')
  # More than five: the first five, then how many more.
  optim = dataclasses.replace(
    CONFIG.optim, learning_rate=0.001, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.1
  )
  with pytest.raises(rundir.ResumeError) as refused:
    _open(tmp_path / 'run', dataclasses.replace(CONFIG, optim=optim, seed=5), resume=True)
  assert (
    '(optim.b1: 0.9 -> 0.8; optim.b2: 0.99 -> 0.9; optim.eps: 1e-08 -> 1e-06; '
    'optim.learning_rate: 0.003 -> 0.001; optim.weight_decay: 0.0 -> 0.1; and 1 more)'
  ) in str(refused.value)
  # The initialisation's seed refuses while a KL term reads it (its reference policy is made
  # from the initial parameters, not checkpointed); without one it does not (experiment_test).
  with pytest.raises(rundir.ResumeError, match=r'another config \(init_seed: 0 -> 3\)'):
    _open(tmp_path / 'run', with_lr(0.003, init_seed=3), resume=True)
  # What does not change the computation from the checkpoint on does not refuse: the schedule,
  # the evaluation's size and seed.
  same = with_lr(0.003, steps=9, eval_episodes=16, eval_seed=7, name='again')
  run_dir, point = _open(tmp_path / 'run', same, resume=True)
  assert point.steps == (3, 2, 1)
  assert Profile.from_json(point.meta['profile']).key == PROFILE.key
  run_dir.close()


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
  assert restored.meta['train_config'] == 'dp4.tp2' and restored.meta['step'] == 2
  assert restored.meta['prev_stats'] == {'episode_lengths': [2], 'num_responses': 8}
  assert restored.meta['selector'] == {'stages': {}, 'refused': {}}
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


def _lock(workdir, pid, *, host=None, at=None):
  """Writes the lock of a run `pid` on `host` (default: this one) that took it `at` (now)."""
  os.makedirs(workdir, exist_ok=True)
  at = time.time() if at is None else at
  owner = {'host': host or socket.gethostname(), 'pid': pid, 'started': 'then', 'time': at}
  (workdir / '.lock').write_text(json.dumps(owner))


@pytest.fixture
def live_pid():
  """The pid of a live process (not this one)."""
  proc = subprocess.Popen(['sleep', '60'])
  yield proc.pid
  proc.kill()
  proc.wait()


def _dead_pid():
  proc = subprocess.Popen(['true'])
  proc.wait()  # reaped: no such process now
  return proc.pid


def test_one_run_per_workdir_the_lock(tmp_path, live_pid):
  run = tmp_path / 'run'
  # A live run's lock refuses in one line that names it, and is left as it was.
  _lock(run, live_pid)
  before = (run / '.lock').read_text()
  for resume in (False, True):
    with pytest.raises(rundir.WorkdirError) as refused:
      _open(run, resume=resume)
    assert str(refused.value) == (
      f'--workdir {run} is in use by a live run (host {socket.gethostname()}, pid {live_pid}, '
      'started then): expected one run per workdir; wait for it to end, stop it, or pass '
      'another --workdir.'
    )
  assert (run / '.lock').read_text() == before
  # Another host's lock refuses: this host cannot tell whether that run lives.
  _lock(run, live_pid, host='elsewhere')
  with pytest.raises(
    rundir.WorkdirError,
    match=rf'another host \(host elsewhere, pid {live_pid}.*'
    rf'if that run is over, delete {run / ".lock"} and run again',
  ):
    _open(run)
  # A dead run's lock is taken over, with one line in the log.
  dead = _dead_pid()
  _lock(run, dead)
  lines = []
  run_dir, _ = _open(run, lines=lines)
  assert lines == [
    f'--workdir {run}: took over the lock of a run that is gone (host {socket.gethostname()}, '
    f'pid {dead}, started then: no such process).'
  ]
  owner = json.loads((run / '.lock').read_text())
  assert owner['pid'] == os.getpid() and owner['host'] == socket.gethostname()
  # Held: another process is refused (here: the lock as another live process would see it).
  held = (run / '.lock').read_text()
  _lock(run, live_pid)
  with pytest.raises(rundir.WorkdirError, match='in use by a live run'):
    _open(run)
  (run / '.lock').write_text(held)
  run_dir.close()  # released: the lock is gone, the workdir is free
  assert not os.path.exists(run / '.lock')
  _open(run)[0].close()


def test_a_lock_whose_owner_cannot_be_the_run_is_taken_over(tmp_path, live_pid):
  # A live pid whose process started after the lock was written: the dead owner's pid reused.
  _lock(tmp_path / 'reused', live_pid, at=time.time() - 3600)
  lines = []
  _open(tmp_path / 'reused', lines=lines)[0].close()
  assert len(lines) == 1 and f'pid {live_pid} is now a process started later' in lines[0]
  # This process's own lock (a second open of the workdir by the same process): taken quietly.
  _lock(tmp_path / 'own', os.getpid())
  lines = []
  _open(tmp_path / 'own', lines=lines)[0].close()
  assert lines == [] and not os.path.exists(tmp_path / 'own' / '.lock')
  # A lock that does not parse: being written (refused) while young, else its writer died.
  (tmp_path / 'torn').mkdir()
  (tmp_path / 'torn' / '.lock').write_text('{"host": "h", "pi')
  with pytest.raises(rundir.WorkdirError, match=r'another run is taking its lock .* right now'):
    _open(tmp_path / 'torn')
  old = time.time() - 60
  os.utime(tmp_path / 'torn' / '.lock', (old, old))
  lines = []
  _open(tmp_path / 'torn', lines=lines)[0].close()
  assert len(lines) == 1 and 'an unreadable lock 60 s old' in lines[0]


def test_a_refused_run_leaves_no_folder_behind(tmp_path):
  # A workdir made for the lock goes again when the checks after it refuse the run.
  with pytest.raises(rundir.ResumeError, match='no checkpoint in'):
    _open(tmp_path / 'runs' / 'new', resume=True)
  assert os.listdir(tmp_path) == []


def test_move_aside_refuses_a_live_run_and_a_bad_workdir(tmp_path, live_pid):
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'metrics.jsonl').write_text('{"step": 1}\n')
  _lock(run, live_pid)
  with pytest.raises(rundir.WorkdirError, match=f'--workdir {run} is in use by a live run'):
    rundir.move_aside(str(run))
  assert sorted(os.listdir(tmp_path)) == ['run']  # nothing renamed
  # A workdir that cannot be one is refused before anything is renamed.
  (tmp_path / 'a_file').write_text('x')
  with pytest.raises(rundir.WorkdirError, match='is a file: expected a folder'):
    rundir.move_aside(str(tmp_path / 'a_file' / 'run'))
  # Its owner gone, the run is moved (its lock taken over, then left behind), and the workdir is
  # free for the next run.
  _lock(run, _dead_pid())
  lines = []
  aside = rundir.move_aside(str(run), log=lines.append)
  assert len(lines) == 1 and 'took over the lock of a run that is gone' in lines[0]
  assert os.listdir(aside) == ['metrics.jsonl'] and not os.path.exists(run)
  # A folder that held only a dead run's lock has nothing to keep: it stays, without the lock.
  _lock(run, _dead_pid())
  assert rundir.move_aside(str(run), log=lines.append) is None
  assert os.listdir(run) == []


def test_a_corrupt_metrics_history_is_reported_and_the_readable_rows_kept(tmp_path):
  _saved_run(tmp_path / 'run', rows=5)
  rows = [json.dumps({'step': s, 'win_rate': s / 10}) for s in range(6)]
  rows[2] = '{"step": 2, "win_r\x00\xff'  # garbled (and not UTF-8 on disk)
  del rows[1]  # step 1 lost
  text = '\n'.join(rows) + '\n{"step": 6, "wi'  # a last row cut short
  (tmp_path / 'run' / 'metrics.jsonl').write_bytes(text.encode('latin-1'))
  lines = []
  run_dir, point = _open(tmp_path / 'run', resume=True, lines=lines)
  restored = run_dir.restore(point, _abstract)
  assert restored.step == 3 and [r['step'] for r in restored.rows] == [0, 3]
  assert lines == [
    f'metrics.jsonl of {tmp_path / "run"}: line 2 unreadable; steps 1-2 missing; resuming '
    'from step 3 with the 2 readable rows up to it.',
    f'resumed from step 3 ({tmp_path / "run" / "checkpoints"})',
  ]
  run_dir.close()
  # No history at all: said, and the run goes on from its checkpoint.
  os.remove(tmp_path / 'run' / 'metrics.jsonl')
  lines = []
  run_dir, point = _open(tmp_path / 'run', resume=True, lines=lines)
  assert run_dir.restore(point, _abstract).rows == []
  assert lines[0].endswith(
    'the file is missing; steps 1-3 missing; resuming from step 3 with the 0 readable rows up to it.'
  )
  run_dir.close()
