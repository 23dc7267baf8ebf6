"""Regenerates the paper's artefacts at small scale into one directory, next to the paper's numbers.

  scripts/reproduce_paper.sh                         # every artefact, small scale, into results/
  scripts/reproduce_paper.sh --quick                 # tiny payloads and presets (CI), checked
  scripts/reproduce_paper.sh --artefacts=fig4,table1 --out_dir=/tmp/r

Artefacts (each a JSON and a PNG; `results/README.md` puts ours next to the paper's):
  fig1        the main job under a hard context cap and without one: context lengths and
              return per step (experiments/context_cap.py)
  fig3        decode throughput per layout x context x load, the selector's choice, OOM cells
              (experiments/selector_heatmap.py)
  growth      EARL-dynamic against every static layout as contexts grow
              (experiments/context_growth.py)
  fig4        dispatch latency: the single-controller baseline, the all-gather, XLA and ours,
              and the raw TCP floor (experiments/dispatch_latency.py)
  table1      intermediate data volume against context (experiments/data_volume.py)
  simulation  Fig. 4 and Fig. 3's memory at the paper's scale, modelled
              (experiments/simulate_paper.py, with fig4's measured rate when it ran)

Every artefact runs in its own process, as a user would run it; one that fails is reported and
the others still run (exit code 1 at the end). --quick also checks each artefact's files and key
figures (for CI).
"""

import json
import os
import subprocess
import sys
import time

from absl import flags

from earl_jax import runtime
from earl_jax.errors import UserError

ARTEFACTS = ('fig1', 'fig3', 'growth', 'fig4', 'table1', 'simulation')
_ARTEFACTS = flags.DEFINE_list('artefacts', list(ARTEFACTS), f'Any of {", ".join(ARTEFACTS)}.')
_OUT_DIR = flags.DEFINE_string('out_dir', 'results', 'Where the artefacts go.')
_QUICK = flags.DEFINE_bool('quick', False, 'Tiny sizes (CI, a few minutes), with checks.')

PAPER = {
  'fig4': {8192: 9.7, 16384: 11.0, 32768: 11.2},
  'table1_mib': {
    1024: 15_625,
    2048: 31_250,
    4096: 62_500,
    8192: 125_000,
    16384: 250_000,
    32768: 500_000,
  },
}


def _commands(name: str, out: str, quick: bool) -> list[list[str]]:
  py = sys.executable
  j, png = os.path.join(out, f'{name}.json'), os.path.join(out, f'{name}.png')
  if name == 'fig1':
    size = ['--preset=smoke', '--cap=96', '--steps=4'] if quick else []
    # The two training runs go to <out>/capped and <out>/earl.
    return [[py, 'experiments/context_cap.py', f'--out_dir={out}', *size]]
  if name == 'fig3':
    preset = ['--preset=smoke'] if quick else []
    return [
      [py, 'experiments/selector_heatmap.py', f'--out={j}', *preset],
      [py, 'scripts/plot_selector.py', f'--json={j}', f'--out={png}'],
    ]
  if name == 'growth':
    preset = ['--preset=smoke'] if quick else []
    return [
      [py, 'experiments/context_growth.py', f'--out={j}', *preset],
      [py, 'scripts/plot_selector.py', f'--json={j}', f'--out={png}'],
    ]
  if name == 'fig4':
    size = (
      ['--num_workers=4', '--src=dp4', '--dst=dp4', '--scale=0.02', '--reps=2'] if quick else []
    )
    return [
      [py, 'experiments/dispatch_latency.py', f'--out={j}', *size],
      [py, 'scripts/plot_dispatch.py', f'--json={j}', f'--out={png}'],
    ]
  if name == 'table1':
    return [[py, 'experiments/data_volume.py', f'--out={j}', f'--png={png}']]
  if name == 'simulation':
    fig4 = os.path.join(out, 'fig4.json')
    measured = [f'--dispatch_json={fig4}'] if os.path.exists(fig4) else []
    return [[py, 'experiments/simulate_paper.py', f'--out={j}', *measured]]
  raise AssertionError(name)


def _check(name: str, out: str) -> list[str]:
  """Problems with an artefact's files and key figures (empty: fine)."""
  j = os.path.join(out, f'{name}.json')
  files = [j] + ([os.path.join(out, f'{name}.png')] if name != 'simulation' else [])
  missing = [f for f in files if not os.path.exists(f) or os.path.getsize(f) == 0]
  if missing:
    return [f'missing {m}' for m in missing]
  with open(j) as f:
    r = json.load(f)
  problems = []
  if name == 'fig4':
    for x in r['results']:
      if not x['verified_all']:
        problems.append(f'fig4 {x["context"]}: a strategy delivered wrong data')
      if not x['median_ms']['gather_scatter'] > x['median_ms']['layout_aware']:
        problems.append(f'fig4 {x["context"]}: the controller baseline is not slower')
  elif name == 'fig1':
    if not r['runs']['capped']['step'] or not r['runs']['earl']['step']:
      problems.append('fig1: a run has no steps')
  elif name == 'fig3':
    if not r['cells'] or not r['counts']['ok'] + r['counts']['tie']:
      problems.append('fig3: no cell where the selector chose within the goal')
  elif name == 'growth':
    if r['runs'][0]['failed_at'] is not None:
      problems.append('growth: EARL-dynamic failed a step')
  elif name == 'table1':
    if r['bytes_per_token'] <= 0 or len(r['at_scale']) != len(r['per_length']):
      problems.append('table1: no volumes')
  elif name == 'simulation' and (r['memory']['winner_agrees'] < 29 or not r['dispatch']):
    problems.append('simulation: the memory model misses a Fig. 3 cell, or no dispatch rows')
  return problems


def _fall(pf: dict, fmt: str) -> str:
  """A Fig. 1 table cell: a smoothed series' largest fall, as `context_cap.peak_and_fall` gives it."""
  if not pf['fall'] > 0:
    return f'none (peak {pf["peak"]:{fmt}} at {pf["peak_step"]})'
  return (
    f'{pf["peak"]:{fmt}} ({pf["peak_step"]}) -> {pf["low_after_peak"]:{fmt}} ({pf["low_step"]})'
  )


def _summary(name: str, out: str) -> list[str]:
  """Markdown lines: ours next to the paper's."""
  j = os.path.join(out, f'{name}.json')
  if not os.path.exists(j):
    return [f'## {name}', '', '(not produced: see the run log)', '']
  with open(j) as f:
    r = json.load(f)
  lines = [f'## {name}', '']
  if name == 'fig4':
    lines += [
      f'{r["processes"]} processes x {r["devices"] // r["processes"]} devices over loopback, '
      f'`{r["flags"]["src"]} -> {r["flags"]["dst"]}`, permutation {r["flags"]["permutation"]}, '
      f'scale {r["flags"]["scale"]}, median of {r["flags"]["reps"]} (ms).',
      '',
      '| context | MiB/worker | gather_scatter | allgather | xla | layout_aware (fresh outputs) '
      '| layout_aware | TCP floor | TCP pairs | gs / la (paper) |',
      '|---|---|---|---|---|---|---|---|---|---|',
    ]
    for x in r['results']:
      m = x['median_ms']
      cell = lambda k, m=m: f'{m[k]:.1f}' if k in m else '-'  # noqa: E731
      paper = PAPER['fig4'].get(x['context'])
      ratio = x.get('ratio_gather_scatter_over_layout_aware')
      lines.append(
        f'| {x["context"] // 1024}K | {x["payload_mib_per_worker"]:.1f} | {cell("gather_scatter")} '
        f'| {cell("allgather")} | {cell("xla")} | {cell("layout_aware_fresh")} '
        f'| {cell("layout_aware")} | '
        f'{cell("socket_floor")} | {cell("socket_pairs")} | {ratio:.1f}x ({paper}x) |'
      )
  elif name == 'table1':
    lines += [
      f'The RL batch: {r["bytes_per_token"]:.0f} B per token and {r["bytes_per_row"]:.0f} B per '
      f'row ({len(r["fields"])} fields). At {r["gpus"]} GPUs x {r["rows_per_gpu"]} episodes:',
      '',
      '| context | ours, one step (MiB) | paper (MiB) | paper / ours |',
      '|---|---|---|---|',
    ]
    for s in r['at_scale']:
      paper = f'{s["paper_mib"]:,}' if 'paper_mib' in s else '-'
      ratio = f'{s["paper_over_ours"]:.1f}x' if 'paper_over_ours' in s else '-'
      lines.append(f'| {s["context"]} | {s["ours_mib"]:,.0f} | {paper} | {ratio} |')
  elif name == 'simulation':
    lines += ['| worker rate | 8K | 16K | 32K |', '|---|---|---|---|']
    for v in r['dispatch']:
      ratios = ' | '.join(f'{x["ratio"]:.1f}x ({x["paper_ratio"]}x)' for x in v['rows'])
      lines.append(f'| {v["variant"]}, {v["worker_rate_bytes_per_s"] / 1e9:.3f} GB/s | {ratios} |')
    mem = r['memory']
    lines += [
      '',
      f'Memory ({mem["model"]}): winner agrees with the paper in {mem["winner_agrees"]} of 29 '
      f'cells, OOM in {mem["oom_agrees"]} of {mem["paper_cells"]} (OOM threshold fitted).',
    ]
  elif name == 'fig1':
    s = r['summary']
    lines.append(
      f'Preset `{r["preset"]}`, cap {s["cap"]} tokens (buckets {r["capped_buckets"]}; EARL '
      f"{r['earl_buckets']}; both runs' overrides: {' '.join(r['overrides']) or 'none'}). "
      "The capped run's longest episodes reach the cap at step "
      f'{s["capped_reaches_cap_at_step"]}. Paper: episodes reach the 8K cap by step 13 and the '
      'return collapses after step 15.'
    )
    window = s['capped']['smoothed']['window']
    lines += ['', '| run | tokens per move, first -> last | episode mean at the end | '
              'return before | after | last quarter | truncated after (most) | '
              f'{window}-step return: largest fall, peak (step) -> low (step) | '
              f'{window}-step win rate: largest fall |',
              '|---|---|---|---|---|---|---|---|---|']  # fmt: skip
    for run in ('capped', 'earl'):
      x = s[run]
      f = lambda v: '-' if v is None else f'{v:+.3f}'  # noqa: E731
      share = '-' if x['overflow_rate_after'] is None else f'{x["overflow_rate_after"]:.0%}'
      share += f' ({x["overflow_rate_max"]:.0%})' if x.get('overflow_rate_max') else ''
      lines.append(
        f'| {run} | {x["turn_len_first"]:.1f} -> {x["turn_len_last"]:.1f} | '
        f'{x["episode_len_mean_last"]:.0f} | {f(x["return_before"])} | '
        f'{f(x["return_after"])} | {f(x["return_last_quarter"])} | {share} | '
        f'{_fall(x["smoothed"], "+.3f")} | {_fall(x["smoothed_win_rate"], ".3f")} |'
      )
  elif name == 'fig3':
    c = r['counts']
    lines.append(
      f'{len(r["cells"])} cells; selector within {r["goal"]:.0%} of the best: {c["ok"]}, ties '
      f'{c["tie"]}, misses {c["miss"]}, no layout fits {c["none-fits"]}.'
    )
  elif name == 'growth':
    for x in r['runs']:
      failed = x['failed_at'] is not None
      tput = '-' if x['throughput'] is None else f'{x["throughput"]:.1f} tok/dev/s'
      lines.append(
        f'- {x["run"]}: ' + (f'failed at step {x["failed_at"]}' if failed else f'all steps, {tput}')
      )
  return [*lines, '', f'![{name}]({name}.png)' if name != 'simulation' else '', '']


def main(argv):
  del argv
  unknown = [a for a in _ARTEFACTS.value if a not in ARTEFACTS]
  if unknown:
    raise UserError(f'--artefacts {",".join(unknown)}: expected any of {", ".join(ARTEFACTS)}')
  out = _OUT_DIR.value
  os.makedirs(out, exist_ok=True)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  failed, timings = [], {}
  for name in [a for a in ARTEFACTS if a in _ARTEFACTS.value]:
    t0 = time.perf_counter()
    print(f'== {name}', flush=True)
    for cmd in _commands(name, out, _QUICK.value):
      print('$ ' + ' '.join('python' if c == sys.executable else c for c in cmd), flush=True)
      rc = subprocess.run(cmd, cwd=root).returncode
      if rc:
        failed.append(f'{name}: exit code {rc} from {cmd[1]}')
        break
    else:
      if _QUICK.value:
        failed += _check(name, out)
    timings[name] = time.perf_counter() - t0
    print(f'== {name}: {timings[name]:.0f} s', flush=True)
  lines = [
    "# The paper's artefacts, reproduced at small scale",
    '',
    f'`scripts/reproduce_paper.sh{" --quick" if _QUICK.value else ""}` on '
    f"{os.cpu_count()} CPU cores; every figure next to the paper's (arXiv 2510.05943).",
    '',
  ]
  for name in timings:
    lines += _summary(name, out)
  with open(os.path.join(out, 'README.md'), 'w') as f:
    f.write('\n'.join(lines))
  print(f'wrote {os.path.join(out, "README.md")}')
  if failed:
    print('failed:\n  ' + '\n  '.join(failed), file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  runtime.run(main)
