"""How good a run's layout choices were, against an offline profile taken as the ground truth.

Per step and stage, the regret of a decision is the best layout's throughput over the chosen
one's, minus 1, both read from the offline profile at the cell the step ran (the decision's run
bucket and load): 0 when it chose the fastest layout, 0.25 when the fastest would have done 25%
more tokens per second. The model error is how far the cost model, fitted to the cells the run
measured, is from the offline profile on the cells the run did not measure.

  truth = Profile.from_json(json.load(open('profile.json')))
  summary = json.load(open('runs/default/summary.json'))
  rows = regret.per_step(summary['decisions'], truth)     # [StepRegret(stage, step, ...)]
  regret.by_stage(rows)                                   # {'rollout': {'mean': .., 'max': ..}}
  regret.model_error(Profile.from_json(summary['profile']), truth)
  regret.agreement(Profile.from_json(summary['profile']), truth)   # the run's timings vs truth's
  regret.setup_differences(Profile.from_json(summary['profile']), truth)  # [] where comparable
"""

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from earl_jax.config import ModelConfig
from earl_jax.profiling import cost_model
from earl_jax.profiling.table import Profile
from earl_jax.stage import Stage


@dataclasses.dataclass(frozen=True)
class StepRegret:
  """One decision against the ground truth (`regret` None: the truth lacks the chosen cell)."""

  stage: str
  step: int
  bucket: int
  rows: int
  chosen: str
  best: str | None
  measured: bool
  regret: float | None
  regret_other: float | None = None  # against a second profile of the same setup, if given

  @property
  def beyond_noise(self) -> float | None:
    """The regret both profiles agree on (the smaller of the two): 0 where the chosen layout is
    the fastest in either, since then the two profiles' run-to-run noise decides the ranking."""
    if self.regret is None or self.regret_other is None:
      return None
    return min(self.regret, self.regret_other)


# The parts of a profile's key that make its figures another setup's: the machine and the model.
# (Candidates, buckets and loads may differ: a cell the truth lacks is scored as unknown.)
SETUP = ('hardware', 'model')


def setup_differences(run: Profile, truth: Profile) -> list[str]:
  """How the setup a run measured on differs from the one `truth` was profiled on, one
  'field: run vs truth' per differing field of `SETUP` (a field either key lacks is not
  compared): [] where the truth can judge the run. A profile of another machine ranks layouts
  by that machine's speeds, so its regret says nothing about the run's choices."""
  out = []
  for part in SETUP:
    mine, theirs = run.key.get(part), truth.key.get(part)
    if not isinstance(mine, Mapping) or not isinstance(theirs, Mapping):
      continue
    for field in sorted(mine.keys() & theirs.keys()):
      if mine[field] != theirs[field]:
        out.append(f'{part}.{field}: {mine[field]!r} vs {theirs[field]!r}')
  return out


def _timed(profile: Profile, stage: Stage, bucket: int, rows: int) -> dict[str, float]:
  """The layouts timed at (stage, bucket, rows) in `profile`, with their throughput."""
  out = {}
  for (s, b, r, name), cell in profile.cells.items():
    if s == stage and b == bucket and r == rows and cell.measured and cell.throughput:
      out[name] = cell.throughput
  return out


def _regret(profile: Profile, stage: Stage, bucket: int, rows: int, chosen: str):
  """(the fastest layout, the chosen one's regret) at a cell of `profile` (None: not timed)."""
  timed = _timed(profile, stage, bucket, rows)
  best = max(timed, key=timed.get) if timed else None
  return best, (timed[best] / timed[chosen] - 1 if chosen in timed else None)


def per_step(
  decisions: Iterable[Mapping[str, Any]], truth: Profile, other: Profile | None = None
) -> list[StepRegret]:
  """The regret of every committed decision (`Selector.log()` entries; refused ones skipped),
  at its run bucket and load, against `truth` (and against `other`, a second profile)."""
  out = []
  for d in decisions:
    if 'REFUSED' in d.get('reason', ''):
      continue
    stage = Stage.parse(d['stage'])
    bucket, rows, chosen = d['run_bucket'], d['rows'], d['config']
    best, value = _regret(truth, stage, bucket, rows, chosen)
    value_other = None if other is None else _regret(other, stage, bucket, rows, chosen)[1]
    out.append(
      StepRegret(
        str(stage), d['step'], bucket, rows, chosen, best, bool(d['measured']), value, value_other
      )
    )
  return out


def by_stage(rows: Sequence[StepRegret]) -> dict[str, dict[str, Any]]:
  """Per stage: steps, mean and max regret, steps not on the fastest layout, decisions on the
  model alone, steps whose chosen cell the truth lacks, and (with a second profile) the mean and
  max of the regret beyond the two profiles' noise (`StepRegret.beyond_noise`)."""
  out = {}
  for stage in dict.fromkeys(r.stage for r in rows):
    mine = [r for r in rows if r.stage == stage]
    known = [r.regret for r in mine if r.regret is not None]
    agreed = [r.beyond_noise for r in mine if r.beyond_noise is not None]
    out[stage] = {
      'steps': len(mine),
      'mean': statistics.fmean(known) if known else None,
      'max': max(known) if known else None,
      'off_best': sum(1 for r in mine if r.best is not None and r.chosen != r.best),
      'model_only': sum(1 for r in mine if not r.measured),
      'unknown': len(mine) - len(known),
      'beyond_noise_mean': statistics.fmean(agreed) if agreed else None,
      'beyond_noise_max': max(agreed) if agreed else None,
    }
  return out


def _shapes(profile: Profile):
  """The model and program shapes a profile was measured for (its key)."""
  spec = profile.key['spec']
  model = ModelConfig(**profile.key['model'])

  @dataclasses.dataclass(frozen=True)
  class Shapes:
    decode_tokens: int = spec['sampling']['max_new_tokens']
    chunk: int = spec['chunk']
    micro_batches: int = spec['micro_batches']

  return model, Shapes()


def reach(rows: Sequence[StepRegret]) -> dict[str, tuple[set[int], int]]:
  """Per stage: the loads its decisions ran at, and the longest run bucket they reached."""
  out: dict[str, tuple[set[int], int]] = {}
  for r in rows:
    loads, top = out.get(r.stage, (set(), 0))
    out[r.stage] = (loads | {r.rows}, max(top, r.bucket))
  return out


def model_error(
  measured: Profile,
  truth: Profile,
  within: Mapping[str, tuple[set[int], int]] | None = None,
  *,
  scale: float = 1.0,
) -> dict[str, dict[str, Any]]:
  """Per stage: the cost model fitted to `measured`'s cells against `truth` on every cell
  `measured` lacks (`within`: only at a stage's loads and up to its longest bucket, `reach`):
  the median and p90 of |model / (scale x truth) - 1|, and how many cells. `scale`: how much
  faster the machine ran for the run than for the truth (`drift`): the model predicts the run's
  speeds."""
  model, shapes = _shapes(truth)
  fitted = cost_model.CostModel.fit(measured, model=model, shapes=shapes)
  errors: dict[str, list[float]] = {}
  for (stage, bucket, rows, name), cell in truth.cells.items():
    if not (cell.measured and cell.throughput) or (stage, bucket, rows, name) in measured.cells:
      continue
    if str(stage) not in measured.key.get('candidates', {}):
      continue
    if within is not None:
      loads, top = within.get(str(stage), (set(), 0))
      if rows not in loads or bucket > top:
        continue
    est = fitted.cell(stage, bucket, rows, name)
    errors.setdefault(str(stage), []).append(abs(est.throughput / (scale * cell.throughput) - 1))
  out = {}
  for stage, errs in errors.items():
    errs = sorted(errs)
    out[stage] = {
      'cells': len(errs),
      'median': statistics.median(errs),
      'p90': errs[min(len(errs) - 1, int(0.9 * len(errs)))],
    }
  return out


def drift(measured: Profile, truth: Profile) -> float | None:
  """The median of run / truth throughput over every cell both timed, whatever the stage: how
  much faster the machine ran (above 1) for the run than for the truth, e.g. on another day
  (None: no cell in common)."""
  ratios = [
    cell.throughput / other.throughput
    for key, cell in measured.cells.items()
    if cell.measured
    and cell.throughput
    and (other := truth.cells.get(key)) is not None
    and other.throughput
  ]
  return statistics.median(ratios) if ratios else None


def agreement(measured: Profile, truth: Profile) -> dict[str, dict[str, Any]]:
  """Per stage: the run's own timings against the truth's on the cells both timed: how many,
  the median ratio run / truth (above 1: the run timed them faster), and the median and max of
  |run / truth - 1|. A ratio far from 1 on every layout alike is a bias of the run's timing (it
  inflates the model error against the truth, not the ranking); a spread is noise."""
  ratios: dict[str, list[float]] = {}
  for key, cell in measured.cells.items():
    other = truth.cells.get(key)
    if cell.measured and cell.throughput and other is not None and other.throughput:
      ratios.setdefault(str(key[0]), []).append(cell.throughput / other.throughput)
  return {
    stage: {
      'cells': len(rs),
      'ratio': statistics.median(rs),
      'median': statistics.median(abs(r - 1) for r in rs),
      'max': max(abs(r - 1) for r in rs),
    }
    for stage, rs in ratios.items()
  }


def crossovers(
  truth: Profile, other: Profile | None = None, steps: Sequence[StepRegret] = ()
) -> list[dict[str, Any]]:
  """Where the fastest layout of a stage changes between neighbouring buckets (at each load),
  with the winner's margin over the loser; with `other` (a second profile of the same setup),
  the margin there too (a crossover is real where both profiles agree on it); with a run's
  `steps`, the layouts the run chose at that stage, load and bucket (`run_chose`)."""
  out = []
  for stage in truth.stages:
    for rows in truth.rows_for(stage):
      prev = None
      for bucket in truth.buckets:
        timed = _timed(truth, stage, bucket, rows)
        if not timed:
          continue
        best = max(timed, key=timed.get)
        if prev is not None and best != prev[1]:
          entry = {
            'stage': str(stage),
            'rows': rows,
            'from_bucket': prev[0],
            'bucket': bucket,
            'before': prev[1],
            'after': best,
            'margin': timed[best] / timed[prev[1]] - 1 if prev[1] in timed else None,
          }
          if other is not None:
            there = _timed(other, stage, bucket, rows)
            if best in there and prev[1] in there:
              entry['margin_other'] = there[best] / there[prev[1]] - 1
          chose = {
            r.chosen
            for r in steps
            if r.stage == str(stage) and r.rows == rows and r.bucket == bucket
          }
          if chose:
            entry['run_chose'] = sorted(chose)
          out.append(entry)
        prev = (bucket, best)
  return out


def noise(a: Profile, b: Profile) -> dict[str, float]:
  """Run-to-run noise of two profiles of one setup: the median and p90 of |a / b - 1| over the
  cells both timed, and the share of (stage, bucket, rows) whose fastest layout they agree on."""
  diffs, agree, total = [], 0, 0
  for key, cell in a.cells.items():
    other = b.cells.get(key)
    if cell.measured and cell.throughput and other is not None and other.throughput:
      diffs.append(abs(cell.throughput / other.throughput - 1))
  for stage in a.stages:
    for rows in a.rows_for(stage):
      for bucket in a.buckets:
        ta, tb = _timed(a, stage, bucket, rows), _timed(b, stage, bucket, rows)
        if ta and tb:
          total += 1
          agree += max(ta, key=ta.get) == max(tb, key=tb.get)
  diffs.sort()
  return {
    'cells': len(diffs),
    'median': statistics.median(diffs) if diffs else 0.0,
    'p90': diffs[min(len(diffs) - 1, int(0.9 * len(diffs)))] if diffs else 0.0,
    'best_agree': agree / total if total else 1.0,
  }
