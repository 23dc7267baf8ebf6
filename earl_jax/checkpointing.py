"""Orbax checkpoints of the train state plus JSON metadata, restorable onto any mesh.

Each step directory holds two items: 'state' (the TrainState pytree, saved sharded) and 'meta'
(JSON: the step, the config fingerprint, the selector's state, the statistics the next step's
decisions read, the metrics history). Restoring takes an abstract target whose shardings decide
where the arrays land, so a checkpoint saved on mesh (2, 4) restores onto (8, 1) or onto a
process with fewer devices (jax-notes §4).

  ckpt = Checkpointer(workdir / 'checkpoints', max_to_keep=3)
  ckpt.save(step, state, meta)                    # async; ckpt.wait() before exiting
  state, meta = ckpt.restore(abstract_state)      # latest step
"""

import os
from typing import Any

import orbax.checkpoint as ocp


class CheckpointError(ValueError):
  pass


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        create=True,
      ),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    self._manager.save(
      step,
      args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
    )

  def read_meta(self, step: int | None = None) -> dict:
    step = self._step(step)
    out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out['meta'])

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """The state at `step` (default: latest), laid out as `abstract_state`'s shardings say."""
    step = self._step(step)
    out = self._manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
      ),
    )
    return out['state'], dict(out['meta'])

  def _step(self, step: int | None) -> int:
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(f'No checkpoint in {self.directory}.')
    elif step not in self.all_steps():
      raise CheckpointError(
        f'No checkpoint for step {step} in {self.directory}; have {self.all_steps()}.'
      )
    return step

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
