"""Decode throughput per layout, context bucket and load: the analogue of the paper's Fig. 3.

  python experiments/selector_heatmap.py --out=runs/selector_heatmap.json          # 'cpu' preset
  python experiments/selector_heatmap.py --preset=smoke --out=/tmp/h.json          # ~1 minute
  python scripts/plot_selector.py --json=runs/selector_heatmap.json --out=runs/selector_heatmap.png

Three separate measurement passes over the same grid (context bucket x number of responses x
candidate layout), each warmed up, repeated and reduced to a median by the profiler:

1. the *profile* the selector decides on (cached as JSON: a later run on the same setup reuses
   it, a file from another model or machine is refused);
2. the *cheaper profile*: buckets shortest first, a layout left unmeasured where the cost model
   fitted to the cells measured so far puts its upper bound below the best layout's lower bound
   (`--confidence` standard deviations; `profiling.cost_model`; the selector decides on the
   model there), as a run measures;
3. the *heatmap*, measured afresh in this run.

For every cell it reports each layout's decode TGS (tokens per device per second) in the
heatmap pass, OOM where XLA's per-device peak exceeds the budget (never run), the paper's Eq. 1
speedup between two layouts, the selector's choice and its heatmap TGS as a fraction of the best
measured. The run-to-run noise is the relative difference between the two passes for the same
(cell, layout); a cell whose top two layouts differ by less than the median noise is a tie.
The cheaper profile's choice is scored against the full profile's on the heatmap pass: within
the median noise when its TGS is at least (1 - noise) of the full one's. With `--growth` the same
three passes are made at `context_growth.py`'s load and budget, and both profiles decide its
schedule step by step (the choices only: that script runs the decode). It also prints, from the
analytic memory model, which of TP4 and TP8 fits Qwen2.5-72B on 8 x H100-80GB over the paper's
grid (too large to compile here).
"""

import dataclasses
import json
import os
import statistics
import time

from absl import flags

from earl_jax import runtime

_PRESET = flags.DEFINE_string(
  'preset', 'cpu', "Preset of experiments/configs/selector.py: 'cpu' or 'smoke'."
)
_BUDGET = flags.DEFINE_float(
  'budget_mib', None, 'Per-device budget in MiB (default: the preset).', lower_bound=1e-6
)
_CANDIDATES = flags.DEFINE_list(
  'candidates', None, "Layouts, e.g. 'dp8,dp2.tp4,tp8' (default: all)."
)
_FSDP = flags.DEFINE_bool('with_fsdp', None, 'Include fsdp layouts in the default candidates.')
_PROFILE = flags.DEFINE_string(
  'profile_cache',
  None,
  'Profile JSON to reuse or write (default: <out dir>/selector_profile_<preset>.json).',
)
_STATISTIC = flags.DEFINE_enum('statistic', 'mean', ['mean', 'max', 'p95'], 'Selector statistic.')
_MARGIN = flags.DEFINE_float(
  'safety_margin', 0.0, 'Selector memory safety margin.', lower_bound=0.0, upper_bound=0.99
)
_GOAL = flags.DEFINE_float(
  'goal', 0.03, "The choice must be within this fraction of the cell's best."
)
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', 8, 'Fake CPU devices when there is no accelerator.', lower_bound=1
)
_CONFIDENCE = flags.DEFINE_float(
  'confidence',
  2.0,
  "The cheaper profile: a layout is not measured where the cost model's upper bound for it is "
  "below the best layout's lower bound, at this many standard deviations "
  '(selector.profile.confidence).',
  lower_bound=0.0,
)
_GROWTH = flags.DEFINE_bool(
  'growth',
  None,
  "Also compare the two profiles' choices on context_growth.py's schedule (default: with the "
  "'cpu' preset, not the quick 'smoke').",
)
_OUT = flags.DEFINE_string('out', 'runs/selector_heatmap.json', 'Results JSON.')


def _speedup(a, b):
  if a is None or b is None:
    return None
  return 100.0 * (b - a) / a


def _h100_72b_table():
  """TP4 vs TP8 for Qwen2.5-72B on 8 x H100-80GB (analytic, fused attention)."""
  from earl_jax.config import ModelConfig, ParallelConfig
  from earl_jax.profiling import analytic
  from earl_jax.stage import Stage

  cfg = ModelConfig.preset('qwen2.5-72b')
  budget = int(0.9 * 80e9)
  coeff = analytic.Coefficients.fused_attention()
  layouts = {'TP4': ParallelConfig(dp=2, tp=4), 'TP8': ParallelConfig(tp=8)}
  rows = []
  for ctx in (1024, 2048, 4096, 8192, 16384, 32768):
    for n in (8, 16, 32, 64, 128):
      rec = {'context': ctx, 'responses': n}
      for name, pc in layouts.items():
        need = analytic.estimate(Stage.ROLLOUT, cfg, pc, ctx, n, coefficients=coeff).total
        rec[name] = {'need_gb': need / 1e9, 'fits': need <= budget}
      rows.append(rec)
  return {
    'model': 'qwen2.5-72b',
    'budget_gb': budget / 1e9,
    'weights_gb_per_device': {
      k: analytic.weight_bytes_per_device(cfg, pc) / 1e9 for k, pc in layouts.items()
    },
    'kv_capacity_tokens': {
      k: analytic.kv_capacity_tokens(cfg, pc, budget) for k, pc in layouts.items()
    },
    'cells': rows,
  }


def _profile_config(bench, *, rows, budget, candidates, with_fsdp):
  from earl_jax.profiling.profiler import ProfileGrid
  from earl_jax.stage import Stage

  return ProfileGrid(
    stages=(Stage.ROLLOUT,),
    buckets=bench.buckets,
    rows=rows,
    budget_bytes=budget,
    candidates=candidates,
    with_fsdp=with_fsdp,
    measure=bench.measure,
    spec=bench.spec,
  )


def _passes(model, pconfig, exe, cache):
  """Three measurements of the same grid: the full profile (cached), the cheaper one (the prior
  rules layouts out, buckets shortest first; never cached) and the heatmap, measured afresh."""
  from earl_jax.profiling import profiler
  from earl_jax.profiling import table as profile_lib

  key = profiler.profile_key(model, pconfig, profiler.default_candidates(model, pconfig))
  reused = profile_lib.load_cached(cache, key) is not None
  out, seconds = {}, {}
  for name, kwargs in (
    ('full', {'cache_path': cache}),
    ('cheap', {'confidence': _CONFIDENCE.value}),
    ('heat', {}),
  ):
    t0 = time.perf_counter()
    out[name] = profiler.run(model, pconfig, executables=exe, **kwargs)
    seconds[name] = time.perf_counter() - t0
  return out, seconds, reused


def _noise(heat, profile):
  """Run-to-run noise: the relative difference of the same (cell, layout) in two passes (median,
  p90)."""
  diffs = []
  for key, cell in heat.cells.items():
    other = profile.cells.get(key)
    if other is not None and cell.throughput and other.throughput:
      diffs.append(
        abs(cell.throughput - other.throughput) / (0.5 * (cell.throughput + other.throughput))
      )
  if not diffs:
    return 0.0, 0.0
  return statistics.median(diffs), sorted(diffs)[int(0.9 * (len(diffs) - 1))]


def _timed_cells(profile) -> int:
  return sum(c.measured and not c.oom for c in profile.cells.values())


def _choice(sel_cfg, bench, profile, model, bucket, n):
  """The selector's layout name on `profile` for one cell (None, and why, when nothing fits)."""
  from earl_jax.programs import memory
  from earl_jax.selector.selector import Selector, StepStats
  from earl_jax.stage import Stage

  sel = Selector(
    sel_cfg, buckets=bench.buckets, rows=bench.rows, profile=profile, model=model, spec=bench.spec
  )
  try:
    d = sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=(bucket,), num_responses=n))
  except memory.InfeasibleError as e:
    return None, str(e)
  return d.config.name, d.reason


def _cell(bench, names, passes, sel_cfg, model, noises, bucket, n):
  """One heatmap cell: every layout's heatmap TGS, the full and the cheaper profile's choices."""
  from earl_jax.programs import memory
  from earl_jax.stage import Stage

  heat, profile = passes['heat'], passes['full']
  noise, noise_p90 = noises
  a, b = bench.compare
  tgs = {c: heat.cell(Stage.ROLLOUT, bucket, n, c).throughput for c in names}
  need = {c: heat.cell(Stage.ROLLOUT, bucket, n, c).peak_bytes for c in names}
  ranked = sorted((v, c) for c, v in tgs.items() if v is not None)[::-1]
  rec = {
    'bucket': bucket,
    'responses': n,
    'tgs': tgs,
    'profile_tgs': {c: profile.cell(Stage.ROLLOUT, bucket, n, c).throughput for c in names},
    'need_mib': {c: v / memory.MiB for c, v in need.items()},
    'oom': [c for c in names if tgs[c] is None],
    'speedup_pct': _speedup(tgs.get(a.name), tgs.get(b.name)),
  }
  rec['choice'], rec['reason'] = _choice(sel_cfg, bench, profile, model, bucket, n)
  rec['cheap_choice'], rec['cheap_reason'] = _choice(
    sel_cfg, bench, passes['cheap'], model, bucket, n
  )
  if not (ranked and rec['choice']):
    rec['status'] = 'none-fits' if not ranked else 'refused'
    return rec
  best_v, best_c = ranked[0]
  rec['best'] = best_c
  rec['fraction_of_best'] = (tgs[rec['choice']] or 0.0) / best_v
  rec['cheap_fraction_of_best'] = (tgs.get(rec['cheap_choice']) or 0.0) / best_v
  # The cheaper profile's choice against the full one's, on the heatmap pass: within the noise.
  rec['cheap_within_noise'] = rec['cheap_fraction_of_best'] >= rec['fraction_of_best'] * (1 - noise)
  gap = (ranked[0][0] - ranked[1][0]) / ranked[0][0] if len(ranked) > 1 else 1.0
  rec['top2_gap'] = gap
  # The rule: a cell whose top two layouts differ by less than the run-to-run noise is a
  # tie; we also record whether the choice itself is within the noise of the best.
  rec['choice_within_noise'] = rec['fraction_of_best'] >= 1 - noise
  rec['tie_at_p90_noise'] = gap < noise_p90
  if rec['fraction_of_best'] >= 1 - _GOAL.value:
    rec['status'] = 'ok'
  elif gap < noise:
    rec['status'] = 'tie'
  else:
    rec['status'] = 'miss'
  return rec


def _growth(bench, model, exe, out_dir, candidates, with_fsdp):
  """The growth benchmark's schedule decided on the full and on the cheaper profile of its load
  and budget, each decision's layout scored by a fresh pass (`experiments/context_growth.py` runs
  the decode; this compares only the choices)."""
  from earl_jax.programs import memory
  from earl_jax.selector.selector import Selector, SelectorConfig

  budget_mib = bench.growth_budget_mib or bench.budget_mib
  budget = memory.device_budget(emulated=int(budget_mib * memory.MiB))
  pconfig = _profile_config(
    bench, rows=(bench.growth_rows,), budget=budget, candidates=candidates, with_fsdp=with_fsdp
  )
  cache = os.path.join(out_dir, f'selector_profile_{_PRESET.value}_growth.json')
  passes, seconds, _ = _passes(model, pconfig, exe, cache)
  noise, noise_p90 = _noise(passes['heat'], passes['full'])
  sel_cfg = SelectorConfig(
    budget_mib=budget / memory.MiB, statistic=_STATISTIC.value, safety_margin=_MARGIN.value
  )
  sels = {
    name: Selector(
      sel_cfg,
      buckets=bench.buckets,
      rows=bench.growth_rows,
      profile=passes[name],
      model=model,
      spec=bench.spec,
    )
    for name in ('full', 'cheap')
  }
  steps = _growth_steps(bench, sels, passes['heat'], noise)
  return {
    'responses': bench.growth_rows,
    'budget_mib': budget / memory.MiB,
    'noise_median': noise,
    'noise_p90': noise_p90,
    'timed_cells': {k: _timed_cells(v) for k, v in passes.items()},
    'pass_s': seconds,
    'steps': steps,
    'same_choice': sum(s['full']['choice'] == s['cheap']['choice'] for s in steps),
    'cheap_within_noise': sum(s['cheap_within_noise'] for s in steps),
    # Seconds per token and device over the schedule, on each profile's choices.
    'time_ratio_cheap_to_full': _schedule_s(steps, 'cheap') / _schedule_s(steps, 'full'),
  }


def _growth_steps(bench, sels, heat, noise):
  """Each step of the growth schedule (context_growth.py's per-row contexts, seed 0) decided by
  both selectors, and each choice's TGS in the fresh pass at the bucket it runs."""
  import numpy as np

  from earl_jax.programs import memory
  from earl_jax.selector.selector import StepStats
  from earl_jax.stage import Stage

  rng = np.random.RandomState(0)
  steps = []
  for mean in bench.growth_schedule:
    lo, hi = mean * (1 - bench.growth_spread), mean * (1 + bench.growth_spread)
    lengths = tuple(int(x) for x in rng.uniform(lo, hi, bench.growth_rows))
    stats = StepStats(episode_lengths=lengths, num_responses=bench.growth_rows)
    rec = {'mean_context': mean}
    for name, sel in sels.items():
      try:
        d = sel.decide(Stage.ROLLOUT, stats)
      except memory.InfeasibleError:
        rec[name] = {'choice': None, 'run_bucket': None, 'tgs': 0.0}
        continue
      tgs = heat.cell(Stage.ROLLOUT, d.run_bucket, d.rows, d.config).throughput or 0.0
      rec[name] = {'choice': d.config.name, 'run_bucket': d.run_bucket, 'tgs': tgs}
    rec['cheap_within_noise'] = rec['cheap']['tgs'] >= rec['full']['tgs'] * (1 - noise)
    steps.append(rec)
  return steps


def _schedule_s(steps, name) -> float:
  return sum(1.0 / s[name]['tgs'] if s[name]['tgs'] else float('inf') for s in steps)


def _grid(bench, model, passes, sel_cfg):
  """Every heatmap cell, the run-to-run noise, and the cheaper profile's agreement."""
  from earl_jax.stage import Stage

  profile = passes['full']
  names = [c.name for c in profile.candidates(Stage.ROLLOUT)]
  noise, noise_p90 = _noise(passes['heat'], profile)
  spreads = [c.spread for c in passes['heat'].cells.values() if c.spread is not None]
  cells = [
    _cell(bench, names, passes, sel_cfg, model, (noise, noise_p90), bucket, n)
    for bucket in bench.buckets.lengths
    for n in bench.rows
  ]
  counts = {
    s: sum(c['status'] == s for c in cells) for s in ('ok', 'tie', 'miss', 'none-fits', 'refused')
  }
  scored = [c for c in cells if 'cheap_within_noise' in c]
  return {
    'candidates': names,
    'buckets': list(bench.buckets.lengths),
    'responses': list(bench.rows),
    'decode_tokens': bench.decode_tokens,
    'chunk': bench.chunk,
    'measure': dataclasses.asdict(bench.measure),
    'compare': [a.name for a in bench.compare],
    'statistic': _STATISTIC.value,
    'goal': _GOAL.value,
    'noise_median': noise,
    'noise_p90': noise_p90,
    'within_pass_spread_median': statistics.median(spreads) if spreads else None,
    'cells': cells,
    'counts': counts,
    'goal_met': counts['miss'] == 0 and counts['refused'] == 0,
    'cheap': {
      'confidence': _CONFIDENCE.value,
      'timed_cells': {k: _timed_cells(v) for k, v in passes.items()},
      'same_choice': sum(c['cheap_choice'] == c['choice'] for c in scored),
      'within_noise': sum(c['cheap_within_noise'] for c in scored),
      'scored': len(scored),
    },
  }


def _compiles(log):
  compiles = [r['compile_ms'] for r in log if 'compile_ms' in r]
  return {
    'compiles': len(compiles),
    'compile_ms_median': statistics.median(compiles) if compiles else None,
  }


def main(argv):
  del argv
  runtime.setup(cpu_devices=_CPU_DEVICES.value)
  import jax

  from earl_jax.config import ParallelConfig
  from earl_jax.programs import Executables, memory
  from earl_jax.selector.selector import ProfileSettings, SelectorConfig
  from earl_jax.stage import Stage
  from experiments.configs import selector as presets

  bench = presets.get_config(_PRESET.value)
  model = bench.model
  budget_mib = _BUDGET.value or bench.budget_mib
  budget = memory.device_budget(emulated=int(budget_mib * memory.MiB))
  candidates = bench.candidates
  if _CANDIDATES.value:
    candidates = tuple(ParallelConfig.parse(c) for c in _CANDIDATES.value)
  with_fsdp = bench.with_fsdp if _FSDP.value is None else _FSDP.value
  pconfig = _profile_config(
    bench, rows=bench.rows, budget=budget, candidates=candidates, with_fsdp=with_fsdp
  )
  out_dir = os.path.dirname(os.path.abspath(_OUT.value))
  cache = _PROFILE.value or os.path.join(out_dir, f'selector_profile_{_PRESET.value}.json')
  print(
    f'model {model.name} ({model.num_params / 1e6:.2f}M params), {len(jax.devices())} '
    f'{jax.devices()[0].platform} devices, budget {budget / memory.MiB:.1f} MiB per device'
  )
  with Executables(model, spec=bench.spec) as exe:
    passes, seconds, reused = _passes(model, pconfig, exe, cache)
    with_growth = _PRESET.value == 'cpu' if _GROWTH.value is None else _GROWTH.value
    growth = _growth(bench, model, exe, out_dir, candidates, with_fsdp) if with_growth else None
    compile_log = list(exe.log)
  sel_cfg = SelectorConfig(
    budget_mib=budget / memory.MiB,
    statistic=_STATISTIC.value,
    safety_margin=_MARGIN.value,
    profile=ProfileSettings(stages=(Stage.ROLLOUT,)),
  )
  result = {
    'preset': _PRESET.value,
    'model': model.name,
    'num_params': model.num_params,
    'devices': f'{len(jax.devices())} x {jax.devices()[0].platform}',
    'hardware': passes['full'].key['hardware'],
    'budget_mib': budget / memory.MiB,
    **_grid(bench, model, passes, sel_cfg),
    'profile_reused': reused,
    'profile_s': seconds['full'],
    'cheap_s': seconds['cheap'],
    'heatmap_s': seconds['heat'],
    **_compiles(compile_log),
    'growth': growth,
    'h100_72b': _h100_72b_table(),
  }
  os.makedirs(out_dir, exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=1)
  _print(result)


def _print_cheaper(r):
  ch, timed = r['cheap'], r['cheap']['timed_cells']
  print(
    f'cheaper profile (confidence {ch["confidence"]:g}): {timed["cheap"]} layouts timed against '
    f'{timed["full"]} in the full profile, {r["cheap_s"]:.0f} s against {r["profile_s"]:.0f} s; '
    f'same choice in {ch["same_choice"]}/{ch["scored"]} cells, within the median noise of the '
    f"full profile's choice (heatmap pass) in {ch['within_noise']}/{ch['scored']}"
  )
  g = r['growth']
  if g is None:
    return
  n = len(g['steps'])
  print(
    f'context growth ({g["responses"]} responses, {g["budget_mib"]:.1f} MiB): '
    f'{g["timed_cells"]["cheap"]} layouts timed against {g["timed_cells"]["full"]}; same choice '
    f'in {g["same_choice"]}/{n} steps, within the median noise ({g["noise_median"]:.1%}) of the '
    f"full profile's in {g['cheap_within_noise']}/{n}; time over the schedule on the cheaper "
    f"profile's choices / the full one's: {g['time_ratio_cheap_to_full']:.3f}"
  )
  for s in g['steps']:
    f, c = s['full'], s['cheap']
    print(
      f'  mean {s["mean_context"]:>5} | full {f["choice"]!s:>9}@{f["run_bucket"]!s:<5} '
      f'{f["tgs"]:8.1f} | cheaper {c["choice"]!s:>9}@{c["run_bucket"]!s:<5} {c["tgs"]:8.1f}'
    )


def _print(r):
  names = r['candidates']
  a, b = r['compare']
  print(
    f'\nDecode TGS (tokens/device/s), heatmap pass; OOM = over {r["budget_mib"]:.0f} MiB/device '
    f'(never run); Eq.1 = (TGS({b}) - TGS({a})) / TGS({a}).'
  )
  head = f'{"ctx":>5} {"resp":>4} | ' + ' '.join(f'{n:>9}' for n in names)
  head += f' | {"Eq.1 %":>7} | {"choice":>9} {"of best":>7} {"top2 gap":>8} status'
  head += f' | {"cheaper":>9} {"of best":>7}'
  print(head)
  print('-' * len(head))
  for c in r['cells']:
    vals = ' '.join(f'{"OOM":>9}' if c['tgs'][n] is None else f'{c["tgs"][n]:9.1f}' for n in names)
    sp = '      -' if c['speedup_pct'] is None else f'{c["speedup_pct"]:+7.1f}'
    frac = f'{c["fraction_of_best"]:7.3f}' if 'fraction_of_best' in c else '      -'
    gap = f'{c["top2_gap"]:8.3f}' if 'top2_gap' in c else '       -'
    cheap = f'{c["cheap_fraction_of_best"]:7.3f}' if 'cheap_fraction_of_best' in c else '      -'
    print(
      f'{c["bucket"]:>5} {c["responses"]:>4} | {vals} | {sp} | {c["choice"]!s:>9} {frac} {gap} '
      f'{c["status"]:>6} | {c["cheap_choice"]!s:>9} {cheap}'
    )
  print(
    f'\nrun-to-run noise (profile pass vs heatmap pass, same cell and layout): median '
    f'{r["noise_median"]:.1%}, p90 {r["noise_p90"]:.1%}; within-pass spread (IQR/median) '
    f'median {r["within_pass_spread_median"] or 0:.1%}'
  )
  n = len(r['cells'])
  cnt = r['counts']
  ties_near = sum(c['status'] == 'tie' and c.get('choice_within_noise') for c in r['cells'])
  miss_p90 = sum(c['status'] == 'miss' and c.get('tie_at_p90_noise') for c in r['cells'])
  print(
    f'selector within {r["goal"]:.0%} of the best: {cnt["ok"]}/{n} cells; ties (top two closer than '
    f'the median noise) {cnt["tie"]} (choice within the noise of the best in {ties_near}); misses '
    f'{cnt["miss"]} ({miss_p90} of them closer than the p90 noise); nothing fits '
    f'{cnt["none-fits"]} -> goal {"MET" if r["goal_met"] else "NOT MET"}'
  )
  print(
    f'profile pass {r["profile_s"]:.0f} s ({"reused from cache" if r["profile_reused"] else "measured"}), '
    f'heatmap pass {r["heatmap_s"]:.0f} s, {r["compiles"]} compiles (median '
    f'{r["compile_ms_median"] or 0:.0f} ms)'
  )
  _print_cheaper(r)
  h = r['h100_72b']
  print(
    f'\nQwen2.5-72B on 8 x H100-80GB (analytic, fused attention, budget {h["budget_gb"]:.0f} GB/GPU): '
    f'weights/GPU TP4 {h["weights_gb_per_device"]["TP4"]:.1f} GB, TP8 '
    f'{h["weights_gb_per_device"]["TP8"]:.1f} GB; K/V capacity TP4 '
    f'{h["kv_capacity_tokens"]["TP4"] / 1e6:.2f}M tokens, TP8 {h["kv_capacity_tokens"]["TP8"] / 1e6:.2f}M'
  )
  ctxs = sorted({c['context'] for c in h['cells']})
  resps = sorted({c['responses'] for c in h['cells']})
  print(
    f'{"ctx":>6} | ' + ' '.join(f'{n:>13}' for n in resps) + '   (need GB per GPU TP4/TP8, * = OOM)'
  )
  for ctx in ctxs:
    row = []
    for n in resps:
      c = next(x for x in h['cells'] if x['context'] == ctx and x['responses'] == n)
      t4 = f'{c["TP4"]["need_gb"]:.0f}{"" if c["TP4"]["fits"] else "*"}'
      t8 = f'{c["TP8"]["need_gb"]:.0f}{"" if c["TP8"]["fits"] else "*"}'
      row.append(f'{t4 + "/" + t8:>13}')
    print(f'{ctx:>6} | ' + ' '.join(row))


if __name__ == '__main__':
  runtime.run(main)
