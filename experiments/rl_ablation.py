"""RL settings side by side: presets x settings x seeds of the main job, resumable, in one table.

  python -m experiments.rl_ablation --presets=code --settings=as_is,rloo,dr_grpo,gspo
  python -m experiments.rl_ablation --presets=default,code --seeds=0,1,2 --out=runs/rl_ablation
  python -m experiments.rl_ablation --presets=default \\
      --custom='entropy01:--config.loss.entropy_coef=0.01' --settings=as_is,entropy01
  python -m experiments.rl_ablation --presets=smoke --settings=as_is,rloo --seeds=0,1 \\
      --extra=--config.steps=2                   # what CI runs
  python -m experiments.rl_ablation --presets=code --report_only   # the table of what has finished

Each (preset, setting, seed) is one run of `experiments/train.py` in its own process, as a user
runs it, in <out>/<preset>/<setting>/seed<S>: the preset with `--config.seed=S` and the
setting's `--config` overrides (`SETTINGS`, or `--custom`). A finished run (its summary.json) is
not run again; a cut one resumes from its latest checkpoint (or, with none, starts over, the cut
one moved aside): the same command continues a cut ablation. A run that fails is reported and
the others still run; the ablation then ends in one line naming it (exit code 2).

Then, over the seeds of each (preset, setting), the mean and the spread (the sample standard
deviation, and the range) of:
  eval        the last evaluation: the win rate (games), or a code task's greedy final and
              first-turn pass and, where the preset samples (`eval_samples`), pass@1 and pass@k
  first eval  the same at step 0 (what the run started from)
  diagnostics the mean over the last `--tail` train steps of the policy's entropy, the share of
              flat groups (zero advantage), the clip fraction and the KL to the reference
  wall        the run's seconds
written to <out>/ablation.json (every run and every aggregate), <out>/ablation.md (the table)
and <out>/ablation.png (each preset's headline figure per setting: mean, spread and each seed).
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from absl import flags

from earl_jax import runtime
from earl_jax.errors import UserError

# name -> (what it changes, the `--config` overrides). Each is a value of the one training loop.
SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
  'as_is': ("the preset's own settings", ()),
  'grpo': ('GRPO advantages (group mean and std)', ('--config.advantages.estimator=grpo',)),
  'rloo': ('RLOO advantages (leave-one-out baseline)', ('--config.advantages.estimator=rloo',)),
  'dr_grpo': (
    'Dr. GRPO: no division by the group std',
    ('--config.advantages.estimator=dr_grpo',),
  ),
  'gspo': ("GSPO: the episode's importance ratio", ('--config.loss.ratio=sequence',)),
  'dynamic_sampling': (
    'DAPO dynamic sampling: flat groups re-sampled, 2 rounds',
    ('--config.dynamic_sampling_rounds=2',),
  ),
  'curriculum': (
    'online task curriculum by recent pass rate (code tasks)',
    ('--config.curriculum.enabled=true',),
  ),
  'own_turn': (
    "REINFORCE++ with turn credit (gamma 0.9), a move's own reward for its turn alone",
    (
      '--config.advantages.estimator=reinforce_pp',
      '--config.advantages.credit=turn',
      '--config.advantages.gamma=0.9',
      '--config.advantages.move_credit=own_turn',
    ),
  ),
}
DEFAULT_SETTINGS = ('as_is', 'rloo', 'dr_grpo', 'gspo', 'dynamic_sampling')

_PRESETS = flags.DEFINE_list('presets', ['default'], 'Presets of experiments/train.py.')
_SETTINGS = flags.DEFINE_list(
  'settings', list(DEFAULT_SETTINGS), f'Settings, of {", ".join(SETTINGS)} or --custom.'
)
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (--config.seed) of every cell.')
_CUSTOM = flags.DEFINE_multi_string(
  'custom', [], "A setting of your own: 'NAME:FLAG FLAG ...' (train.py flags, space-separated)."
)
_EXTRA = flags.DEFINE_multi_string(
  'extra', [], 'A train.py flag every run gets (e.g. --config.steps=20), repeatable.'
)
_OUT = flags.DEFINE_string('out', 'runs/rl_ablation', 'Where the runs, table and plot go.')
_TAIL = flags.DEFINE_integer('tail', 10, 'Train steps at the end the diagnostics average over.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Print the runs that would start, run nothing.')
_REPORT_ONLY = flags.DEFINE_bool(
  'report_only', False, 'Run nothing: the table and plot of the runs finished so far.'
)

# The diagnostics: (name in the table, the metrics keys in order of preference).
DIAGNOSTICS = (
  ('entropy', ('loss/entropy', 'loss/entropy_proxy')),
  ('flat', ('groups/flat_rate',)),
  ('clip', ('loss/clip_frac',)),
  ('kl_ref', ('loss/kl_ref',)),
)


class AblationError(UserError):
  """A bad preset, setting, seed or custom setting: one line, before any run starts."""


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run: a preset, a setting and a seed, and the flags of its train.py."""

  preset: str
  setting: str
  seed: int
  overrides: tuple[str, ...]

  def workdir(self, out: str) -> str:
    return os.path.join(out, self.preset, self.setting, f'seed{self.seed}')


def parse_custom(texts: Sequence[str]) -> dict[str, tuple[str, tuple[str, ...]]]:
  """'NAME:FLAG FLAG' -> {NAME: (description, flags)}.

  Raises:
    AblationError: a text without a name, with a name of a built-in setting, or a flag that is
      not a --config override.
  """
  out = {}
  for text in texts:
    name, sep, rest = text.partition(':')
    name, overrides = name.strip(), tuple(rest.split())
    if not sep or not name.isidentifier() or not overrides:
      raise AblationError(
        f"--custom={text!r}: expected 'NAME:FLAG ...' with NAME a word and at least one "
        "--config flag, e.g. 'lr1e3:--config.optim.learning_rate=1e-3'."
      )
    if name in SETTINGS or name in out:
      raise AblationError(f'--custom name {name!r} is taken; choose another.')
    bad = [f for f in overrides if not f.startswith('--config.')]
    if bad:
      raise AblationError(
        f'--custom {name!r}: {bad[0]!r} is not a --config.<field>=<value> override.'
      )
    out[name] = (' '.join(overrides), overrides)
  return out


def plan(
  presets: Sequence[str], settings: Sequence[str], seeds: Sequence[str], custom: Sequence[str]
) -> list[Cell]:
  """Every (preset, setting, seed), presets outermost, seeds innermost.

  Raises:
    AblationError: naming the unknown preset or setting, or the seed that is not an int in
      [0, 2**31 - 2], before anything runs.
  """
  from experiments.configs import train as train_presets

  table = {**SETTINGS, **parse_custom(custom)}
  for preset in presets:
    if preset not in train_presets.PRESETS:
      raise AblationError(
        f'--presets: unknown preset {preset!r}; expected some of '
        f'{", ".join(train_presets.PRESETS)}.'
      )
  for setting in settings:
    if setting not in table:
      raise AblationError(
        f'--settings: unknown setting {setting!r}; expected some of {", ".join(table)} '
        "(or define it with --custom='NAME:FLAGS')."
      )
  parsed = []
  for seed in seeds:
    try:
      value = int(seed)
    except ValueError:
      value = -1
    if not 0 <= value <= 2**31 - 2:
      raise AblationError(f'--seeds: {seed!r} is not an int in [0, 2147483646].')
    parsed.append(value)
  if not presets or not settings or not parsed:
    raise AblationError('--presets, --settings and --seeds each need at least one value.')
  return [
    Cell(p, s, seed, table[s][1])
    for p in dict.fromkeys(presets)
    for s in dict.fromkeys(settings)
    for seed in dict.fromkeys(parsed)
  ]


def command(cell: Cell, out: str, extra: Sequence[str]) -> list[str]:
  """train.py's command line for `cell`: resumed where a checkpoint of it exists, moved aside
  where a cut run left none."""
  workdir = cell.workdir(out)
  cmd = [
    sys.executable,
    os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py'),
    f'--config={cell.preset}',
    f'--workdir={workdir}',
    f'--config.seed={cell.seed}',
    *cell.overrides,
    *extra,
  ]
  checkpoints = os.path.join(workdir, 'checkpoints')
  if os.path.isdir(checkpoints) and any(d.isdigit() for d in os.listdir(checkpoints)):
    cmd.append('--resume')
  elif os.path.exists(workdir):
    cmd.append('--move_aside')
  return cmd


def _done(cell: Cell, out: str) -> bool:
  return os.path.exists(os.path.join(cell.workdir(out), 'summary.json'))


def _mean_tail(rows: list[dict], keys: Sequence[str], tail: int) -> float | None:
  for key in keys:
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)][-tail:]
    if values:
      return sum(values) / len(values)
  return None


def eval_figures(evaluation: dict | None) -> dict[str, float]:
  """The headline figures of one evaluation (summary.json's eval_first / eval_last): a game's
  win rate, or a code task's greedy pass and its sampled pass@k."""
  if not evaluation:
    return {}
  if 'pass_final_rate' in evaluation:
    keys = ['pass_final_rate', 'pass_first_rate']
    keys += sorted(
      (k for k in evaluation if k.startswith('pass_at_')), key=lambda k: (k[-5:], len(k), k)
    )
    return {k: evaluation[k] for k in keys if k in evaluation}
  return {'win_rate': evaluation['win_rate']}


def figures(workdir: str, tail: int) -> dict[str, float]:
  """One finished run's figures: the last evaluation's (eval/...), the first's (first/...),
  the diagnostics over its last `tail` train steps and its wall time."""
  from earl_jax.run import metrics

  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  rows = [r for r in metrics.read_jsonl(os.path.join(workdir, 'metrics.jsonl')) if 'loss/loss' in r]
  out = {f'eval/{k}': v for k, v in eval_figures(summary.get('eval_last')).items()}
  out |= {f'first/{k}': v for k, v in eval_figures(summary.get('eval_first')).items()}
  for name, keys in DIAGNOSTICS:
    value = _mean_tail(rows, keys, tail)
    if value is not None:
      out[f'diag/{name}'] = value
  out['wall_s'] = float(summary['wall_s'])
  return out


def aggregate(values: Sequence[float]) -> dict[str, float]:
  """Mean, sample standard deviation (0 for one seed), min and max."""
  n = len(values)
  mean = sum(values) / n
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
  return {'mean': mean, 'std': std, 'min': min(values), 'max': max(values), 'n': n}


def table(runs: list[dict]) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
  """Per (preset, setting), each figure aggregated over the seeds that have it (with those
  seeds and their values)."""
  out: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
  for run in runs:
    out.setdefault((run['preset'], run['setting']), {})
  for (preset, setting), cells in out.items():
    mine = [r for r in runs if (r['preset'], r['setting']) == (preset, setting)]
    names = dict.fromkeys(k for r in mine for k in r['figures'])
    for name in names:
      values = [r['figures'][name] for r in mine if name in r['figures']]
      seeds = [r['seed'] for r in mine if name in r['figures']]
      cells[name] = aggregate(values) | {'seeds': seeds, 'values': values}
  return out


def headline(names: Sequence[str]) -> str:
  """The figure a preset is judged by: a code task's sampled pass@1, else its greedy final pass,
  else the win rate."""
  for name in ('eval/pass_at_1_final', 'eval/pass_final_rate', 'eval/win_rate'):
    if name in names:
      return name
  return next(iter(names))


def markdown(aggregates, descriptions: dict[str, str], header: str) -> str:
  """The table, per preset: a column per setting (its seeds), a row per figure, each cell the
  mean +- the standard deviation over the seeds (min-max); then what each setting changes."""
  lines = [header, '']
  for preset in dict.fromkeys(p for p, _ in aggregates):
    rows = {s: a for (p, s), a in aggregates.items() if p == preset}
    names = list(dict.fromkeys(n for a in rows.values() for n in a))
    seeds = {s: max((c['n'] for c in a.values()), default=0) for s, a in rows.items()}
    lines += [f'### `{preset}`', '']
    lines.append('| figure | ' + ' | '.join(f'`{s}` (n={seeds[s]})' for s in rows) + ' |')
    lines.append('|---|' + '---:|' * len(rows))
    for name in names:
      text = []
      for cells in rows.values():
        c = cells.get(name)
        if c is None:
          text.append('-')
        elif name == 'wall_s':
          text.append(f'{c["mean"]:.0f} +- {c["std"]:.0f}')
        else:
          text.append(f'{c["mean"]:.3f} +- {c["std"]:.3f} ({c["min"]:.3f}-{c["max"]:.3f})')
      lines.append(f'| {name} | ' + ' | '.join(text) + ' |')
    lines.append('')
    lines += [f'- `{s}`: {descriptions.get(s, "")}' for s in rows]
    lines.append('')
  return '\n'.join(lines)


def plot(aggregates, path: str) -> str:
  """Per preset, its headline figure per setting: the mean (bar), the standard deviation
  (error bar), every seed (dots) and where the runs started (the evaluation at step 0)."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  presets = list(dict.fromkeys(p for p, _ in aggregates))
  fig, axes = plt.subplots(1, len(presets), figsize=(5 * len(presets), 4), squeeze=False)
  for ax, preset in zip(axes[0], presets):
    rows = {s: a for (p, s), a in aggregates.items() if p == preset}
    name = headline(list(dict.fromkeys(n for a in rows.values() for n in a)))
    settings = [s for s, a in rows.items() if name in a]
    means = [rows[s][name]['mean'] for s in settings]
    stds = [rows[s][name]['std'] for s in settings]
    ax.bar(range(len(settings)), means, yerr=stds, capsize=4, alpha=0.6)
    start = [
      rows[s][f'first/{name[5:]}']['mean'] for s in settings if f'first/{name[5:]}' in rows[s]
    ]
    if start:  # where the runs started (the evaluation at step 0)
      ax.axhline(start[0], color='k', linestyle='--', linewidth=1, label='step 0')
      ax.legend(fontsize=8)
    for i, s in enumerate(settings):
      values = rows[s][name]['values']
      ax.plot([i] * len(values), values, 'k.', alpha=0.8)
    ax.set_xticks(range(len(settings)))
    ax.set_xticklabels(settings, rotation=30, ha='right')
    ax.set_ylabel(name)
    ax.set_title(f'{preset}: {name} (mean, std, seeds)')
    ax.grid(alpha=0.3, axis='y')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv):
  del argv
  cells = plan(_PRESETS.value, _SETTINGS.value, _SEEDS.value, _CUSTOM.value)
  descriptions = {k: v[0] for k, v in {**SETTINGS, **parse_custom(_CUSTOM.value)}.items()}
  out, extra = _OUT.value, list(_EXTRA.value)
  bad = [f for f in extra if not f.startswith('--')]
  if bad:
    raise AblationError(f'--extra={bad[0]!r}: expected a train.py flag such as --config.steps=20.')
  if _DRY_RUN.value:
    for cell in cells:
      state = 'done' if _done(cell, out) else ' '.join(command(cell, out, extra))
      print(f'{cell.preset}/{cell.setting}/seed{cell.seed}: {state}')
    return
  os.makedirs(out, exist_ok=True)
  failed = []
  for i, cell in enumerate([] if _REPORT_ONLY.value else cells):
    name = f'{cell.preset}/{cell.setting}/seed{cell.seed}'
    if _done(cell, out):
      print(f'[{i + 1}/{len(cells)}] {name}: done before', flush=True)
      continue
    os.makedirs(os.path.dirname(cell.workdir(out)), exist_ok=True)
    cmd = command(cell, out, extra)
    log = cell.workdir(out) + '.log'
    print(f'[{i + 1}/{len(cells)}] {name}: {" ".join(cmd[1:])} (log: {log})', flush=True)
    t0 = time.perf_counter()
    with open(log, 'a') as f:
      rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    print(f'  rc {rc} in {time.perf_counter() - t0:.0f} s', flush=True)
    if rc != 0 or not _done(cell, out):
      failed.append(f'{name} (rc {rc}, see {log})')
  runs = [
    {
      'preset': c.preset,
      'setting': c.setting,
      'seed': c.seed,
      'flags': list(c.overrides),
      'figures': figures(c.workdir(out), _TAIL.value),
    }
    for c in cells
    if _done(c, out)
  ]
  aggregates = table(runs)
  header = f'# RL ablation: {len(runs)} runs, seeds {", ".join(_SEEDS.value)}' + (
    f', every run with {" ".join(extra)}' if extra else ''
  )
  with open(os.path.join(out, 'ablation.json'), 'w') as f:
    json.dump(
      {
        'runs': runs,
        'settings': {k: descriptions[k] for k in dict.fromkeys(c.setting for c in cells)},
        'extra': extra,
        'aggregates': [{'preset': p, 'setting': s, **a} for (p, s), a in aggregates.items()],
      },
      f,
      indent=1,
    )
  text = markdown(aggregates, descriptions, header)
  with open(os.path.join(out, 'ablation.md'), 'w') as f:
    f.write(text)
  paths = [os.path.join(out, 'ablation.json'), os.path.join(out, 'ablation.md')]
  if runs:
    paths.append(plot(aggregates, os.path.join(out, 'ablation.png')))
  print(text)
  print('-> ' + ', '.join(paths))
  if failed:
    raise AblationError(f'{len(failed)} of {len(cells)} runs failed: ' + '; '.join(failed))


if __name__ == '__main__':
  runtime.run(main)
