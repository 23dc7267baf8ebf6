"""The run directory: who may write it, which checkpoint a resume continues, and what it keeps.

A workdir holds one run: `metrics.jsonl`, `tb/`, `checkpoints/<step>/` (the train state and its
metadata: the config's fingerprint, the selector's state, the statistics the next decisions read
and the profile they were taken on), `config.json`, `summary.json` and plots. `RunDir.open`
checks all of it before anything compiles, and says what a resume will continue from; nothing
here compiles or touches a device except the checkpoint restore.

  run_dir, resume_point = RunDir.open('runs/default', config, resume=True, log=print)
  resume_point.profile                                   # the checkpoint's profile (or None)
  restored = run_dir.restore(resume_point, abstract_state_for)
  restored.step, restored.state, restored.rows          # rows: metrics.jsonl up to the step
  run_dir.save(step, state, selector_state=..., train_config=..., prev_stats=..., profile=...)
"""

import dataclasses
import os
import pathlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

from absl import logging

from earl_jax import checkpointing, metrics
from earl_jax.config import ParallelConfig
from earl_jax.errors import UserError
from earl_jax.experiment import ExperimentConfig
from earl_jax.selector.profile import Profile

# The longest file or folder name (bytes) of the file systems a run writes to (ext4, xfs, tmpfs).
_NAME_MAX = 255


class ResumeError(UserError):
  """`--resume` without a checkpoint, or with another config's."""


class WorkdirError(UserError):
  """A workdir that cannot be written, or that holds another run."""


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  """What `--resume` continues from, chosen before anything compiles.

  Attributes:
    steps: the checkpoint steps to try, newest first (the newest whose metadata reads, and the
      older ones should its arrays not restore).
    profile: the profile the checkpoint's decisions were taken on (None: none was kept).
  """

  steps: tuple[int, ...]
  profile: Profile | None


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored checkpoint, as the trainer continues from it.

  Attributes:
    step: its step.
    state: the train state, on `train_config`'s layout.
    train_config: the train layout it was saved from.
    selector_state: `Selector.state_dict()` at the step.
    prev_stats: the statistics the next rollout decision reads (`StepStats` fields), or None.
    rows: metrics.jsonl's records up to the step (what a run that died logged later is dropped).
  """

  step: int
  state: Any
  train_config: ParallelConfig
  selector_state: dict
  prev_stats: dict | None
  rows: list[dict]


class RunDir:
  """One run's folder: its checks, checkpoints and metadata (see the module docstring)."""

  def __init__(
    self,
    workdir: str,
    config: ExperimentConfig,
    checkpointer: checkpointing.Checkpointer | None,
    *,
    log: Callable[[str], None],
  ):
    """Use `RunDir.open`, which checks the folder first."""
    self.workdir = workdir
    self.config = config
    self._checkpointer = checkpointer
    self.log = log

  @property
  def checkpointer(self) -> checkpointing.Checkpointer | None:
    """The run's checkpoints (None: it keeps none). A fresh run opens them at their first use,
    its first save, so that a run refused before then leaves no checkpoints/ folder behind."""
    if self._checkpointer is None and self.config.checkpoint_every:
      self._checkpointer = checkpointing.Checkpointer(
        os.path.join(self.workdir, 'checkpoints'), max_to_keep=self.config.keep_checkpoints
      )
    return self._checkpointer

  @classmethod
  def open(
    cls, workdir: str, config: ExperimentConfig, *, resume: bool, log: Callable[[str], None]
  ) -> tuple['RunDir', ResumePoint | None]:
    """Checks that `workdir` can be written and holds no other run (or, with `resume`, a
    checkpoint of this config); returns the run directory and, with `resume`, the point it
    continues from.

    Raises:
      WorkdirError: not writable, or a run is there (without `resume`).
      ResumeError: `resume` without a readable checkpoint of this config.
    """
    check_writable(workdir)
    if not resume:
      used = [n for n in ('metrics.jsonl', 'checkpoints') if _nonempty(workdir, n)]
      if used:
        raise WorkdirError(
          f'--workdir {workdir} holds a run ({" and ".join(used)}): expected an unused '
          'folder; pass --resume to continue it, --move_aside to keep it aside and start '
          'afresh, or another --workdir.'
        )
    checkpointer = None  # a fresh run's are opened at its first save (`checkpointer`)
    if resume:
      ckpt_dir = os.path.join(workdir, 'checkpoints')
      if not os.path.isdir(ckpt_dir):
        raise ResumeError(
          f'--resume: no checkpoint in {os.path.abspath(ckpt_dir)}: expected a run to continue; '
          'start without --resume (or point --workdir at the run to continue).'
        )
      checkpointer = checkpointing.Checkpointer(ckpt_dir, max_to_keep=config.keep_checkpoints)
    run_dir = cls(workdir, config, checkpointer, log=log)
    return run_dir, run_dir._resume_point() if resume else None

  def _resume_point(self) -> ResumePoint:
    """The newest checkpoint whose metadata reads, checked against this config."""
    ckpt = self.checkpointer
    assert ckpt is not None  # opened with resume
    ckpt_dir = ckpt.directory
    if ckpt.latest_step() is None:
      raise ResumeError(
        f'--resume: no checkpoint in {ckpt_dir}: expected a run to continue; start without '
        '--resume (or point --workdir at the run to continue).'
      )
    steps = sorted(ckpt.all_steps(), reverse=True)
    step, meta = next(ckpt.readable_metas(steps, on_skip=self._skip_checkpoint), (None, None))
    if meta is None:
      raise ResumeError(
        f'--resume: no readable checkpoint in {ckpt_dir} (steps {steps}): expected one that '
        'restores; start without --resume in a new --workdir.'
      )
    fingerprint = self.config.fingerprint()
    if meta.get('fingerprint') != fingerprint:
      raise ResumeError(
        f'--resume: the checkpoint in {self.workdir} (step {meta.get("step")}) was made by '
        f'another config (fingerprint {meta.get("fingerprint")} != {fingerprint}): expected '
        'the same preset and overrides, or a new --workdir.'
      )
    profile = Profile.from_json(meta['profile']) if meta.get('profile') else None
    return ResumePoint(steps=tuple(s for s in steps if s <= step), profile=profile)

  def _skip_checkpoint(self, step: int, reason: str) -> None:
    line = f'checkpoint step {step} in {self.workdir} is unreadable ({reason}): skipped'
    logging.warning('%s', line)
    self.log(line)

  def restore(
    self, point: ResumePoint, abstract_state: Callable[[ParallelConfig], Any]
  ) -> Restored:
    """Restores the newest checkpoint of `point` that reads and verifies (older ones if it
    does not), onto the layout `abstract_state(train layout)` describes; later steps that did
    not restore are kept aside (so that this run can save those steps again)."""
    ckpt = self.checkpointer
    assert ckpt is not None  # opened with resume
    step, state, meta = ckpt.restore_newest_readable(
      lambda meta: abstract_state(ParallelConfig.parse(meta['train_config'])),
      on_skip=self._skip_checkpoint,
      steps=list(point.steps),
    )
    newer = [s for s in ckpt.all_steps() if s > step]
    if newer:  # kept aside, so that this run can save those steps again
      ckpt.set_aside(newer, suffix='unreadable')
      logging.warning('resuming from step %d, the newest readable checkpoint', step)
    step = int(meta['step'])
    # The metrics history stays on disk: the rows up to the checkpoint are kept, and what a run
    # that died logged after it is dropped (the writer rewrites the file once it is open).
    path = os.path.join(self.workdir, 'metrics.jsonl')
    rows = metrics.read_jsonl(path) if os.path.exists(path) else []
    restored = Restored(
      step=step,
      state=state,
      train_config=ParallelConfig.parse(meta['train_config']),
      selector_state=meta['selector'],
      prev_stats=meta['prev_stats'],
      rows=[r for r in rows if r.get('step', 0) <= step],
    )
    self.log(f'resumed from step {step} ({ckpt.directory})')
    return restored

  def save(
    self,
    step: int,
    state: Any,
    *,
    selector_state: dict,
    train_config: ParallelConfig,
    prev_stats: dict | None,
    profile: dict | None,
  ) -> None:
    """Saves the train state at `step` with what a resume needs to decide as this run would
    (asynchronously; `wait` before exiting). Nothing when the run keeps no checkpoints."""
    if self.checkpointer is None:
      return
    meta = {
      'step': step,
      'fingerprint': self.config.fingerprint(),
      'config': self.config.to_json(),
      'selector': selector_state,
      'train_config': train_config.name,
      'prev_stats': prev_stats,
      'profile': profile,
    }
    self.checkpointer.save(step, state, meta)

  def wait(self) -> None:
    """Waits for the checkpoint being written."""
    if self._checkpointer is not None:
      self._checkpointer.wait()


def check_writable(workdir: str) -> None:
  """Raises WorkdirError unless this process can create files in `workdir` (made if missing)."""
  if not workdir.strip():
    raise WorkdirError('--workdir is empty: expected a folder.')
  for name in pathlib.PurePath(os.path.abspath(workdir)).parts:
    if len(os.fsencode(name)) > _NAME_MAX:
      raise WorkdirError(
        f'--workdir {workdir}: the name {name!r} is {len(os.fsencode(name))} bytes: expected at '
        f'most {_NAME_MAX} (the file system limit of one name).'
      )
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise WorkdirError(f'--workdir {workdir}: {existing} is a file: expected a folder.')
  try:
    fd, probe = tempfile.mkstemp(dir=existing, prefix='.earl_write_check_')
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise WorkdirError(
      f'--workdir {workdir} is not writable ({e.strerror} in {existing}): expected a folder '
      'this process can write.'
    ) from None


def _nonempty(workdir: str, name: str) -> bool:
  path = os.path.join(workdir, name)
  if os.path.isdir(path):
    return bool(os.listdir(path))
  return os.path.isfile(path) and os.path.getsize(path) > 0


def move_aside(workdir: str) -> str | None:
  """Renames a used `workdir` to `<workdir>.<UTC time>` (process 0; the others wait); returns
  the new name on process 0 when something was moved, else None."""
  import jax
  from jax.experimental import multihost_utils

  aside = None
  if jax.process_index() == 0 and os.path.isdir(workdir) and os.listdir(workdir):
    aside = f'{workdir.rstrip(os.sep)}.{time.strftime("%Y%m%d-%H%M%S", time.gmtime())}'
    os.rename(workdir, aside)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('move_aside')
  return aside
