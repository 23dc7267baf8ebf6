"""How far a run's layout choices were from the best, against an offline profile.

  python -m experiments.profile --rounds=3 --out=/tmp/truth.json    # the ground truth
  python -m experiments.train --workdir=runs/default                # the run
  python -m experiments.selector_regret --run=runs/default --profile=/tmp/truth.json \
      [--profile_b=/tmp/truth2.json]

Per stage and step: regret = the best layout's throughput over the chosen one's, minus 1, both
from the offline profile at the cell the step ran (run bucket and load); then per stage the mean
and the max, the steps not on the fastest layout and the decisions taken on the cost model alone;
the cost model (fitted to the cells the run measured) against the profile on the cells the run
did not measure, at the loads its decisions ran at and up to the longest bucket it reached; the
run's own timings against the profile's on the cells both timed (a bias there inflates the model
error); the profile's crossovers; and, with `--profile_b` (a second profile of the same setup), the two
profiles' run-to-run noise, each step's regret beyond it (the smaller of its regrets against the
two: 0 where the chosen layout is the fastest in either) and whether each crossover holds in
both; and the layouts the run chose at each crossover's bucket. Writes
`regret.json` and `regret.png` (per-step regret of each stage) next to the run's summary, or
where `--out` says.
"""

import json
import os

from absl import flags

from earl_jax import runtime

_RUN = flags.DEFINE_string('run', None, "The run's workdir (its summary.json).", required=True)
_PROFILE = flags.DEFINE_string(
  'profile', None, 'The offline profile (experiments/profile.py --out).', required=True
)
_PROFILE_B = flags.DEFINE_string(
  'profile_b', None, 'A second offline profile of the same setup: the noise between the two.'
)
_OUT = flags.DEFINE_string('out', None, 'Where regret.json and regret.png go (default: --run).')


def _load(path: str, what: str) -> dict:
  from earl_jax.errors import UserError

  try:
    with open(path) as f:
      return json.load(f)
  except OSError as e:
    raise UserError(f'{what}={path!r} cannot be read: {e.strerror}.') from None
  except json.JSONDecodeError as e:
    raise UserError(f'{what}={path!r} is not JSON: {e}.') from None


def _profile(path: str, what: str):
  from earl_jax.errors import UserError
  from earl_jax.profiling.table import Profile

  data = _load(path, what)
  try:
    return Profile.from_json(data)
  except (KeyError, TypeError, ValueError) as e:
    raise UserError(f'{what}={path!r} is not a profile (experiments/profile.py): {e}.') from None


def _fmt(x, pct=True) -> str:
  if x is None:
    return '-'
  return f'{x:.1%}' if pct else f'{x}'


def main(argv):
  del argv
  from earl_jax.errors import UserError
  from earl_jax.profiling import regret
  from earl_jax.profiling.table import Profile

  summary_path = os.path.join(_RUN.value, 'summary.json')
  summary = _load(summary_path, '--run')
  if 'decisions' not in summary:
    raise UserError(f'--run={_RUN.value!r}: {summary_path} holds no selector decisions.')
  truth = _profile(_PROFILE.value, '--profile')
  other = _profile(_PROFILE_B.value, '--profile_b') if _PROFILE_B.value else None
  measured = Profile.from_json(summary['profile']) if summary.get('profile') else None
  for name, profile in (('--profile', truth), ('--profile_b', other)):
    differs = regret.setup_differences(measured, profile) if measured and profile else []
    if differs:
      raise UserError(
        f'{name} was taken on another setup than the run ({"; ".join(differs)}, run vs profile): '
        'take the ground truth where the run ran (python -m experiments.profile --rounds=3).'
      )
  rows = regret.per_step(summary['decisions'], truth, other)
  if not rows:
    raise UserError(f'--run={_RUN.value!r} has no decisions to score.')
  stages = regret.by_stage(rows)
  within = regret.reach(rows)
  errors = regret.model_error(measured, truth, within) if measured is not None else {}
  speed = regret.drift(measured, truth) if measured is not None else None
  drifted = regret.model_error(measured, truth, within, scale=speed) if speed else {}
  result = {
    'run': os.path.abspath(_RUN.value),
    'profile': os.path.abspath(_PROFILE.value),
    'profile_share': summary.get('profile_share'),
    'wall_s': summary.get('wall_s'),
    'stages': stages,
    'model_error': errors,
    'drift': speed,
    'model_error_drift': drifted,
    'agreement': regret.agreement(measured, truth) if measured is not None else {},
    'profile_b': os.path.abspath(_PROFILE_B.value) if _PROFILE_B.value else None,
    'crossovers': regret.crossovers(truth, other, rows),
    'noise': regret.noise(truth, other) if other is not None else None,
    'steps': [{**r.__dict__, 'beyond_noise': r.beyond_noise} for r in rows],
  }
  out_dir = _OUT.value or _RUN.value
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'regret.json'), 'w') as f:
    json.dump(result, f, indent=1)
  png = _plot(rows, os.path.join(out_dir, 'regret.png'))
  print(_table(result))
  print(f'-> {os.path.join(out_dir, "regret.json")}, {png}')


def _table(result: dict) -> str:
  two = result['noise'] is not None
  lines = [
    f'{"stage":>10} {"steps":>5} {"mean":>7} {"max":>7} '
    + (f'{"beyond noise":>14} ' if two else '')
    + f'{"off best":>8} {"model only":>10} {"model err (median, cells)":>26} {"x drift":>8}'
  ]
  for stage, s in result['stages'].items():
    err = result['model_error'].get(stage)
    err_text = f'{err["median"]:.1%} ({err["cells"]})' if err else '-'
    drifted = result['model_error_drift'].get(stage)
    drift_text = f'{drifted["median"]:.1%}' if drifted else '-'
    agreed = f'{_fmt(s["beyond_noise_mean"])} / {_fmt(s["beyond_noise_max"])}'
    lines.append(
      f'{stage:>10} {s["steps"]:>5} {_fmt(s["mean"]):>7} {_fmt(s["max"]):>7} '
      + (f'{agreed:>14} ' if two else '')
      + f'{s["off_best"]:>8} {s["model_only"]:>10} {err_text:>26} {drift_text:>8}'
    )
  for stage, a in result['agreement'].items():
    lines.append(
      f"{stage}: the run timed {a['cells']} cells at {a['ratio']:.2f}x the profile's throughput "
      f'(median; |run/profile - 1| median {a["median"]:.1%}, max {a["max"]:.1%})'
    )
  if result['drift']:
    lines.append(
      f'drift: the run timed the cells both measured at {result["drift"]:.2f}x the profile '
      f"(median over every stage); 'x drift': the model error against the profile x that"
    )
  if result['profile_share'] is not None:
    lines.append(f'profile share of the run: {result["profile_share"]:.1%}')
  if result['noise'] is not None:
    n = result['noise']
    lines.append(
      f'two profiles: |a/b - 1| median {n["median"]:.1%}, p90 {n["p90"]:.1%} over {n["cells"]} '
      f'cells; same fastest layout in {n["best_agree"]:.0%} of the cells'
    )
  for c in result['crossovers']:
    other = c.get('margin_other')
    lines.append(
      f'crossover {c["stage"]} x{c["rows"]}: {c["before"]} @{c["from_bucket"]} -> {c["after"]} '
      f'@{c["bucket"]} by {_fmt(c["margin"])}'
      + ('' if other is None else f' (the other profile: {other:+.1%})')
      + (f'; the run chose {", ".join(c["run_chose"])}' if 'run_chose' in c else '')
    )
  return '\n'.join(lines)


def _plot(rows, path: str) -> str:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 3.5))
  for stage in dict.fromkeys(r.stage for r in rows):
    pts = [(r.step, 100 * r.regret) for r in rows if r.stage == stage and r.regret is not None]
    if pts:
      ax.plot(*zip(*pts), '.-', label=stage, alpha=0.8)
  ax.set_xlabel('decision (step)')
  ax.set_ylabel('regret (%)')
  ax.set_title('Best layout over the chosen one, minus 1 (offline profile)', fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


if __name__ == '__main__':
  runtime.run(main)
