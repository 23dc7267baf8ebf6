"""Metrics: one JSON line per record, TensorBoard event files, and a readable one-line summary.

writer = MetricsWriter(workdir)                 # workdir/metrics.jsonl + workdir/tb/
writer.write(step, {'win_rate': 0.5, 'time/rollout_s': 1.2})
writer.close()
"""

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np


def _scalar(value: Any) -> float | int | str | None:
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)) or (hasattr(value, 'shape') and value.shape == ()):
    f = float(value)
    return f if math.isfinite(f) else None
  if isinstance(value, str):
    return value
  return None


class MetricsWriter:
  """Appends records to `metrics.jsonl` and scalars to TensorBoard (process 0 only)."""

  def __init__(
    self,
    workdir: str,
    *,
    tensorboard: bool = True,
    enabled: bool = True,
    purge_step: int | None = None,
  ):
    """`purge_step`: TensorBoard hides the events of earlier files from this step on (a resumed
    run passes its first new step, so that what the run that died logged later shows once)."""
    self.enabled = enabled
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if tensorboard:
      from tensorboardX import SummaryWriter  # a heavy import, made only when used

      # A unique suffix: two writers in the same second would otherwise share one file name.
      suffix = f'.{os.getpid()}.{time.time_ns()}'
      self._tb = SummaryWriter(
        os.path.join(workdir, 'tb'), purge_step=purge_step, filename_suffix=suffix
      )

  def write(self, step: int, record: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    clean = {k: _scalar(v) for k, v in record.items()}
    with open(self.path, 'a') as f:
      f.write(json.dumps({**clean, 'step': step}) + '\n')
    if self._tb is not None:
      for k, v in clean.items():
        if isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()

  def rewrite(self, records: list[Mapping[str, Any]]) -> None:
    """Replaces metrics.jsonl with `records` (each has its 'step'), e.g. after a resume."""
    if not self.enabled:
      return
    tmp = f'{self.path}.tmp'
    with open(tmp, 'w') as f:
      for record in records:
        f.write(json.dumps({k: _scalar(v) for k, v in record.items()}) + '\n')
    os.replace(tmp, self.path)  # a run killed here keeps the old file whole

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read_jsonl(path: str) -> list[dict]:
  """The records of `path`; a last line cut short (a run killed while writing it) is left out."""
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  out = []
  for i, line in enumerate(lines):
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      if i < len(lines) - 1:
        raise
  return out
