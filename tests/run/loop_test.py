"""The loop both jobs run: its cadence, the stop at a saved step, the non-finite guard, and the
workdir freed however it ends (a counting job on a real run directory and metrics writer)."""

import dataclasses
import json
import os
import signal

import pytest

from earl_jax.run import loop, metrics, preemption
from earl_jax.run.rundir import RunDir
from earl_jax.run.workdir_lock import LOCK


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config:
  steps: int
  eval_every: int = 0
  checkpoint_every: int = 0
  log_every: int = 1
  max_skipped_in_a_row: int = 0
  keep_checkpoints: int = 1

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  def fingerprint(self) -> str:
    return 'counting'

  def resume_diff(self, saved: dict) -> list[str]:
    return []


class _Counting:
  """A job whose step counts, skipping the steps `skip` (as a non-finite update would), and
  signalling itself during the step `signal_at`, in `workdir` (a real run directory, lock and
  metrics writer)."""

  def __init__(self, workdir, skip=(), signal_at=None, **cadence):
    self.config, self.global_step, self.is_main = _Config(**cadence), 0, True
    self.run_dir, _ = RunDir.open(str(workdir), self.config, resume=False, log=lambda _: None)
    self.writer, self.logged = metrics.MetricsWriter(str(workdir)), []
    self.log = self.logged.append
    self.skip, self.signal_at = set(skip), signal_at
    self.skipped, self.saved, self.evaluated, self.lines, self.closed = 0, [], [], [], False

  def step(self) -> dict:
    self.global_step += 1
    if self.global_step == self.signal_at:
      os.kill(os.getpid(), signal.SIGTERM)
    self.skipped += self.global_step in self.skip
    return {'count': self.global_step}

  def evaluate(self) -> dict:
    if self.global_step == self.signal_at:  # 0: the evaluation before the first step
      os.kill(os.getpid(), signal.SIGTERM)
    self.evaluated.append(self.global_step)
    return {'eval/count': self.global_step}

  def save(self) -> None:
    self.saved.append(self.global_step)

  def skipped_steps(self) -> int:
    return self.skipped

  def keep(self, record: dict) -> str:
    self.lines.append(f'step {record["step"]}')
    return self.lines[-1]

  def close(self) -> None:
    self.closed = True


def _run(job: _Counting) -> list[dict]:
  """Runs `job`; the rows of its metrics.jsonl (the workdir freed however it ended)."""
  workdir = job.run_dir.workdir
  assert os.path.exists(os.path.join(workdir, LOCK))
  try:
    loop.run(job, progress=False)
  finally:
    assert job.closed and not os.path.exists(os.path.join(workdir, LOCK))
    with open(os.path.join(workdir, 'config.json')) as f:
      assert json.load(f)['steps'] == job.config.steps
  return metrics.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))


def test_the_cadence_evaluates_saves_and_logs_on_its_steps_and_at_the_last(tmp_path):
  job = _Counting(tmp_path, steps=5, eval_every=2, checkpoint_every=2, log_every=2)
  rows = _run(job)
  assert job.evaluated == [0, 2, 4, 5] and job.saved == [2, 4, 5]
  assert [r['step'] for r in rows] == [0, 1, 2, 3, 4, 5]
  assert [r['step'] for r in rows if 'eval/count' in r] == [0, 2, 4, 5]
  assert [r['count'] for r in rows[1:]] == [1, 2, 3, 4, 5] and rows[-1]['wall_s'] >= 0
  assert job.logged == [f'step {s}' for s in range(6)]  # every line logged (log_every: printed)


def test_repeated_skipped_steps_stop_the_run(tmp_path):
  job = _Counting(tmp_path, skip=(2, 4, 5), steps=9, max_skipped_in_a_row=2)
  with pytest.raises(loop.NonFiniteError, match=r'steps 4-5: 2 steps in a row were skipped'):
    _run(job)
  assert job.global_step == 5  # step 2 alone did not stop it


def test_a_signal_stops_at_the_end_of_its_step_saved(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  job = _Counting(tmp_path, signal_at=3, steps=9, checkpoint_every=5)
  with pytest.raises(preemption.Stopped) as stopped:
    _run(job)
  assert (stopped.value.step, stopped.value.signum, stopped.value.saved) == (
    3,
    signal.SIGTERM,
    True,
  )
  assert job.saved == [3] and job.global_step == 3
  assert signal.getsignal(signal.SIGTERM) == before  # the handlers put back


def test_outside_the_steps_a_signal_stops_at_once_and_before_the_first_says_nothing_to_save(
  tmp_path,
):
  """Under `StopAtOnce` (a job's entry point), SIGTERM during the evaluation before the first step
  raises Stopped at once: no step, nothing saved, the workdir freed; the loop's own handlers
  take over while it steps, and mark the later stops as after the steps."""
  before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  try:
    outside = preemption.StopAtOnce().install()
    job = _Counting(tmp_path / 'a', signal_at=0, steps=4, eval_every=2, checkpoint_every=1)
    with pytest.raises(preemption.Stopped) as stopped:
      _run(job)
    assert str(stopped.value) == 'stopped by SIGTERM before the first step: nothing to save'
    assert (stopped.value.step, stopped.value.exit_code) == (None, 143)
    assert job.global_step == 0 and job.saved == [] and not outside.stepped
    _run(_Counting(tmp_path / 'b', steps=2))
    assert outside.stepped and signal.getsignal(signal.SIGTERM) == outside._handle
    with pytest.raises(preemption.Stopped, match='stopped by SIGINT after the training steps'):
      os.kill(os.getpid(), signal.SIGINT)
  finally:
    for s, handler in before.items():
      signal.signal(s, handler)
