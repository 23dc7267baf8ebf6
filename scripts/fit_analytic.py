"""Fits the analytic memory model's activation coefficients to XLA's memory analysis.

  python scripts/fit_analytic.py                       # fit and print; writes nothing
  python scripts/fit_analytic.py --out=runs/fit.json   # also every program's figures
  python scripts/fit_analytic.py --refit=runs/fit.json # refit those programs' XLA peaks, no compiles

Compiles the experience and train programs of three small models ('tiny', 'small-kv',
'tiny-game') on 8 fake CPU devices over a grid of layouts, context lengths and rows, reads each
program's per-device peak (`programs.memory.xla_memory`), and fits the stage's activation
coefficients of `profiling.analytic.Coefficients` (non-negative least squares on the relative
error, the other terms fixed). It prints the fitted values, the largest relative error above
8 MiB and the largest absolute error below it, for the current and the fitted coefficients.
Paste the fitted values into `Coefficients` and the errors into `ANALYTIC_REL_ERROR`'s comment.
"""

import dataclasses
import itertools
import json
import time

import numpy as np
from absl import flags

from earl_jax import runtime

_OUT = flags.DEFINE_string('out', '', 'Optional JSON file for every program figure.')
_FROM = flags.DEFINE_string(
  'refit', '', "A JSON file of an earlier --out: refit the current model's terms, no compiles."
)

MiB = 1 << 20

# stage -> the coefficient fields it fits.
FIELDS = {
  'experience': ('experience_scores', 'experience_act_d', 'experience_act_f', 'experience_logits'),
  'train': ('train_scores', 'train_act_d', 'train_act_f'),
}
MODELS = ('tiny', 'small-kv', 'tiny-game')
LAYOUTS = ('dp8', 'dp4.tp2', 'dp2.tp4', 'fsdp8')
BUCKETS = (128, 512, 1024, 2048)
ROWS = (8, 32, 64)


def _nnls(a: np.ndarray, b: np.ndarray, iters: int = 20000) -> np.ndarray:
  """min ||a x - b||, x >= 0 (projected gradient; a few columns)."""
  x = np.maximum(np.linalg.lstsq(a, b, rcond=None)[0], 0.0)
  step = 1.0 / np.linalg.norm(a, 2) ** 2
  for _ in range(iters):
    x = np.maximum(x - step * a.T @ (a @ x - b), 0.0)
  return x


def _errors(rows, coefs):
  rel, absolute = 0.0, 0.0
  for r in rows:
    est = r['fixed'] + sum(c * f for c, f in zip(coefs, r['features']))
    if r['xla'] >= 8 * MiB:
      rel = max(rel, abs(est - r['xla']) / r['xla'])
    else:
      absolute = max(absolute, abs(est - r['xla']))
  return rel, absolute


def main(argv):
  del argv
  runtime.setup(cpu_devices=8)
  from earl_jax.config import ModelConfig, ParallelConfig
  from earl_jax.profiling import analytic
  from earl_jax.programs import builders
  from earl_jax.programs.executables import Executables
  from earl_jax.rollout.sampler import SamplingConfig
  from earl_jax.stage import Stage

  zero = analytic.Coefficients(**{f: 0.0 for fs in FIELDS.values() for f in fs})
  current = analytic.Coefficients()
  spec = builders.StageSpec(sampling=SamplingConfig(max_new_tokens=1), chunk=64)

  def terms(stage, model, pc, bucket, rows):
    fixed = analytic.estimate(stage, model, pc, bucket, rows, coefficients=zero).total
    features = []
    for field in FIELDS[str(stage)]:
      one = dataclasses.replace(zero, **{field: 1.0})
      est = analytic.estimate(stage, model, pc, bucket, rows, coefficients=one).total
      features.append(est - fixed)
    return fixed, features

  data = {stage: [] for stage in FIELDS}
  if _FROM.value:
    with open(_FROM.value) as f:
      data = json.load(f)['programs']
    for stage_name, rows in data.items():
      for r in rows:
        r['fixed'], r['features'] = terms(
          Stage.parse(stage_name),
          ModelConfig.preset(r['model']),
          ParallelConfig.parse(r['layout']),
          r['bucket'],
          r['rows'],
        )
  t0 = time.perf_counter()
  for name in MODELS if not _FROM.value else ():
    model = ModelConfig.preset(name)
    with Executables(model, spec=spec, max_programs=4) as exe:
      for stage_name, layout, bucket, rows in itertools.product(FIELDS, LAYOUTS, BUCKETS, ROWS):
        stage, pc = Stage.parse(stage_name), ParallelConfig.parse(layout)
        if bucket > model.max_position_embeddings or (stage == Stage.TRAIN and rows > 32):
          continue
        xla = exe.get(exe.key(stage, pc, bucket, rows)).memory.peak
        fixed, features = terms(stage, model, pc, bucket, rows)
        data[stage_name].append({
          'model': name, 'layout': layout, 'bucket': bucket, 'rows': rows, 'xla': xla,
          'fixed': fixed, 'features': features,
        })  # fmt: skip
        print(
          f'{time.perf_counter() - t0:6.0f}s {name:9s} {stage_name:10s} {layout:8s} T={bucket:5d} '
          f'R={rows:3d} xla {xla / MiB:8.2f} MiB',
          flush=True,
        )
  result = {}
  for stage_name, rows in data.items():
    a = np.array([[f / r['xla'] for f in r['features']] for r in rows])
    b = np.array([(r['xla'] - r['fixed']) / r['xla'] for r in rows])
    fitted = _nnls(a, b)
    before = [getattr(current, f) for f in FIELDS[stage_name]]
    result[stage_name] = {
      'programs': len(rows),
      'current': dict(zip(FIELDS[stage_name], before)),
      'fitted': dict(zip(FIELDS[stage_name], np.round(fitted, 2).tolist())),
      'current_errors': _errors(rows, before),
      'fitted_errors': _errors(rows, np.round(fitted, 2)),
    }
    print(f'{stage_name}: {len(rows)} programs')
    for label, coefs in (('current', before), ('fitted', np.round(fitted, 2))):
      rel, absolute = _errors(rows, coefs)
      print(
        f'  {label:8s} {dict(zip(FIELDS[stage_name], [float(c) for c in coefs]))} '
        f'max rel error (>= 8 MiB) {rel:.0%}, max abs error (< 8 MiB) {absolute / MiB:.1f} MiB'
      )
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump({'fit': result, 'programs': data}, f, indent=1)


if __name__ == '__main__':
  runtime.run(main)
