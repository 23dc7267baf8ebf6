"""Bar chart of dispatch latency per context length (the paper's Fig. 4) from dispatch_latency JSON.

  python scripts/plot_dispatch.py --json=runs/dispatch.json --out=runs/dispatch.png

One group of bars per context length (gather_scatter, allgather, xla, layout_aware_fresh,
layout_aware and the raw socket floor, whichever were run), with the gather_scatter /
layout_aware ratio written above each group, as in the paper.
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt

_COLORS = {
  'gather_scatter': '#9e9e9e',
  'allgather': '#cccccc',
  'xla': '#6baed6',
  'layout_aware_fresh': '#fdae6b',
  'layout_aware': '#d94801',
  'socket_floor': '#31a354',
  'socket_pairs': '#a1d99b',
}
_LABELS = {
  'gather_scatter': 'Gather to controller + scatter (baseline)',
  'allgather': 'All-gather to every process',
  'socket_floor': 'Raw TCP ring, same bytes (floor)',
  'socket_pairs': 'Raw TCP, same bytes between the same pairs',
  'xla': 'XLA reshard (jit out_shardings)',
  'layout_aware_fresh': 'Layout-aware, fresh output buffers',
  'layout_aware': 'Layout-aware (EARL)',
}


def plot(report: dict, out: str, *, log: bool = False) -> None:
  results = report['results']
  names = [*report['flags']['strategies'], 'socket_floor', 'socket_pairs']
  strategies = [s for s in names if all(s in r['median_ms'] for r in results)]
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  width = 0.8 / max(1, len(strategies))
  for i, s in enumerate(strategies):
    xs = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(results))]
    ys = [r['median_ms'][s] / 1e3 for r in results]
    ax.bar(xs, ys, width, label=_LABELS.get(s, s), color=_COLORS.get(s))
  for j, r in enumerate(results):
    ratio = r.get('ratio_gather_scatter_over_layout_aware')
    if ratio is not None:
      top = max(r['median_ms'][s] for s in strategies) / 1e3
      ax.text(
        j, top * (1.15 if log else 1.02), f'{ratio:.1f}x', ha='center', va='bottom', weight='bold'
      )
  ax.set_xticks(range(len(results)))
  ax.set_xticklabels(
    [f'{r["context"] // 1024}K\n{r["payload_mib_per_worker"]:.0f} MiB/worker' for r in results]
  )
  ax.set_xlabel('context length')
  ax.set_ylabel('dispatch latency (s)')
  if log:
    ax.set_yscale('log')
  else:
    ax.set_ylim(0, max(r['median_ms'][s] for r in results for s in strategies) / 1e3 * 1.45)
  flags = report['flags']
  ax.set_title(
    f'{report["processes"]} workers, {flags["src"]} -> {flags["dst"]}, '
    f'permutation {flags["permutation"]}',
    fontsize=10,
  )
  ax.legend(fontsize=8, loc='upper left')
  fig.tight_layout()
  fig.savefig(out, dpi=150)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--json', required=True, help='dispatch_latency.py --out file')
  parser.add_argument('--out', required=True, help='PNG to write')
  parser.add_argument('--log', action='store_true', help='log-scale latency axis')
  args = parser.parse_args(argv)
  with open(args.json) as f:
    report = json.load(f)
  plot(report, args.out, log=args.log)
  print(f'wrote {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
