# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The EARL paper's figures, reproduced at small scale
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/earl-jax/earl_jax/blob/main/notebooks/paper_figures.ipynb)
#
# This notebook runs `scripts/reproduce_paper.sh` (here `--quick`: tiny payloads and presets, a
# few minutes on a CPU runtime; set `QUICK = False` below for the small-scale run, about 20
# minutes on two cores) and shows every artefact next to the paper's numbers (arXiv 2510.05943):
#
# * **Fig. 1**: the main job under a hard context cap, and without one (EARL);
# * **Fig. 3**: decode throughput per layout, context and load, the selector's choice, OOM cells;
# * **context growth**: EARL-dynamic against every static layout as contexts grow;
# * **Fig. 4**: dispatch latency of the single-controller baseline, an all-gather, XLA and ours;
# * **Table 1**: the intermediate data volume against context length;
# * **the simulation**: Fig. 4 and Fig. 3's memory on the paper's 16 x 8 H100 cluster, modelled.
#
# Each experiment runs in its own process, as a user would run it from the command line.

# %%
import os
import pathlib
import subprocess
import sys

REPO_URL = 'https://github.com/earl-jax/earl_jax'  # the repository to install on Colab


def _checkout() -> pathlib.Path | None:
  """The earl_jax checkout this notebook runs in, if any (its root holds pyproject.toml)."""
  for d in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (d / 'pyproject.toml').exists() and (d / 'earl_jax').is_dir():
      return d
  return None


ROOT = _checkout()
if ROOT is None:  # Colab: clone (the scripts and fixtures) and install
  ROOT = pathlib.Path('/content/earl_jax')
  if not ROOT.exists():
    subprocess.run(['git', 'clone', '-q', '--depth=1', REPO_URL, str(ROOT)], check=True)
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', str(ROOT)], check=True)
os.chdir(ROOT)

# %%
# Parameters: QUICK for a CPU runtime (and CI); the output folder (EARL_RESULTS overrides it).
QUICK = True
OUT_DIR = pathlib.Path(os.environ.get('EARL_RESULTS', ROOT / 'results' / 'notebook'))

# %%
import time

t0 = time.perf_counter()
cmd = [sys.executable, 'experiments/reproduce_paper.py', f'--out_dir={OUT_DIR}']
cmd += ['--quick'] if QUICK else []
# Each experiment sets its own device count; the caller's other XLA flags are kept.
flags = [
  f for f in os.environ.get('XLA_FLAGS', '').split() if 'host_platform_device_count' not in f
]
env = {**os.environ, 'XLA_FLAGS': ' '.join(flags)}
run = subprocess.run(cmd, env=env, capture_output=True, text=True)
summary = [x for x in run.stdout.splitlines() if x.startswith('== ') and x.endswith(' s')]
print('\n'.join(summary))
print(f'all artefacts in {time.perf_counter() - t0:.0f} s, into {OUT_DIR}')
if run.returncode:
  raise RuntimeError(f'reproduce_paper failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}')

# %%
import json

from IPython.display import Image, Markdown, display


def show(name: str) -> dict:
  """Displays an artefact's PNG; returns its JSON."""
  png = OUT_DIR / f'{name}.png'
  if png.exists():
    display(Image(filename=str(png)))
  return json.loads((OUT_DIR / f'{name}.json').read_text())


# %% [markdown]
# ## Fig. 1: context growth, and a hard context cap
#
# The paper (Fig. 1): episode-level contexts reach the 8K cap by step 13, and the return collapses
# after step 15. Here the main job runs twice from the same seed, its buckets cut at the cap in
# one run (an episode that would outgrow it is truncated and its turn forfeited), up to the
# largest bucket in the other; both keep the truncated episodes out of the update (overlong
# filtering). The full run uses the `think` preset, in which the policy learns to think before
# its moves, so its tokens per move grow as the paper's reasoning does, and the capped run's
# return falls once most of its episodes are truncated; the quick run uses the `smoke` preset.

# %%
fig1 = show('fig1')
s = fig1['summary']
print(f'cap {s["cap"]} tokens; the capped run first truncates an episode at step '
      f'{s["capped_reaches_cap_at_step"]}')  # fmt: skip
for name in ('capped', 'earl'):
  x = s[name]
  pf = x['smoothed']
  print(f'  {name:6s} mean return over the last quarter {x["return_last_quarter"]:+.3f}, '
        f'tokens per move {x["turn_len_first"]:.1f} -> {x["turn_len_last"]:.1f}, '
        f'episodes at the end {x["episode_len_mean_last"]:.0f} tokens; {pf["window"]}-step '
        f'return: largest fall {pf["fall"]:.3f}, from {pf["peak"]:+.3f} (step {pf["peak_step"]}) '
        f'to {pf["low_after_peak"]:+.3f} (step {pf["low_step"]})')  # fmt: skip

# %% [markdown]
# ## Fig. 3: decode throughput per layout, and the selector's choice
#
# The paper: TP4 wins at short context (up to 31%), TP8 at long context (3-6.5%), and TP4 runs out
# of memory at 128 responses x 32K. Here: every candidate layout's decode tokens per device per
# second in each (context, responses) cell, OOM against an emulated per-device budget.

# %%
fig3 = show('fig3')
c = fig3['counts']
print(f'{len(fig3["cells"])} cells; the selector within {fig3["goal"]:.0%} of the best in '
      f'{c["ok"]}, a tie within the run-to-run noise in {c["tie"]}, a miss in {c["miss"]}')  # fmt: skip

# %% [markdown]
# ## Context growth: EARL-dynamic against every static layout
#
# A static layout whose step does not fit the memory budget fails there, as a job that runs out
# of memory stops; EARL moves to a layout that fits.

# %%
growth = show('growth')
for x in growth['runs']:
  failed = x['failed_at'] is not None
  tput = '' if x['throughput'] is None else f', {x["throughput"]:.0f} tokens/device/s'
  print(
    f'{x["run"]:>16}: ' + (f'failed at step {x["failed_at"]}' if failed else 'all steps') + tput
  )

# %% [markdown]
# ## Fig. 4: dispatch latency
#
# The paper: the layout-aware dispatch is 9.7x (8K), 11.0x (16K) and 11.2x (32K) faster than the
# single-controller path, on 16 nodes with 200 Gbit/s TCP. Here: N local processes over loopback,
# the same bytes, every row to another process; the raw TCP floor is the same bytes per process
# over plain sockets.

# %%
fig4 = show('fig4')
paper = {8192: 9.7, 16384: 11.0, 32768: 11.2}
rows = ['| context | gather_scatter ms | allgather ms | xla ms | layout_aware ms | TCP floor ms | '
        'gs / la (paper) |', '|---|---|---|---|---|---|---|']  # fmt: skip
for x in fig4['results']:
  m = x['median_ms']
  rows.append(
    f'| {x["context"] // 1024}K | {m["gather_scatter"]:.1f} | {m["allgather"]:.1f} | '
    f'{m["xla"]:.1f} | {m["layout_aware"]:.1f} | {m.get("socket_floor", float("nan")):.1f} | '
    f'{m["gather_scatter"] / m["layout_aware"]:.1f}x ({paper.get(x["context"], "-")}x) |'
  )
display(Markdown('\n'.join(rows)))

# %% [markdown]
# ## Table 1: intermediate data volume against context length

# %%
table1 = show('table1')
rows = ["| context | ours at the paper's scale (MiB) | paper (MiB) |", '|---|---|---|']
rows += [f'| {x["context"]} | {x["ours_mib"]:,.0f} | {x.get("paper_mib", 0):,} |'
         for x in table1['at_scale']]  # fmt: skip
display(Markdown('\n'.join(rows)))
print(f'{table1["bytes_per_token"]:.0f} bytes per token in our RL batch; the paper\'s estimate '
      f'implies {table1["at_scale"][0]["paper_bytes_per_token_per_gpu"]:,.0f} per token per GPU')  # fmt: skip

# %% [markdown]
# ## The paper's cluster, modelled
#
# Which parameters are measured on this machine, which the paper gives, and which are fitted:
# see `experiments/simulate_paper.py`.

# %%
sim = json.loads((OUT_DIR / 'simulation.json').read_text())
rows = ['| worker stream rate | 8K | 16K | 32K |', '|---|---|---|---|']
for v in sim['dispatch']:
  ratios = ' | '.join(f'{x["ratio"]:.1f}x ({x["paper_ratio"]}x)' for x in v['rows'])
  rows.append(f'| {v["variant"]}: {v["worker_rate_bytes_per_s"] / 1e9:.2f} GB/s | {ratios} |')
display(Markdown('\n'.join(rows)))
mem = sim['memory']
print(f'memory model: the TP4 / TP8 winner agrees with the paper in {mem["winner_agrees"]} of 29 '
      f'cells, the OOM cell in {mem["oom_agrees"]} of {mem["paper_cells"]}')  # fmt: skip

# %%
# Peak resident memory of this notebook's process (the experiments run in their own processes).
with open('/proc/self/status') as f:
  peak = next(int(line.split()[1]) for line in f if line.startswith('VmHWM'))
print(f'peak resident memory: {peak / 1024 / 1024:.2f} GB')
