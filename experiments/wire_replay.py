"""The moves `experiments/wire_padding.py` replays, read from a run's metrics.jsonl.

Apart from the absl app, so that a test can import it without defining the app's flags (two
experiments that both define --steps cannot be imported into one test process).
"""

import json

import numpy as np

from earl_jax.errors import UserError


def replayed_moves(path: str, steps: int, rows: int, seed: int) -> list[dict]:
  """Per train step: the layouts, the bucket and drawn episode lengths (see the docstring)."""
  try:
    with open(path) as f:
      records = [json.loads(line) for line in f if line.strip()]
  except OSError as e:
    raise UserError(f'--metrics={path!r} cannot be read: {e.strerror}.') from None
  except json.JSONDecodeError as e:
    raise UserError(f'--metrics={path!r} is not JSON lines: {e}.') from None
  records = [r for r in records if 'plan/rollout' in r]
  if not records:
    raise UserError(f'--metrics={path!r} holds no train steps (no plan/rollout records).')
  rng = np.random.default_rng(seed)
  out = []
  for r in records[: steps or None]:
    turn = max(1, round(r['ctx/turn_len_mean']))
    longest = max(1, int(r['ctx/episode_len_max']) // turn)
    turns = np.clip(rng.poisson(max(r['ctx/turns_mean'] - 1, 0.01), rows) + 1, 1, longest)
    turns[rng.integers(rows)] = longest
    out.append(
      {
        'step': r['step'],
        'src': r['plan/rollout'].split('@')[0],
        'dst': r['plan/experience'].split('@')[0],
        'bucket': int(r['bucket']),
        'lengths': turn * turns,
      }
    )
  return out
