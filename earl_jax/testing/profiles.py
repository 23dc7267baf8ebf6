"""Small profiles and selector decisions for the regret tests (no measurement)."""

import dataclasses
from typing import Any

from earl_jax.config import ModelConfig
from earl_jax.profiling.table import Cell, Profile
from earl_jax.stage import Stage

LAYOUTS = ('dp8.tp1', 'dp4.tp2')


def profile(figures: dict[tuple[str, int, str], float]) -> Profile:
  """A profile of 'tiny-game' at 16 rows, buckets 128-512, rollout and train on `LAYOUTS`,
  with a measured cell (three quiet calls) per {(stage, bucket, layout): tokens/s/device}."""
  key = {
    'stages': ['rollout', 'train'],
    'candidates': {'rollout': list(LAYOUTS), 'train': list(LAYOUTS)},
    'buckets': [128, 256, 512],
    'rows': [16],
    'model': dataclasses.asdict(ModelConfig.preset('tiny-game')),
    'spec': {'sampling': {'max_new_tokens': 1}, 'chunk': 64, 'micro_batches': 1},
  }
  cells = {}
  for (stage, bucket, name), tgs in figures.items():
    stage = Stage.parse(stage)
    cells[(stage, bucket, 16, name)] = Cell(
      stage=stage,
      config=name,
      bucket=bucket,
      rows=16,
      peak_bytes=1,
      oom=False,
      throughput=tgs,
      times_ms=(1.0, 1.0, 1.0),
    )
  return Profile(key=key, cells=cells)


def crossing_truth() -> Profile:
  """dp8 wins at 128 and 256, dp4.tp2 at 512 (by 25%), for both stages."""
  per_bucket = {128: (100.0, 80.0), 256: (90.0, 75.0), 512: (60.0, 75.0)}
  return profile(
    {
      (s, b, n): per_bucket[b][i]
      for s in ('rollout', 'train')
      for b in per_bucket
      for i, n in enumerate(LAYOUTS)
    }
  )


def decision(stage, step, config, run_bucket, measured=True, reason='') -> dict[str, Any]:
  """A `Selector.log()` entry, as far as the regret reads it."""
  return {
    'stage': stage,
    'step': step,
    'config': config,
    'bucket': run_bucket,
    'run_bucket': run_bucket,
    'rows': 16,
    'measured': measured,
    'reason': reason,
  }
