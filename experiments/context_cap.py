"""Fig. 1 of the paper and EARL's fix: the main job under a hard context cap, and without one.

  python experiments/context_cap.py --out_dir=runs/fig1                 # the `think` preset, cap 640
  python experiments/context_cap.py --preset=default --opponent=greedy --cap=384 --out_dir=runs/fig1_survival
  python experiments/context_cap.py --preset=smoke --cap=96 --steps=4   # seconds (CI)

Trains the main job (`experiments/train.py`) twice from the same seed, one after the other:
  capped  the buckets stop at `--cap` tokens, as a system whose layout runs out of memory there
          (the paper's 8K limit): an episode that would outgrow it is truncated at the cap and
          its turn forfeited as invalid, as in the paper ("low-quality data" in the rollouts);
  earl    the preset as it is: buckets up to its largest, the selector choosing each stage's
          layout per bucket.
A forfeited turn costs what an invalid reply costs (`--invalid_penalty`; the presets' is -1, as
much as a lost game): it counts in the logged return and win rate. By default both runs keep the
truncated episodes out of the update (`ExperimentConfig.overlong_filter`), as the overlong
filters of DAPO, ROLL, rLLM and SkyRL do, so nothing teaches the capped policy that the
cap exists: it goes on thinking longer, more and more of its episodes are truncated, and its
return falls, as the paper's does. With `--nooverlong_filter` the capped run trains on the
forfeits, and its policy learns to stay under the cap: its return stalls instead of falling.

The task must make contexts grow as the policy learns, as the paper's reasoning does. The
`think` preset (the default here) does it inside each move: before a move the policy thinks up to
3 times, a turn and one more ply of minimax search each (`EnvConfig.think_depth`), and deeper
thoughts win more against the 2-ply minimax opponent, so the tokens per move and the episodes
grow as it learns to think. In the `default` preset contexts grow only with survival (whole-board
observations, a reward per legal move; against `--opponent=greedy` episodes last longer once the
policy plays legal moves): there, trained on its forfeits (stop 22's runs), the capped policy
learned to keep its games under the cap, and its return stalled instead of falling.

Writes fig1.json and fig1.png with the paper's three panels for both runs (turn-level context as
tokens per move, thoughts included; episode-level context against the cap; return) and prints
the key numbers: the step at which the capped run's episodes reach the cap, the share truncated,
each run's return before and after that step, and the largest fall of its return and win rate
over 5 steps from that step on (the peak before it and the low it reaches).

Extra `--config.*` overrides go to both runs through `--override`, e.g.
`--override=--config.rollout.num_episodes=32`. The EARL run does not depend on `--cap`: with
`--reuse_earl` a sweep over caps into one `--out_dir` trains it once (it is kept when its recorded
command, `earl/command.json`, is this call's and it logged every step).
"""

import json
import math
import os
import subprocess
import sys

from absl import flags

from earl_jax import runtime
from earl_jax.errors import UserError

_PRESET = flags.DEFINE_string('preset', 'think', 'Preset of experiments/train.py.')
_CAP = flags.DEFINE_integer('cap', 640, 'Context cap (tokens) of the capped run.')
_STEPS = flags.DEFINE_integer('steps', 60, 'Steps of both runs.')
_OPPONENT = flags.DEFINE_string(
  'opponent', '', "Opponent of both runs' training and evaluation ('': the preset's)."
)
_INVALID = flags.DEFINE_float(
  'invalid_penalty',
  float('nan'),
  'Reward of a reply the game cannot accept, and so of a turn forfeited at the cap, in both '
  "runs (unset: the preset's, -1, as much as a loss).",
)
_THINK = flags.DEFINE_integer(
  'think_depth',
  None,
  "Both runs' EnvConfig.think_depth: how deep a policy may think before a move, a turn per ply "
  "(unset: the preset's, no thinking).",
)
_FILTER = flags.DEFINE_bool(
  'overlong_filter',
  True,
  "Both runs' ExperimentConfig.overlong_filter: keep the episodes truncated at the cap out of "
  'the update (overlong filtering); --nooverlong_filter trains on their forfeit instead.',
)
_OUT_DIR = flags.DEFINE_string('out_dir', 'runs/fig1', 'Where both runs and the figure go.')
_REUSE_EARL = flags.DEFINE_bool(
  'reuse_earl',
  False,
  'Keep a finished EARL run in <out_dir>/earl whose command is the one this call would run (the '
  'EARL run does not depend on --cap, so a sweep over caps trains it once); otherwise train it.',
)
_OVERRIDES = flags.DEFINE_multi_string(
  'override', [], "A '--config.a.b=value' override for both runs (repeatable)."
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND_FILE = 'command.json'  # in each run's workdir: the train command that made it
SMOOTH = 5  # steps of the trailing mean in the summary's peak and fall


def _first_turn_tokens(config) -> int:
  """Tokens of an episode's first turn: its prompt and the longest reply."""
  from earl_jax.envs.registry import make_env
  from earl_jax.models import tokenizer as tokenizer_lib

  tok = tokenizer_lib.load_tokenizer(config.model_dir or config.tokenizer)
  obs = make_env(config.env).reset(1, seed=0)[0]
  return len(tok.turn_prompt_ids(obs, first=True)) + config.rollout.sampling.max_new_tokens


def capped_buckets(lengths: tuple[int, ...], cap: int, first_turn: int) -> tuple[int, ...]:
  """The preset's buckets below the cap, then the cap itself."""
  if cap < first_turn:
    raise UserError(
      f'--cap {cap}: expected at least the first turn of an episode ({first_turn} tokens: its '
      'prompt and reply)'
    )
  if cap >= lengths[-1]:
    raise UserError(f'--cap {cap}: expected less than the largest bucket, {lengths[-1]}')
  return (*[b for b in lengths if b < cap], cap)


def _train(name: str, args: list[str], out_dir: str, *, keep_if_done: int | None = None) -> str:
  """Trains one run into <out_dir>/<name> (an earlier run there is moved aside), and records its
  command there. `keep_if_done`: a number of steps; a run there of the same command that logged
  them all is kept instead of trained again."""
  workdir = os.path.join(out_dir, name)
  cmd = [sys.executable, '-m', 'experiments.train', f'--workdir={workdir}', '--move_aside', *args]
  if keep_if_done is not None and _finished(workdir, cmd[1:], keep_if_done):
    print(f'== {name}: kept {workdir} (a finished run of the same command)', flush=True)
    return os.path.join(workdir, 'metrics.jsonl')
  print(f'== {name}: ' + ' '.join(['python', *cmd[1:]]), flush=True)
  rc = subprocess.run(cmd, cwd=ROOT).returncode
  if rc:
    raise SystemExit(f'error: the {name} run failed (exit code {rc}); see its output above')
  with open(os.path.join(workdir, COMMAND_FILE), 'w') as f:
    json.dump(cmd[1:], f)
  return os.path.join(workdir, 'metrics.jsonl')


def _finished(workdir: str, cmd: list[str], steps: int) -> bool:
  """Whether `workdir` holds a run of exactly `cmd` (as `_train` recorded it) that logged every
  one of its `steps` steps."""
  try:
    with open(os.path.join(workdir, COMMAND_FILE)) as f:
      recorded = json.load(f)
    logged = set(_series(os.path.join(workdir, 'metrics.jsonl'))['step'])
  except (OSError, ValueError):
    return False
  return recorded == cmd and logged >= set(range(1, steps + 1))


def _series(path: str) -> dict[str, list]:
  from earl_jax.run import metrics

  rows = [r for r in metrics.read_jsonl(path) if 'ctx/turn_len_mean' in r]
  keys = ('ctx/turn_len_mean', 'ctx/move_len_mean', 'ctx/thoughts_per_move',
          'ctx/episode_len_mean', 'ctx/episode_len_max', 'return_mean', 'win_rate',
          'overflow_rate', 'plan/rollout', 'plan/train')  # fmt: skip
  return {'step': [r['step'] for r in rows], **{k: [r.get(k) for r in rows] for k in keys}}


def turn_level(run: dict) -> list[float]:
  """Panel (a): tokens per move, its thinking turns included (the turn-level length of runs
  logged before thinking existed)."""
  moves = run.get('ctx/move_len_mean') or []
  return moves if moves and None not in moves else run['ctx/turn_len_mean']


def _mean(xs):
  return sum(xs) / len(xs) if xs else None


def smoothed(xs: list[float], window: int = SMOOTH) -> list[float]:
  """The trailing mean of each step's return over the last `window` steps (fewer at the start)."""
  return [_mean(xs[max(0, i + 1 - window) : i + 1]) for i in range(len(xs))]


def peak_and_fall(steps: list[int], values: list[float], start: int | None = None) -> dict:
  """The largest fall of the smoothed `values` (a return or a win rate) from step `start` on
  (None: the first): the peak before it, the low it falls to (and their steps), and the last
  value. A series that never falls reports its best value as both peak and low, and a fall of 0."""
  s = smoothed(values)
  first = next((j for j, step in enumerate(steps) if step >= start), 0) if start else 0
  peak = low = best = first  # best: the best value from `first` up to step j
  for j in range(first, len(s)):
    best = j if s[j] > s[best] else best
    if s[best] - s[j] > s[peak] - s[low]:
      peak, low = best, j
  if s[peak] == s[low]:
    peak = low = max(range(first, len(s)), key=s.__getitem__)
  return {'window': SMOOTH, 'peak': s[peak], 'peak_step': steps[peak], 'low_after_peak': s[low],
          'low_step': steps[low], 'fall': s[peak] - s[low], 'last': s[-1]}  # fmt: skip


def summarize(capped: dict, earl: dict, cap: int) -> dict:
  """The step at which the capped run's episodes reach the cap (the first truncated one), each
  run's return before and after it, the largest fall of each run's smoothed return and win rate,
  and its largest share of truncated episodes."""
  # The first step in which an episode of the capped run was truncated at the cap.
  reach = next((s for s, o in zip(capped['step'], capped['overflow_rate']) if o), None)
  out = {'cap': cap, 'capped_reaches_cap_at_step': reach}
  for name, run in (('capped', capped), ('earl', earl)):
    most = max(range(len(run['step'])), key=run['overflow_rate'].__getitem__)
    before = [r for s, r in zip(run['step'], run['return_mean']) if reach is None or s < reach]
    after = [r for s, r in zip(run['step'], run['return_mean']) if reach is not None and s >= reach]
    last = run['return_mean'][-max(1, len(run['step']) // 4) :]
    out[name] = {
      'return_before': _mean(before),
      'return_after': _mean(after),
      'return_last_quarter': _mean(last),
      'overflow_rate_after': _mean(
        [o for s, o in zip(run['step'], run['overflow_rate']) if reach is not None and s >= reach]
      ),
      'overflow_rate_max': run['overflow_rate'][most],
      'overflow_rate_max_step': run['step'][most],
      # Falls from the step the cap is reached (the smoothing window reaches back before it).
      'smoothed': peak_and_fall(run['step'], run['return_mean'], start=reach),
      'smoothed_win_rate': peak_and_fall(run['step'], run['win_rate'], start=reach),
      'episode_len_mean_last': run['ctx/episode_len_mean'][-1],
      'turn_len_first': turn_level(run)[0],
      'turn_len_last': turn_level(run)[-1],
      'thoughts_per_move_last': (run.get('ctx/thoughts_per_move') or [None])[-1],
      'rollout_layouts': sorted({p.split('@')[0] for p in run['plan/rollout'] if p}),
      'train_layouts': sorted({p.split('@')[0] for p in run['plan/train'] if p}),
    }
  return out


def plot(capped: dict, earl: dict, cap: int, out: str) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  runs = (('EARL (no cap)', earl, '#d94801'), (f'capped at {cap} tokens', capped, '#555555'))
  for label, run, color in runs:
    axes[0].plot(run['step'], turn_level(run), color=color, label=label)
    axes[1].plot(run['step'], run['ctx/episode_len_mean'], color=color, label=f'{label}: mean')
    axes[1].plot(run['step'], run['ctx/episode_len_max'], ':', color=color, label=f'{label}: max')
    axes[2].plot(run['step'], run['return_mean'], color=color, alpha=0.3, lw=1)
    axes[2].plot(run['step'], smoothed(run['return_mean']), color=color, label=label)
  axes[1].axhline(cap, color='red', lw=1, ls='--', label='cap')
  share = axes[1].twinx()  # what the cap truncates: the capped run's truncated episodes
  share.fill_between(capped['step'], capped['overflow_rate'], color='#555555', alpha=0.12, lw=0)
  share.set_ylim(0, 4)  # the shading stays in the lower quarter of the panel
  share.set_yticks([0, 0.5, 1])
  share.set_ylabel('capped run: share truncated (shaded)', fontsize=8)
  titles = (
    '(a) turn-level context length (tokens per move)',
    '(b) episode-level context length',
    '(c) return',
  )
  for ax, title in zip(axes, titles):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel('step')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('tokens')
  axes[1].set_ylabel('tokens')
  axes[2].set_ylabel(f'mean return (thin: per step; thick: last {SMOOTH} steps)')
  axes[1].legend(fontsize=7)
  axes[2].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=130)
  plt.close(fig)


def main(argv):
  del argv
  runtime.setup(cpu_devices=8)
  from earl_jax import config_cli
  from experiments.configs import train as presets

  if _PRESET.value not in presets.PRESETS:
    raise UserError(f'--preset {_PRESET.value}: expected one of {", ".join(presets.PRESETS)}')
  config = presets.PRESETS[_PRESET.value]()
  if _STEPS.value < 1:
    raise UserError(f'--steps {_STEPS.value}: expected a positive number of steps')
  overrides = list(_OVERRIDES.value)
  if _OPPONENT.value:
    overrides += [f'--config.{e}.opponent={_OPPONENT.value}' for e in ('env', 'eval_env')]
  if not math.isnan(_INVALID.value):
    overrides += [f'--config.{e}.invalid_penalty={_INVALID.value}' for e in ('env', 'eval_env')]
  if _FILTER.value:
    overrides.append('--config.overlong_filter=true')
  if _THINK.value is not None:
    overrides += [f'--config.{e}.think_depth={_THINK.value}' for e in ('env', 'eval_env')]
  for text in overrides:  # checked here, in one line, before either run starts
    path, sep, value = text.removeprefix('--config.').partition('=')
    if not sep:
      raise UserError(f'--override {text}: expected --config.a.b=value')
    config = config_cli.apply_override(config, path, value)
  buckets = capped_buckets(config.buckets.lengths, _CAP.value, _first_turn_tokens(config))
  common = [f'--config={_PRESET.value}', *overrides, f'--config.steps={_STEPS.value}']
  out = _OUT_DIR.value
  os.makedirs(out, exist_ok=True)
  lengths = ','.join(map(str, buckets))
  keep = _STEPS.value if _REUSE_EARL.value else None
  earl = _series(_train('earl', common, out, keep_if_done=keep))
  cache = config.selector.profile.cache
  capped_args = [*common, f'--config.buckets.lengths={lengths}']
  if cache:  # its own profile cache: another bucket table is another profile
    root, ext = os.path.splitext(cache)
    capped_args.append(f'--config.selector.profile.cache={root}_cap{_CAP.value}{ext}')
  capped = _series(_train('capped', capped_args, out))
  summary = summarize(capped, earl, _CAP.value)
  report = {
    'experiment': 'context_cap',
    'preset': _PRESET.value,
    'overrides': overrides,
    'capped_buckets': list(buckets),
    'earl_buckets': list(config.buckets.lengths),
    'summary': summary,
    'runs': {'capped': capped, 'earl': earl},
  }
  with open(os.path.join(out, 'fig1.json'), 'w') as f:
    json.dump(report, f, indent=1)
  plot(capped, earl, _CAP.value, os.path.join(out, 'fig1.png'))
  s = summary
  reach = s['capped_reaches_cap_at_step']
  print(f"\ncap {_CAP.value} tokens: the capped run's longest episodes reach it at step {reach}")
  for name in ('capped', 'earl'):
    x = s[name]
    ret = lambda v: '-' if v is None else f'{v:+.3f}'  # noqa: E731
    share = '-' if x['overflow_rate_after'] is None else f'{x["overflow_rate_after"]:.0%}'
    print(
      f'  {name:6s} return before {ret(x["return_before"])}, after {ret(x["return_after"])}, '
      f'last quarter {ret(x["return_last_quarter"])}; truncated after: {share}; episode mean at '
      f'the end {x["episode_len_mean_last"]:.0f} tokens; rollout layouts '
      f'{", ".join(x["rollout_layouts"])}'
    )
    thoughts = x['thoughts_per_move_last']
    print(
      f'         tokens per move {x["turn_len_first"]:.1f} at the start, {x["turn_len_last"]:.1f} '
      f'at the end' + ('' if thoughts is None else f' ({thoughts:.2f} thoughts per move)')
    )
    if x['overflow_rate_max']:
      print(
        f'         truncated: {x["overflow_rate_max"]:.0%} of the episodes at most (step '
        f'{x["overflow_rate_max_step"]})'
      )
    for label, key, fmt in (
      ('return', 'smoothed', '+.3f'),
      ('win rate', 'smoothed_win_rate', '.3f'),
    ):
      pf = x[key]
      fall = (
        f'its largest fall: from {pf["peak"]:{fmt}} at step {pf["peak_step"]} to '
        f'{pf["low_after_peak"]:{fmt}} at step {pf["low_step"]}'
        if pf['fall'] > 0
        else f'never falls; peak {pf["peak"]:{fmt}} at step {pf["peak_step"]}'
      )
      print(f'         {label} over the last {pf["window"]} steps: {fall}; last {pf["last"]:{fmt}}')
  print(f'wrote {os.path.join(out, "fig1.json")} and fig1.png')


if __name__ == '__main__':
  runtime.run(main)
