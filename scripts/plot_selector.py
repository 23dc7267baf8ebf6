"""PNG plots of the selector benchmarks, from their JSON.

  python scripts/plot_selector.py --json=runs/selector_heatmap.json --out=runs/selector_heatmap.png
  python scripts/plot_selector.py --json=runs/context_growth.json --out=runs/context_growth.png

The kind is read from the JSON: a heatmap (experiments/selector_heatmap.py) draws the paper's
Fig. 3 analogue, Eq. 1 speedup per (context, responses) with OOM cells marked and the selector's
choice and its fraction of the best TGS written in each cell, plus the 72B TP4/TP8 feasibility
grid; a growth run (experiments/context_growth.py) draws per-step throughput of EARL-dynamic and
every static layout against the mean context, and the total throughput of each run.
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np


def plot_heatmap(r: dict, out: str) -> None:
  ctxs, resps = r['buckets'], r['responses']
  a, b = r['compare']
  grid = np.full((len(ctxs), len(resps)), np.nan)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={'width_ratios': [1.2, 1]})
  ax = axes[0]
  for c in r['cells']:
    i, j = ctxs.index(c['bucket']), resps.index(c['responses'])
    if c['speedup_pct'] is not None:
      grid[i, j] = c['speedup_pct']
  lim = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
  im = ax.imshow(grid, cmap='RdBu_r', vmin=-lim, vmax=lim, origin='lower', aspect='auto')
  for c in r['cells']:
    i, j = ctxs.index(c['bucket']), resps.index(c['responses'])
    if c['speedup_pct'] is None:
      who = ', '.join(n for n in (a, b) if n in c['oom']) or 'n/a'
      text = f'OOM\n({who})'
    else:
      text = f'{c["speedup_pct"]:+.1f}%'
    if c.get('choice'):
      frac = c.get('fraction_of_best')
      text += f'\n{c["choice"]}' + (f' {frac:.2f}' if frac is not None else '')
      text += {'ok': '', 'tie': ' (tie)', 'miss': ' MISS'}.get(c['status'], '')
    ax.text(j, i, text, ha='center', va='center', fontsize=7)
  ax.set_xticks(range(len(resps)), [str(x) for x in resps])
  ax.set_yticks(range(len(ctxs)), [str(x) for x in ctxs])
  ax.set_xlabel('#responses')
  ax.set_ylabel('context bucket (tokens)')
  ax.set_title(
    f'Speedup%({a} -> {b}), decode TGS, {r["devices"]}\n'
    f'{r["model"]}, budget {r["budget_mib"]:.0f} MiB/device; selector choice, fraction of best',
    fontsize=9,
  )
  fig.colorbar(im, ax=ax, label=f'(TGS({b}) - TGS({a})) / TGS({a}) %')

  h = r['h100_72b']
  ax = axes[1]
  hc = sorted({c['context'] for c in h['cells']})
  hr = sorted({c['responses'] for c in h['cells']})
  state = np.zeros((len(hc), len(hr)))
  for c in h['cells']:
    i, j = hc.index(c['context']), hr.index(c['responses'])
    state[i, j] = 2 if c['TP4']['fits'] else (1 if c['TP8']['fits'] else 0)
    ax.text(
      j,
      i,
      f'{c["TP4"]["need_gb"]:.0f}/{c["TP8"]["need_gb"]:.0f}',
      ha='center',
      va='center',
      fontsize=7,
    )
  cmap = matplotlib.colors.ListedColormap(['#fcbba1', '#fee391', '#c7e9c0'])
  ax.imshow(state, cmap=cmap, vmin=0, vmax=2, origin='lower', aspect='auto')
  ax.set_xticks(range(len(hr)), [str(x) for x in hr])
  ax.set_yticks(range(len(hc)), [f'{x // 1024}K' for x in hc])
  ax.set_xlabel('#responses')
  ax.set_ylabel('context')
  ax.set_title(
    'Qwen2.5-72B, 8 x H100-80GB (analytic): GB/GPU TP4/TP8\n'
    f'green: both fit, yellow: only TP8, red: neither (budget {h["budget_gb"]:.0f} GB)',
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(out, dpi=130)


def plot_growth(r: dict, out: str) -> None:
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={'width_ratios': [1.6, 1]})
  ax = axes[0]
  tokens = r['tokens_per_step']
  for run in r['runs']:
    xs, ys = [], []
    for s in run['steps']:
      if not s['refused']:
        xs.append(s['step'])
        ys.append(tokens / ((s['step_ms'] + s['stall_ms']) / 1e3) / int(r['devices'].split()[0]))
    style = '-o' if run['run'] == 'earl-dynamic' else '--.'
    failed = run.get('failed_at')
    label = run['run'] + (f' (failed at step {failed})' if failed is not None else '')
    ax.plot(xs, ys, style, label=label, lw=2 if style == '-o' else 1)
    if failed is not None:
      ax.plot([failed], [0], 'x', ms=9, mew=2, color=ax.lines[-1].get_color())
  ax.set_xlabel('step')
  ax.set_ylabel('decode tokens / device / s (incl. switch stall)')
  twin = ax.twinx()
  means = [s['mean_context'] for s in r['runs'][0]['steps']]
  twin.plot(range(len(means)), means, color='gray', alpha=0.4, lw=4)
  twin.set_ylabel('mean context (tokens), gray')
  ax.legend(fontsize=7, loc='upper right')
  ax.set_title(
    f'Context growth: {r["model"]}, {r["responses"]} responses, budget {r["budget_mib"]:.0f} MiB/device',
    fontsize=9,
  )
  ax = axes[1]
  names = [run['run'] for run in r['runs']]
  # A run that failed has no throughput over the schedule: a zero bar, labelled.
  vals = [run['throughput'] or 0.0 for run in r['runs']]
  colors = ['#d94801' if n == 'earl-dynamic' else '#9e9e9e' for n in names]
  bars = ax.bar(range(len(names)), vals, color=colors)
  for bar, run in zip(bars, r['runs']):
    failed = run.get('failed_at')
    label = f'FAILED at step {failed}' if failed is not None else 'all steps'
    ax.text(
      bar.get_x() + bar.get_width() / 2,
      bar.get_height(),
      label,
      ha='center',
      va='bottom',
      fontsize=7,
    )
  ax.set_xticks(range(len(names)), names, rotation=30, ha='right', fontsize=8)
  ax.set_ylabel('total tokens / device / s')
  ax.set_title('Throughput over the whole schedule (x: the step a run failed at)', fontsize=9)
  fig.tight_layout()
  fig.savefig(out, dpi=130)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--json', required=True, help='selector_heatmap or context_growth JSON.')
  parser.add_argument('--out', required=True, help='PNG to write.')
  args = parser.parse_args(argv)
  with open(args.json) as f:
    report = json.load(f)
  if 'h100_72b' in report:
    plot_heatmap(report, args.out)
  elif 'runs' in report:
    plot_growth(report, args.out)
  else:
    raise SystemExit(f'{args.json}: neither a selector_heatmap nor a context_growth result.')
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main(sys.argv[1:])
