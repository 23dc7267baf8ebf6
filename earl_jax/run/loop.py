"""The loop every job runs: steps to the end, evaluating, logging and checkpointing on its cadence,
stopping cleanly when asked to, and stopping when the updates stop being finite.

A job (the RL `Trainer`, the supervised `SFTRun`) holds its state and knows its step; this loop
holds what every run does around the steps, in one place:

  - the config in the workdir's config.json (process 0);
  - an evaluation at step 0 (a fresh run), then every `eval_every` steps and at the last;
  - every record to metrics.jsonl and TensorBoard (the job's `MetricsWriter`), its line to the
    log, and above the progress bar every `log_every` steps and at the last;
  - a checkpoint every `checkpoint_every` steps and at the last (the job's `save`);
  - a checkpoint that failed in the background stops the run at once (`RunDir.check`);
  - SIGTERM or Ctrl-C (`preemption.StopRequests`): the step under way finishes, is saved, and
    `preemption.Stopped` is raised, every process at the same step; a second Ctrl-C stops at
    once (KeyboardInterrupt), without waiting for the save under way;
  - `max_skipped_in_a_row` skipped (non-finite) steps in a row raise `NonFiniteError`;
  - however it ends: the job's logs and background work closed, then the workdir freed
    (`RunDir.close`; `RunDir.release` only on the second Ctrl-C).

  wall_s = loop.run(job)      # job.config's cadence (`Cadence.of`), its run_dir and writer
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from earl_jax.errors import UserError
from earl_jax.run import metrics, preemption
from earl_jax.run.rundir import RunDir


class NonFiniteError(UserError):
  """`max_skipped_in_a_row` steps in a row had a loss, gradient or update that was not finite."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cadence:
  """When the loop evaluates, prints and saves (0: never), and when it gives up.

  Attributes:
    steps: the step the run ends at.
    eval_every: evaluate every this many steps, at step 0 of a fresh run and at the last.
    checkpoint_every: save every this many steps and at the last.
    log_every: print a step's line every this many steps and at the last (every line is logged).
    max_skipped_in_a_row: raise `NonFiniteError` after this many skipped steps in a row.
  """

  steps: int
  eval_every: int = 0
  checkpoint_every: int = 0
  log_every: int = 1
  max_skipped_in_a_row: int = 0

  @classmethod
  def of(cls, config: Any) -> 'Cadence':
    """The cadence of a job's config (fields of the same names; those it lacks: the defaults)."""
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: getattr(config, n) for n in names if hasattr(config, n)})


@runtime_checkable
class Job(Protocol):
  """What the loop needs of a job."""

  global_step: int  # steps done; `step` advances it
  is_main: bool  # process 0: the one that prints
  config: Any  # its cadence (`Cadence.of`)
  run_dir: RunDir
  writer: metrics.MetricsWriter
  log: Callable[[str], None]  # receives every line

  def step(self) -> dict:
    """One step; its record (the loop adds 'step' and 'wall_s')."""

  def evaluate(self) -> dict:
    """The evaluation's fields, added to the record of the step it follows."""

  def save(self) -> None:
    """Checkpoints the step (every process)."""

  def skipped_steps(self) -> int:
    """The steps skipped so far for a non-finite loss, gradient or update."""

  def keep(self, record: dict) -> str:
    """Keeps a record in the job's history; returns its line."""

  def close(self) -> None:
    """Closes what the job opened besides the workdir: its logs, its background work."""


def run(job: Job, *, progress: bool = True) -> float:
  """Runs `job` from its `global_step` to its config's `steps` (see the module docstring);
  returns the seconds it took.

  Raises:
    preemption.Stopped: SIGTERM or SIGINT asked the run to stop; it stopped at the end of a
      step, every process at the same one, and saved it.
    NonFiniteError: too many non-finite steps in a row.
    KeyboardInterrupt: a second Ctrl-C.
  """
  from tqdm import tqdm  # only the loop needs it

  t0 = time.perf_counter()
  cadence, run_dir = Cadence.of(job.config), job.run_dir
  shown = progress and job.is_main

  def write(record: dict, show: bool) -> None:
    job.writer.write(record['step'], record)
    line = job.keep(record)
    if show:
      tqdm.write(line)
    job.log(line)

  bar = tqdm(total=cadence.steps, initial=job.global_step, disable=not shown, leave=False)
  at_once = False
  try:
    run_dir.write_config()
    if job.global_step == 0 and cadence.eval_every:  # a stop here stops at once: no step to save
      write({'step': 0, **job.evaluate()}, shown)
    with preemption.StopRequests() as stops:
      _steps(job, cadence, t0, run_dir, stops, write, bar, shown)
  except KeyboardInterrupt:  # a second Ctrl-C: no waiting for the save under way
    at_once = True
    raise
  finally:
    bar.close()
    if at_once:
      run_dir.release()
    else:
      try:
        job.close()
      finally:
        run_dir.close()  # waits for the save (its failure raised last), frees the workdir
  return time.perf_counter() - t0


def _steps(job, cadence, t0, run_dir, stops, write, bar, shown) -> None:
  """Steps to `cadence.steps`, each evaluated, written and checkpointed on the cadence."""
  skipped, in_a_row = job.skipped_steps(), 0
  while job.global_step < cadence.steps:
    record = job.step()
    step, last = job.global_step, job.global_step == cadence.steps
    total = job.skipped_steps()
    in_a_row = in_a_row + 1 if total > skipped else 0
    skipped = total
    if cadence.eval_every and (step % cadence.eval_every == 0 or last):
      record.update(job.evaluate())
    record['step'] = step
    record['wall_s'] = time.perf_counter() - t0
    write(record, shown and bool(cadence.log_every) and (step % cadence.log_every == 0 or last))
    bar.update(1)
    saved = cadence.checkpoint_every and (step % cadence.checkpoint_every == 0 or last)
    if saved:
      job.save()
    run_dir.check()  # a save that failed in the background stops the run now
    if signum := stops.agreed():
      if not saved:
        job.save()
      raise preemption.Stopped(step, signum, saved=bool(cadence.checkpoint_every))
    if cadence.max_skipped_in_a_row and in_a_row >= cadence.max_skipped_in_a_row:
      raise NonFiniteError(
        f'steps {step - in_a_row + 1}-{step}: {in_a_row} steps in a row were skipped because '
        'the loss, the gradients or the update were not finite '
        f'(max_skipped_in_a_row={cadence.max_skipped_in_a_row}); the parameters are those of '
        'the last kept step; expected finite updates: lower optim.learning_rate or check the '
        'data.'
      )
