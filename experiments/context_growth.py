"""Rollout throughput as contexts grow across steps: EARL-dynamic against every static layout.

  python experiments/context_growth.py --out=runs/context_growth.json           # 'cpu' preset
  python experiments/context_growth.py --preset=smoke --out=/tmp/g.json
  python scripts/plot_selector.py --json=runs/context_growth.json --out=runs/context_growth.png

A schedule of mean context lengths grows step by step (per-row contexts are spread around the
mean); every step decodes `calls_per_step x decode_tokens` tokens for each of the responses at
the bucket that holds its longest row. Runs:

* earl-dynamic: before each step the selector decides from the step's context statistics (the
  contexts the previous steps produced) with a start-up profile of the growth load (cached as
  JSON, like the heatmap's); it switches layout with a device-to-device reshard, and the
  executable and the weight move are precompiled in the background during the previous step
  (`Selector.lookahead`);
* static-<layout>: one layout for the whole run. A step whose program does not fit the budget
  (XLA memory analysis) is refused before it runs, and the run has FAILED there, as a training
  job that runs out of memory stops: it runs no later step and has no throughput over the
  schedule (the steps it completed are reported, never a throughput over them alone, which
  would leave out the hardest steps). It precompiles its next bucket in the background too, so
  both sides get the same compile help.

All runs advance in lockstep (step t of every run, in a rotating order, before step t + 1), so
that background load on a shared machine falls on all of them alike. Every run starts with an
empty executable cache (the persistent compilation cache on disk still applies). Time counts the
decode calls plus every stall (waiting for an executable, resharding), except the first step's
executable, a start-up cost every run pays alike. Reported per run: the step it failed at (if
any), steps completed, total time and throughput (tokens per device per second) of a run that
completed the schedule, and each switch's reshard, compile and stall ms.
"""

import json
import os
import statistics
import time

import numpy as np
from absl import flags

from earl_jax import runtime

_PRESET = flags.DEFINE_string(
  'preset', 'cpu', "Preset of experiments/configs/selector.py: 'cpu' or 'smoke'."
)
_BUDGET = flags.DEFINE_float(
  'budget_mib', None, 'Per-device budget in MiB (default: the preset).', lower_bound=1e-6
)
_PROFILE = flags.DEFINE_string(
  'profile_cache',
  None,
  'Profile JSON (default: <out dir>/selector_profile_<preset>.json, shared with the heatmap).',
)
_STATISTIC = flags.DEFINE_enum('statistic', 'mean', ['mean', 'max', 'p95'], 'Selector statistic.')
_MARGIN = flags.DEFINE_float(
  'safety_margin', 0.0, 'Selector memory safety margin.', lower_bound=0.0, upper_bound=0.99
)
_PASSES = flags.DEFINE_integer(
  'passes', None, 'Repeat every run; per-step medians are reported (default: the preset).'
)
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the per-row contexts.')
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', 8, 'Fake CPU devices when there is no accelerator.', lower_bound=1
)
_OUT = flags.DEFINE_string('out', 'runs/context_growth.json', 'Results JSON.')


def _schedule(bench, seed):
  rng = np.random.RandomState(seed)
  out = []
  for mean in bench.growth_schedule:
    lo, hi = mean * (1 - bench.growth_spread), mean * (1 + bench.growth_spread)
    out.append(tuple(int(x) for x in rng.uniform(lo, hi, bench.growth_rows)))
  return out


def _decode(entry, params, calls):
  """Runs `calls` decode calls (the step); returns milliseconds."""
  import jax

  from earl_jax.programs import builders

  args = builders.make_inputs(entry.program, params)
  jax.block_until_ready(args)
  t0 = time.perf_counter()
  for _ in range(calls):
    gen, cache = entry(*args)
    args = (args[0], cache, *args[2:])
  jax.block_until_ready((gen, cache))
  return 1e3 * (time.perf_counter() - t0)


class _Run:
  """One policy's run, advanced one step at a time (all runs move in lockstep, see main)."""

  def __init__(self, name, policy, bench, model, spec, master, budget, profile, sel_cfg):
    import jax

    from earl_jax.programs import Executables
    from earl_jax.selector.selector import Selector

    self.name, self.policy, self.bench = name, policy, bench
    self.budget, self.margin = budget, sel_cfg.safety_margin
    self.exe = Executables(model, spec=spec)
    self.params = jax.tree.map(lambda x: x.copy(), master)
    self.sel = (
      Selector(sel_cfg, buckets=bench.buckets, rows=bench.growth_rows, profile=profile)
      if policy == 'dynamic'
      else None
    )
    self.current = None
    self.bucket = None
    self.failed_at = None  # the step that did not fit: the run stops there
    self.steps, self.switches = [], []

  def step(self, t, lengths):
    from earl_jax.programs import memory, switch
    from earl_jax.selector.selector import StepStats
    from earl_jax.stage import Stage

    if self.failed_at is not None:
      return
    bench, exe = self.bench, self.exe
    R, calls = bench.growth_rows, bench.calls_per_step
    bucket = bench.buckets.bucket_for(max(lengths))
    rec = {'step': t, 'mean_context': float(np.mean(lengths)), 'bucket': bucket}
    if self.policy == 'dynamic':
      d = self.sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=lengths, num_responses=R))
      target, run_bucket = d.config, d.run_bucket
      rec['reason'] = d.reason
    else:
      target, run_bucket = self.policy, bucket
      entry = exe.get(exe.key(Stage.ROLLOUT, target, run_bucket, R))
      if not memory.fits(entry.memory.peak, self.budget, margin=self.margin):
        rec.update(config=target.name, refused=True, need_mib=entry.memory.peak / memory.MiB)
        self.steps.append(rec)
        self.failed_at = t
        return
    self.params, entry, sw = switch(
      Stage.ROLLOUT,
      self.params,
      exe,
      target,
      run_bucket,
      R,
      source=self.current,
      step=t,
      budget=self.budget,
    )
    # While this step runs, compile in the background what the next one probably needs (and,
    # for a new layout, the move of the weights onto it).
    if self.policy == 'dynamic':
      for key in self.sel.lookahead(d):
        exe.precompile(exe.key(*key), tree=self.params if key[1] != target else None)
    else:
      higher = [b for b in bench.buckets.lengths if b > run_bucket]
      if higher:
        exe.precompile(exe.key(Stage.ROLLOUT, target, higher[0], R))
    step_ms = _decode(entry, self.params, calls)
    first = all(s.get('refused') for s in self.steps)
    rec.update(
      config=target.name,
      refused=False,
      step_ms=step_ms,
      stall_ms=0.0 if first else sw.stall_ms,
      startup_ms=sw.stall_ms if first else 0.0,
      tokens=R * bench.decode_tokens * calls,
      need_mib=entry.memory.peak / memory.MiB,
    )
    if self.current is not None and (target != self.current or run_bucket != self.bucket):
      kind = 'layout' if target != self.current else 'bucket'
      self.switches.append(
        {**sw.as_dict(), 'kind': kind, 'step_ms': step_ms, 'stall_fraction': sw.stall_ms / step_ms}
      )
    self.current, self.bucket = target, run_bucket
    self.steps.append(rec)

  def result(self, n_dev):
    self.exe.close()
    return _totals(
      {
        'run': self.name,
        'steps': self.steps,
        'switches': self.switches,
        'failed_at': self.failed_at,
        'n_dev': n_dev,
      }
    )


def _totals(run):
  """Adds completed steps, tokens, time and throughput (None for a run that failed)."""
  done = [s for s in run['steps'] if not s['refused']]
  total_ms = sum(s['step_ms'] + s['stall_ms'] for s in done)
  tokens = sum(s['tokens'] for s in done)
  ok = run['failed_at'] is None and total_ms > 0
  return {
    **run,
    'refused': sum(s['refused'] for s in run['steps']),
    'completed': len(done),
    'tokens': tokens,
    'total_s': total_ms / 1e3,
    'throughput': tokens / (total_ms / 1e3) / run['n_dev'] if ok else None,
  }


def _median_runs(runs):
  """Per-step medians over passes of the same run."""
  if len(runs) == 1:
    return {**runs[0], 'switches': [{**sw, 'pass': 0} for sw in runs[0]['switches']]}
  base = dict(runs[0])
  steps = []
  for i, s in enumerate(base['steps']):
    s = dict(s)
    if not s['refused']:
      for k in ('step_ms', 'stall_ms'):
        s[k] = statistics.median(r['steps'][i][k] for r in runs)
    steps.append(s)
  base['steps'] = steps
  base['switches'] = [{**sw, 'pass': i} for i, r in enumerate(runs) for sw in r['switches']]
  return _totals(base)


def main(argv):
  del argv
  runtime.setup(cpu_devices=_CPU_DEVICES.value)
  import jax

  from earl_jax.models import qwen2
  from earl_jax.profiling import profiler
  from earl_jax.profiling.profiler import ProfileGrid
  from earl_jax.programs import Executables, memory
  from earl_jax.selector.selector import SelectorConfig
  from earl_jax.sharding import mesh as mesh_lib
  from earl_jax.stage import Stage
  from experiments.configs import selector as presets

  bench = presets.get_config(_PRESET.value)
  model = bench.model
  budget_mib = _BUDGET.value or bench.growth_budget_mib or bench.budget_mib
  budget = memory.device_budget(emulated=int(budget_mib * memory.MiB))
  spec = bench.spec
  pconfig = ProfileGrid(
    stages=(Stage.ROLLOUT,),
    buckets=bench.buckets,
    rows=(bench.growth_rows,),
    budget_bytes=budget,
    candidates=bench.candidates,
    with_fsdp=bench.with_fsdp,
    measure=bench.measure,
    spec=spec,
  )
  out_dir = os.path.dirname(os.path.abspath(_OUT.value))
  cache = _PROFILE.value or os.path.join(out_dir, f'selector_profile_{_PRESET.value}_growth.json')
  t0 = time.perf_counter()
  with Executables(model, spec=spec) as exe:
    profile = profiler.run(model, pconfig, executables=exe, cache_path=cache)
  profile_s = time.perf_counter() - t0
  sel_cfg = SelectorConfig(
    budget_mib=budget / memory.MiB, statistic=_STATISTIC.value, safety_margin=_MARGIN.value
  )
  schedule = _schedule(bench, _SEED.value)
  candidates = profile.candidates(Stage.ROLLOUT)
  _, master = qwen2.init_model(model, mesh_lib.make_mesh(candidates[0]), seed=0)
  print(
    f'model {model.name}, {len(jax.devices())} {jax.devices()[0].platform} devices, budget '
    f'{budget / memory.MiB:.1f} MiB/device, {bench.growth_rows} responses, '
    f'{bench.calls_per_step} x {bench.decode_tokens} tokens per step; profile '
    f'{profile_s:.0f} s'
  )
  policies = [('earl-dynamic', 'dynamic')] + [(f'static-{c.name}', c) for c in candidates]
  results = {name: [] for name, _ in policies}
  t_runs = time.perf_counter()
  n_dev = len(jax.devices())
  passes = _PASSES.value or bench.growth_passes
  for _ in range(passes):
    # All runs advance in lockstep, in a rotating order, so that background load on a shared
    # machine falls on every run alike.
    runs_now = [
      _Run(name, policy, bench, model, spec, master, budget, profile, sel_cfg)
      for name, policy in policies
    ]
    for t, lengths in enumerate(schedule):
      k = t % len(runs_now)
      for run in runs_now[k:] + runs_now[:k]:
        run.step(t, lengths)
    for run in runs_now:
      results[run.name].append(run.result(n_dev))
  runs = [_median_runs(results[name]) for name, _ in policies]
  runs_s = time.perf_counter() - t_runs

  dyn = runs[0]
  statics = runs[1:]
  survivors = [r for r in statics if r['failed_at'] is None]
  best_static = max(survivors, key=lambda r: r['throughput']) if survivors else None
  pre = [sw for sw in dyn['switches'] if sw['precompiled'] and sw['kind'] == 'layout']
  goals = {
    'dynamic_completes_every_step': dyn['failed_at'] is None,
    'a_static_fails': any(r['failed_at'] is not None for r in statics),
    'dynamic_beats_best_surviving_static': bool(best_static)
    and dyn['failed_at'] is None
    and dyn['throughput'] > best_static['throughput'],
    'precompiled_switch_stall_below_5pct': bool(pre)
    and max(sw['stall_fraction'] for sw in pre) < 0.05,
  }
  result = {
    'preset': _PRESET.value,
    'model': model.name,
    'devices': f'{len(jax.devices())} x {jax.devices()[0].platform}',
    'budget_mib': budget / memory.MiB,
    'responses': bench.growth_rows,
    'tokens_per_step': bench.growth_rows * bench.decode_tokens * bench.calls_per_step,
    'schedule_mean': list(bench.growth_schedule),
    'buckets': list(bench.buckets.lengths),
    'statistic': _STATISTIC.value,
    'passes': passes,
    'profile_s': profile_s,
    'runs_s': runs_s,
    'runs': runs,
    'best_surviving_static': best_static['run'] if best_static else None,
    'goals': goals,
  }
  os.makedirs(out_dir, exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=1)
  _print(result)


def _print(r):
  runs = r['runs']
  print(
    f'\nPer step: layout (step ms); "refused" = does not fit {r["budget_mib"]:.0f} MiB/device '
    '(the run fails there and runs no later step).'
  )
  head = f'{"step":>4} {"ctx":>6} {"bucket":>6} | ' + ' | '.join(f'{x["run"]:>22}' for x in runs)
  print(head)
  print('-' * len(head))
  for i, s0 in enumerate(runs[0]['steps']):
    cols = []
    for x in runs:
      s = x['steps'][i] if i < len(x['steps']) else None
      if s is None:
        cols.append(f'{"(failed)":>22}')
      elif s['refused']:
        cols.append(f'{"refused":>22}')
      else:
        cols.append(f'{s["config"]:>10} {s["step_ms"]:9.0f}ms')
    print(f'{i:>4} {s0["mean_context"]:6.0f} {s0["bucket"]:>6} | ' + ' | '.join(cols))
  n = len(runs[0]['steps'])
  print(
    f'\n{"run":>22} {"outcome":>16} {"completed":>9} {"total s":>8} {"tok/dev/s":>10} '
    f'{"layout switches":>15}'
  )
  for x in runs:
    failed = x['failed_at'] is not None
    outcome = f'failed at step {x["failed_at"]}' if failed else 'all steps'
    total = '-' if failed else f'{x["total_s"]:.2f}'
    tput = '-' if x['throughput'] is None else f'{x["throughput"]:.1f}'
    switches = sum(s['kind'] == 'layout' for s in x['switches'])
    print(
      f'{x["run"]:>22} {outcome:>16} {x["completed"]:>4} / {n:<2} {total:>8} {tput:>10} '
      f'{switches:>15}'
    )
  sw = runs[0]['switches']
  if sw:
    print('\nearl-dynamic switches (layout changes, and new buckets on the same layout):')
    print(
      f'{"pass":>4} {"step":>4} {"kind":>6} {"from":>9} {"to":>9} {"bucket":>6} {"reshard ms":>10} '
      f'{"compile ms":>10} '
      f'{"wait ms":>8} {"stall ms":>8} {"step ms":>8} {"stall %":>7} precompiled'
    )
    for s in sw:
      print(
        f'{s["pass"]:>4} {s["step"]:>4} {s["kind"]:>6} {s["source"]:>9} {s["target"]:>9} '
        f'{s["bucket"]:>6} {s["reshard_ms"]:10.1f} '
        f'{s["compile_ms"]:10.0f} {s["wait_ms"]:8.1f} {s["stall_ms"]:8.1f} {s["step_ms"]:8.0f} '
        f'{100 * s["stall_fraction"]:6.2f}% {s["precompiled"]}'
      )
  print(f'\nbest surviving static: {r["best_surviving_static"]}')
  for k, v in r['goals'].items():
    print(f'  {k}: {"MET" if v else "NOT MET"}')
  print(f'profile {r["profile_s"]:.0f} s, runs {r["runs_s"]:.0f} s')


if __name__ == '__main__':
  runtime.run(main)
