"""PNG plots of a training run from its metrics.jsonl (matplotlib, Agg backend).

plotting.plot_training('runs/default/metrics.jsonl', 'runs/default')
# -> learning_curve.png, context_lengths.png
"""

import os

from earl_jax.run import metrics


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
  paths = [
    _plot_learning_curve(plt, rows, os.path.join(out_dir, 'learning_curve.png')),
    _plot_context_lengths(plt, rows, os.path.join(out_dir, 'context_lengths.png')),
  ]
  path = plot_stage_layouts(rows, os.path.join(out_dir, 'stage_layouts.png'))
  if path:
    paths.append(path)
  return paths


def _series(rows: list[dict], key: str) -> list[tuple]:
  """(step, value) of every row that has a value for `key`."""
  return [(r['step'], r[key]) for r in rows if r.get(key) is not None]


def _plot_learning_curve(plt, rows: list[dict], path: str) -> str:
  """Win rate of the train rollouts and of the evaluations, and the invalid-reply rate (a code
  task's run: `_plot_pass_rates`)."""
  if any('env/pass_final_rate' in r for r in rows):
    return _plot_pass_rates(plt, rows, path)
  fig, (ax, diag_ax) = plt.subplots(1, 2, figsize=(12, 4))
  train = _series(rows, 'win_rate')
  evals = _series(rows, 'eval/win_rate')
  invalid = _series(rows, 'invalid_rate')
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
  _plot_diagnostics(diag_ax, rows)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _plot_pass_rates(plt, rows: list[dict], path: str) -> str:
  """A code task's pass rates, first attempt and final, of the train rollouts and of the
  evaluations; beside them the context per turn and per episode as training goes on."""
  fig, (ax, ctx_ax, diag_ax) = plt.subplots(1, 3, figsize=(16, 4))
  sampled = sorted({int(k.split('_')[2]) for r in rows for k in r if k.startswith('eval/pass_at_')})
  for key, label, style in (
    ('env/pass_first_rate', 'train, first attempt (sampled)', ':'),
    ('env/pass_final_rate', 'train, final (sampled)', '-'),
    ('eval/pass_first_rate', 'eval, first attempt (greedy)', 'o:'),
    ('eval/pass_final_rate', 'eval, final (greedy)', 'o-'),
    *(
      (f'eval/pass_at_{j}_{turn}', f'eval pass@{j}, {turn} (sampled)', style)
      for j in sampled
      for turn, style in (('first', 's:'), ('final', 's-'))
    ),
  ):
    series = _series(rows, key)
    if series:
      ax.plot(*zip(*series), style, label=label, alpha=0.6 if key.startswith('env/') else 1.0)
  ax.set_ylim(-0.02, 1.02)
  ax.set_ylabel('pass rate (every hidden test)')
  ax.set_title('Pass rates, first attempt and final')
  for key, label in (('ctx/turn_len_mean', 'per turn'), ('ctx/episode_len_mean', 'per episode')):
    series = _series(rows, key)
    if series:
      ctx_ax.plot(*zip(*series), label=label)
  ctx_ax.set_ylabel('tokens')
  ctx_ax.set_title('Context (train rollouts)')
  for a in (ax, ctx_ax):
    a.set_xlabel('step')
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
  _plot_diagnostics(diag_ax, rows)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# What the learning diagnostics panel plots: (metrics key, label), where the run logs it.
DIAGNOSTICS = (
  ('loss/entropy', 'entropy (nats/token)'),
  ('loss/entropy_proxy', 'entropy proxy: -log p of the sampled tokens'),
  ('groups/flat_rate', 'flat groups (zero advantage)'),
  ('loss/clip_frac', 'clipped tokens'),
  ('loss/kl_ref', 'KL to the reference (k3)'),
  ('loss/approx_kl_old', 'KL to the sampler (approx.)'),
  ('loss/illegal_move_prob', 'p(illegal moves) where some are'),
  ('loss/rate_scale', 'KL-adaptive multiple of the rate'),
)


def _plot_diagnostics(ax, rows: list[dict]) -> None:
  """The policy's entropy, the share of zero-advantage groups, the clip fraction and the KLs
  per step (those the run logs), on a log scale: where learning stalls, one of them says why."""
  for key, label in DIAGNOSTICS:
    series = [(x, y) for x, y in _series(rows, key) if y > 0]
    if series:
      ax.plot(*zip(*series), label=label, alpha=0.8)
  ax.set_yscale('log')
  low, high = ax.get_ylim()
  ax.set_ylim(max(low, 1e-6), high)  # a first step's KL of 1e-14 would flatten the rest
  ax.set_xlabel('step')
  ax.set_title('Learning diagnostics')
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)


def _plot_context_lengths(plt, rows: list[dict], path: str) -> str:
  """Turn-level and episode-level context lengths (mean, max and the cache bucket) per step."""
  fig, (turn_ax, episode_ax) = plt.subplots(1, 2, figsize=(10, 4))
  with_ctx = [r for r in rows if 'ctx/turn_len_mean' in r]
  if with_ctx:
    steps = [r['step'] for r in with_ctx]
    turn_ax.plot(steps, [r['ctx/turn_len_mean'] for r in with_ctx])
    episode_ax.plot(steps, [r['ctx/episode_len_mean'] for r in with_ctx], label='mean')
    episode_ax.plot(steps, [r['ctx/episode_len_max'] for r in with_ctx], label='max')
    episode_ax.plot(steps, [r['bucket'] for r in with_ctx], '--', label='bucket')
  turn_ax.set_title('Turn-level context length (tokens)')
  episode_ax.set_title('Episode-level context length (tokens)')
  for ax in (turn_ax, episode_ax):
    ax.set_xlabel('step')
    ax.grid(alpha=0.3)
  episode_ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


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
    switches = [
      step for step, before, after in zip(steps[1:], layouts, layouts[1:]) if before != after
    ]
    # Decisions taken on the cost model alone (not measured there); a row without the figures
    # (an unprofiled stage, or an older run) counts as measured.
    model_only = [r.get(f'{key}/measured', 1.0) == 0 for r in plans]
    out[stage] = {
      'steps': steps,
      'layouts': layouts,
      'buckets': buckets,
      'switches': switches,
      'model_only': model_only,
      'profiled': any(f'{key}/measured' in r for r in plans),
    }
  return out


def plot_stage_layouts(rows: list[dict], path: str) -> str | None:
  """Which layout each stage ran on at every step, its bucket as the colour, and every switch
  marked: the selector's decisions over the run. Returns the path, or None without plans."""
  series = stage_layouts(rows)
  if not series['rollout']['steps']:
    return None
  plt = _pyplot()
  buckets = sorted({b for stage in series.values() for b in stage['buckets']})
  cmap = plt.get_cmap('viridis', max(2, len(buckets)))
  fig, axes = plt.subplots(
    len(STAGE_KEYS), 1, figsize=(9, 1.6 + 1.3 * len(STAGE_KEYS)), sharex=True
  )
  for ax, (stage, _) in zip(axes, STAGE_KEYS):
    history = series[stage]
    names = sorted(set(history['layouts']))
    ys = [names.index(name) for name in history['layouts']]
    colors = [cmap(buckets.index(b)) for b in history['buckets']]
    ax.step(history['steps'], ys, where='post', color='#bbbbbb', lw=1, zorder=1)
    measured = [not m for m in history['model_only']]
    for keep, style in ((measured, {}), (history['model_only'], {'marker': 'x'})):
      pts = [(s, y, c) for s, y, c, k in zip(history['steps'], ys, colors, keep) if k]
      if pts:
        steps_k, ys_k, colors_k = zip(*pts)
        ax.scatter(steps_k, ys_k, c=list(colors_k), s=14, zorder=2, **style)
    for step in history['switches']:
      ax.axvline(step, color='#d94801', lw=0.8, alpha=0.5)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.5, len(names) - 0.5)
    ax.set_ylabel(stage)
    switches = len(history['switches'])
    plural = '' if switches == 1 else 'es'
    alone = sum(history['model_only'])
    how = (
      f'{alone} of {len(ys)} decisions on the model alone (x)'
      if history.get('profiled', True)
      else 'not profiled (ranked by preference)'
    )
    ax.set_title(
      f'{stage}: {switches} layout switch{plural}, {how}',
      fontsize=9,
      loc='left',
    )
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
