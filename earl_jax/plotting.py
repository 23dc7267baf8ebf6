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

  path = plot_stage_layouts(rows, os.path.join(out_dir, 'stage_layouts.png'))
  if path:
    paths.append(path)
  return paths


STAGE_KEYS = (
  ('rollout', 'plan/rollout'),
  ('experience', 'plan/experience'),
  ('train', 'plan/train'),
)


def stage_layouts(rows: list[dict]) -> dict[str, dict[str, list]]:
  """Per stage, from metrics rows with plans: steps, layout names, buckets, and the steps at
  which the layout changed (a new bucket on the same layout is not a switch)."""
  plans = [r for r in rows if all(k in r for _, k in STAGE_KEYS)]
  out = {}
  for stage, key in STAGE_KEYS:
    steps = [r['step'] for r in plans]
    layouts = [r[key].split('@')[0] for r in plans]
    buckets = [int(r[key].split('@')[1]) for r in plans]
    switches = [s for s, a, b in zip(steps[1:], layouts, layouts[1:]) if a != b]
    out[stage] = {'steps': steps, 'layouts': layouts, 'buckets': buckets, 'switches': switches}
  return out


def plot_stage_layouts(rows: list[dict], path: str) -> str | None:
  """Which layout each stage ran on at every step, its bucket as the colour, and every switch
  marked: the selector's decisions over the run. Returns the path, or None without plans."""
  series = stage_layouts(rows)
  if not series['rollout']['steps']:
    return None
  plt = _pyplot()
  buckets = sorted({b for x in series.values() for b in x['buckets']})
  cmap = plt.get_cmap('viridis', max(2, len(buckets)))
  fig, axes = plt.subplots(
    len(STAGE_KEYS), 1, figsize=(9, 1.6 + 1.3 * len(STAGE_KEYS)), sharex=True
  )
  for ax, (stage, _) in zip(axes, STAGE_KEYS):
    x = series[stage]
    names = sorted(set(x['layouts']))
    ys = [names.index(name) for name in x['layouts']]
    colors = [cmap(buckets.index(b)) for b in x['buckets']]
    ax.step(x['steps'], ys, where='post', color='#bbbbbb', lw=1, zorder=1)
    ax.scatter(x['steps'], ys, c=colors, s=14, zorder=2)
    for s in x['switches']:
      ax.axvline(s, color='#d94801', lw=0.8, alpha=0.5)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.5, len(names) - 0.5)
    ax.set_ylabel(stage)
    n = len(x['switches'])
    ax.set_title(f'{stage}: {n} layout switch{"" if n == 1 else "es"}', fontsize=9, loc='left')
    ax.grid(alpha=0.3, axis='x')
  axes[-1].set_xlabel('step')
  handles = [
    plt.Line2D([], [], marker='o', ls='', color=cmap(i), label=str(b))
    for i, b in enumerate(buckets)
  ]
  fig.legend(handles=handles, title='bucket', loc='upper right', fontsize=7, title_fontsize=7)
  fig.suptitle('Layout of each stage per step (orange: a switch)', fontsize=10, x=0.4)
  fig.tight_layout(rect=(0, 0, 0.9, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
