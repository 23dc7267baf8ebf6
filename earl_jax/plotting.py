"""PNG plots of a training run from its metrics.jsonl (matplotlib, Agg backend).

plotting.plot_training('runs/default/metrics.jsonl', 'runs/default')
# -> learning_curve.png, context_lengths.png
"""

import os

from earl_jax import metrics


def _pyplot():
  import matplotlib  # imported lazily: plotting is an end-of-run extra

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  return plt


def plot_training(metrics_path: str, out_dir: str) -> list[str]:
  """Writes the learning curve and the context-length curves; returns the PNG paths."""
  rows = metrics.read_jsonl(metrics_path)
  plt = _pyplot()
  os.makedirs(out_dir, exist_ok=True)
  paths = []

  fig, ax = plt.subplots(figsize=(7, 4))
  train = [(r['step'], r['win_rate']) for r in rows if r.get('win_rate') is not None]
  evals = [(r['step'], r['eval/win_rate']) for r in rows if r.get('eval/win_rate') is not None]
  invalid = [(r['step'], r['invalid_rate']) for r in rows if r.get('invalid_rate') is not None]
  if train:
    ax.plot(*zip(*train), label='train rollouts (sampled)', alpha=0.6)
  if evals:
    ax.plot(*zip(*evals), 'o-', label='evaluation (greedy, fixed seeds)')
  if invalid:
    ax.plot(*zip(*invalid), ':', label='invalid replies (train)', alpha=0.6)
  ax.set_xlabel('step')
  ax.set_ylabel('rate')
  ax.set_ylim(-0.02, 1.02)
  ax.set_title('Win rate against the opponent')
  ax.grid(alpha=0.3)
  ax.legend()
  path = os.path.join(out_dir, 'learning_curve.png')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  paths.append(path)

  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
  steps = [r['step'] for r in rows if 'ctx/turn_len_mean' in r]
  if steps:
    a1.plot(steps, [r['ctx/turn_len_mean'] for r in rows if 'ctx/turn_len_mean' in r])
    a2.plot(
      steps, [r['ctx/episode_len_mean'] for r in rows if 'ctx/turn_len_mean' in r], label='mean'
    )
    a2.plot(
      steps, [r['ctx/episode_len_max'] for r in rows if 'ctx/turn_len_mean' in r], label='max'
    )
    a2.plot(steps, [r['bucket'] for r in rows if 'ctx/turn_len_mean' in r], '--', label='bucket')
  a1.set_title('Turn-level context length (tokens)')
  a2.set_title('Episode-level context length (tokens)')
  for a in (a1, a2):
    a.set_xlabel('step')
    a.grid(alpha=0.3)
  a2.legend()
  path = os.path.join(out_dir, 'context_lengths.png')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  paths.append(path)
  return paths
