"""The paper-scale view of context parallelism: the longest context each stage fits, with and
without it, for a model on 8 devices of an accelerator's memory (an extension of Fig. 3).

  python experiments/context_fit.py --out=runs/context_fit               # Qwen2.5-7B, 8 x 80 GB
  python experiments/context_fit.py --model=qwen2.5-1.5b --hbm_gb=24 --xla_stages=

One sequence of T tokens per batch shard (rows = dp x fsdp of each layout): the longest context
a single trajectory of an agent can reach, which data parallelism cannot split and context
parallelism can. For each stage (the experience forward and the train update) and every layout
of the devices that the model divides (dp x fsdp x cp x tp, fsdp and cp included), over a grid
of contexts:

1. analytic: the per-device need by the analytic memory model (`profiling.analytic`, with a GPU's
   fused attention, `Coefficients.fused_attention`: no score tiles), against `--hbm_gb` x
   `--usable` with the selector's safety margin; the longest context each layout fits, the best
   layout without context parallelism and the best with it;
2. XLA, compile only (`--xla_stages`): the programs the main job runs (`programs.builders`:
   the rollout's generate, the log-prob forward, the train step with AdamW), lowered and
   compiled for the devices here at abstract shapes and never run, for each best layout: at its
   analytic longest fit, then down the grid until XLA's peak fits (or one context up when it
   fits there). `compiled.memory_analysis()`'s per-device peak says whether each fits; the
   longest that does is XLA's longest fit of that layout. This is XLA:CPU's memory plan of our
   programs (blockwise attention, ring attention on cp layouts, f32 where the CPU computes in
   it), not a GPU's: where it disagrees with the analytic line, the tables show both.

Writes <out>/context_fit.json (every cell, the flags, date, JAX version), <out>/context_fit.md
(the tables) and <out>/context_fit.png (need / budget per layout and context, one panel a stage,
cells over budget crossed, each stage's longest fit without and with CP outlined).
"""

import contextlib
import dataclasses
import datetime
import json
import os
from typing import Any

from absl import app, flags

from earl_jax import runtime

_MODEL = flags.DEFINE_string('model', 'qwen2.5-7b', 'Model preset.')
_DTYPE = flags.DEFINE_enum(
  'dtype', 'bfloat16', ['bfloat16', 'float32'], 'Parameter and activation dtype.'
)
_HBM = flags.DEFINE_float('hbm_gb', 80.0, 'Device memory in GB (1e9 bytes).', lower_bound=1e-3)
_USABLE = flags.DEFINE_float(
  'usable', 0.9, 'Share of it a program may use (vLLM: gpu_memory_utilization).', lower_bound=0.01
)
_MARGIN = flags.DEFINE_float(
  'safety_margin', 0.05, "The selector's margin: fits when need x (1 + margin) <= budget."
)
_CONTEXTS = flags.DEFINE_list(
  'contexts',
  ['4K', '8K', '16K', '24K', '32K', '48K', '64K', '96K', '128K', '192K', '256K', '384K', '512K'],
  'Context grid (tokens; K = 1024), increasing.',
)
_STAGES = flags.DEFINE_list('stages', ['rollout', 'experience', 'train'], 'Stages.')
_DEVICES = flags.DEFINE_integer('devices', 8, 'Devices of every layout.', lower_bound=1)
_XLA_STAGES = flags.DEFINE_list(
  'xla_stages',
  ['rollout', 'experience'],
  'Stages whose boundary cells XLA checks (compile only; none: analytic alone). The train step '
  'of a 7B model takes XLA:CPU over 12 minutes a compile here, so it is not in the default.',
)
_XLA_LAYERS = flags.DEFINE_integer(
  'xla_layers',
  0,
  "Compile the XLA checks with this many of the model's layers and with one fewer, and "
  'extrapolate each peak linearly by their difference to all of them: weights, gradients, '
  "optimizer state and the activations kept for the backward pass grow by a layer's worth a "
  "layer. For a model whose whole program XLA:CPU cannot compile in this host's memory (the 7B "
  'train step needs over 23 GB). 0: the whole model.',
  lower_bound=0,
)
_OUT = flags.DEFINE_string('out', 'runs/context_fit', 'Output directory.')


def parse_contexts(values: list[str]) -> list[int]:
  """'4K', '8192' -> tokens; a value that is not a positive count, or a grid that does not
  increase, is refused naming it."""
  out = []
  for v in values:
    text = v.strip().upper()
    scale = 1024 if text.endswith('K') else 1
    try:
      n = int(text[:-1] if scale > 1 else text) * scale
    except ValueError:
      n = 0
    if n <= 0:
      raise app.UsageError(f'--contexts: {v!r} is not a token count (e.g. 32768 or 32K).')
    out.append(n)
  if out != sorted(set(out)):
    raise app.UsageError(f'--contexts must increase, got {values}.')
  return out


@dataclasses.dataclass(frozen=True)
class Fit:
  """One stage's analytic grid: need[layout][context] bytes, and the longest fit of each."""

  stage: str
  budget: int
  needs: dict[str, dict[int, int]]
  longest: dict[str, int | None]

  def best(self, with_cp: bool) -> tuple[str | None, int | None]:
    """(layout, context) of the longest fit among the layouts (cp = 1 only unless `with_cp`);
    at equal context the smaller need there."""
    from earl_jax.config import ParallelConfig

    pool = [
      (t, -self.needs[name][t], name)
      for name, t in self.longest.items()
      if t is not None and (with_cp or ParallelConfig.parse(name).cp == 1)
    ]
    if not pool:
      return None, None
    t, _, name = max(pool)
    return name, t


def analytic_fit(stage, model, layouts, contexts, budget: int, margin: float) -> Fit:
  """The analytic need of every (layout, context), one sequence per batch shard, with the
  program shapes of `builders.StageSpec()` (the rollout's prompt chunk and decode tokens)."""
  from earl_jax.memory_budget import fits
  from earl_jax.profiling import analytic
  from earl_jax.programs.builders import StageSpec

  spec = StageSpec()
  shapes = {
    'coefficients': analytic.Coefficients.fused_attention(),
    'decode_tokens': spec.sampling.max_new_tokens,
    'chunk': spec.chunk,
  }
  needs, longest = {}, {}
  for p in layouts:
    needs[p.name] = {
      t: analytic.estimate(stage, model, p, t, p.batch_shards, **shapes).total for t in contexts
    }
    fitting = [t for t in contexts if fits(needs[p.name][t], budget, margin=margin)]
    longest[p.name] = max(fitting) if fitting else None
  return Fit(stage=str(stage), budget=budget, needs=needs, longest=longest)


def xla_checks(peak, stage, fit: Fit, contexts, margin: float) -> list[dict[str, Any]]:
  """Compile-only peaks (`peak`: `programs.memory.compiled_peak`) of each best layout (without
  CP, with CP): at its analytic longest fit, then down the grid until XLA's peak fits, or up one
  context when it fits there; the last checked context that fits is XLA's longest fit of that
  layout."""
  from earl_jax.config import ParallelConfig
  from earl_jax.memory_budget import fits

  out = []
  for with_cp in (False, True):
    name, t = fit.best(with_cp)
    if name is None:
      continue
    p = ParallelConfig.parse(name)

    def check(context, name=name, p=p, with_cp=with_cp):
      xla_peak = peak(stage, p, context)
      row = {
        'stage': str(stage),
        'layout': name,
        'context': context,
        'with_cp': with_cp,
        'xla_peak': xla_peak,
        'analytic': fit.needs[name][context],
        'fits': fits(xla_peak, fit.budget, margin=margin),
      }
      out.append(row)
      return row['fits']

    i = contexts.index(t)
    if check(t):
      if i + 1 < len(contexts):
        check(contexts[i + 1])
    else:
      while i > 0 and not check(contexts[i - 1]):
        i -= 1
  return out


def xla_longest(rows: list[dict[str, Any]], with_cp: bool) -> dict[str, Any]:
  """The longest context XLA found to fit among `rows` of one stage (layout, context)."""
  fitting = [r for r in rows if r['with_cp'] == with_cp and r['fits']]
  best = max(fitting, key=lambda r: r['context'], default=None)
  return {'layout': best and best['layout'], 'context': best and best['context']}


def _k(t: int | None) -> str:
  return '-' if t is None else (f'{t // 1024}K' if t % 1024 == 0 else str(t))


def markdown(result: dict[str, Any]) -> str:
  gb = 1e9
  lines = [
    f'# Longest context per stage: {result["model"]} on {result["devices"]} x '
    f'{result["flags"]["hbm_gb"]:g} GB',
    '',
    f'Budget {result["budget"] / gb:.1f} GB a device ({result["flags"]["usable"]:g} of '
    f'{result["flags"]["hbm_gb"]:g} GB), margin {result["flags"]["safety_margin"]:g}; one '
    'sequence per batch shard; analytic model with fused attention.',
    '',
    '| stage | longest without CP | layout | longest with CP | layout | gain | XLA: without '
    'CP | XLA: with CP |',
    '|---|---:|---|---:|---|---:|---:|---:|',
  ]
  for s in result['stages']:
    a, b = s['best_without_cp'], s['best_with_cp']
    gain = f'{b["context"] / a["context"]:.1f}x' if a['context'] and b['context'] else '-'
    xa, xb = (s.get(k, {}).get('context') for k in ('xla_without_cp', 'xla_with_cp'))
    checked = 'xla_without_cp' in s
    lines.append(
      f'| {s["stage"]} | {_k(a["context"])} | {a["layout"] or "-"} | {_k(b["context"])} | '
      f'{b["layout"] or "-"} | {gain} | {_k(xa) if checked else "not checked"} | '
      f'{_k(xb) if checked else "not checked"} |'
    )
  for s in result['stages']:
    lines += ['', f'## {s["stage"]}: per-device need (GB) by layout and context', '']
    contexts = result['contexts']
    lines.append('| layout | ' + ' | '.join(_k(t) for t in contexts) + ' | longest |')
    lines.append('|---|' + '---:|' * (len(contexts) + 1))
    for name, row in s['needs'].items():
      cells = [
        f'{row[str(t)] / gb:.1f}' + ('' if row[str(t)] * (1 + result['flags']['safety_margin'])
                                      <= result['budget'] else ' x')
        for t in contexts
      ]  # fmt: skip
      lines.append(f'| {name} | ' + ' | '.join(cells) + f' | {_k(s["longest"][name])} |')
  if result['xla']:
    lines += [
      '',
      '## XLA compile-only check (XLA:CPU memory plan of our programs, never run)',
      '',
    ]
    if result['flags'].get('xla_layers'):
      lines += [
        f'Each peak compiled with {result["flags"]["xla_layers"] - 1} and '
        f"{result['flags']['xla_layers']} layers and extrapolated linearly to the model's "
        '(`--xla_layers`).',
        '',
      ]
    lines += [
      '| stage | layout | context | XLA peak GB | analytic GB | fits |',
      '|---|---|---:|---:|---:|---|',
    ]
    for r in result['xla']:
      lines.append(
        f'| {r["stage"]} | {r["layout"]} | {_k(r["context"])} | {r["xla_peak"] / gb:.1f} | '
        f'{r["analytic"] / gb:.1f} | {"yes" if r["fits"] else "no"} |'
      )
  return '\n'.join(lines) + '\n'


def plot(result: dict[str, Any], path: str) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np

  stages = result['stages']
  contexts = result['contexts']
  rows = max(len(s['needs']) for s in stages)
  fig, axes = plt.subplots(
    1, len(stages), figsize=(7.5 * len(stages), 0.42 * rows + 2), squeeze=False
  )
  fig.subplots_adjust(wspace=0.55)
  for ax, s in zip(axes[0], stages):
    names = list(s['needs'])
    ratio = np.array([[s['needs'][n][str(t)] / result['budget'] for t in contexts] for n in names])
    im = ax.imshow(np.log2(ratio), cmap='RdYlGn_r', vmin=-3, vmax=3, aspect='auto')
    for i in range(len(names)):
      for j in range(len(contexts)):
        over = ratio[i, j] * (1 + result['flags']['safety_margin']) > 1
        ax.text(j, i, 'x' if over else f'{ratio[i, j]:.2f}', ha='center', va='center', fontsize=7)
    for key, colour in (('best_without_cp', 'blue'), ('best_with_cp', 'black')):
      best = s[key]
      if best['layout']:
        i, j = names.index(best['layout']), contexts.index(best['context'])
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5, ec=colour))
    ax.set_xticks(range(len(contexts)), [_k(t) for t in contexts], rotation=45)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_title(f'{s["stage"]}: need / budget (x: over budget)\noutlined: the longest fit '
                 'without CP (blue), with CP (black)', fontsize=9)  # fmt: skip
    ax.set_xlabel('context (one sequence per batch shard)')
  fig.colorbar(im, ax=axes[0].tolist(), label='log2(need / budget)')
  fig.suptitle(
    f'{result["model"]} on {result["devices"]} x {result["flags"]["hbm_gb"]:g} GB '
    f'(budget {result["budget"] / 1e9:.0f} GB a device)'
  )
  fig.savefig(path, dpi=110, bbox_inches='tight')
  plt.close(fig)


def main(argv):
  del argv
  contexts = parse_contexts(_CONTEXTS.value)
  from earl_jax.config import ModelConfig
  from earl_jax.stage import Stage

  try:
    stages = [Stage.parse(s) for s in _STAGES.value]
    checked = [Stage.parse(s) for s in _XLA_STAGES.value]
  except ValueError as e:
    raise app.UsageError(f'--stages / --xla_stages: {e}') from None
  if not set(checked) <= set(stages):
    raise app.UsageError(f'--xla_stages={_XLA_STAGES.value} must be among --stages.')
  model = ModelConfig.preset(_MODEL.value).replace(param_dtype=_DTYPE.value, dtype=_DTYPE.value)
  layers = _XLA_LAYERS.value
  if layers == 1 or layers >= model.num_layers:
    fewer = f'or 2 to {model.num_layers - 1} ' if model.num_layers > 2 else ''
    raise app.UsageError(
      f'--xla_layers={layers}: expected 0 (the whole model) {fewer}({model.name} has '
      f'{model.num_layers} layers).'
    )
  runtime.setup(cpu_devices=_DEVICES.value)
  import jax

  from earl_jax.programs import Executables, memory
  from earl_jax.selector.candidates import stage_candidates

  n = _DEVICES.value
  if len(jax.devices()) != n:
    raise app.UsageError(f'--devices={n}, but JAX sees {len(jax.devices())} devices.')
  budget = int(_HBM.value * 1e9 * _USABLE.value)
  result: dict[str, Any] = {
    'experiment': 'context_fit',
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'jax': jax.__version__,
    'model': model.name,
    'devices': n,
    'budget': budget,
    'contexts': contexts,
    'flags': {
      'dtype': _DTYPE.value,
      'hbm_gb': _HBM.value,
      'usable': _USABLE.value,
      'safety_margin': _MARGIN.value,
      'xla_stages': list(_XLA_STAGES.value),
      'xla_layers': layers,
    },
    'stages': [],
    'xla': [],
  }
  fits_by_stage = {}
  for stage in stages:
    layouts = stage_candidates(stage, model, num_devices=n, lengths=contexts, with_cp=True)
    fit = analytic_fit(stage, model, layouts, contexts, budget, _MARGIN.value)
    fits_by_stage[stage] = fit
    entry = {
      'stage': str(stage),
      'needs': {k: {str(t): v for t, v in row.items()} for k, row in fit.needs.items()},
      'longest': fit.longest,
    }
    for key, with_cp in (('best_without_cp', False), ('best_with_cp', True)):
      name, t = fit.best(with_cp)
      entry[key] = {'layout': name, 'context': t}
    result['stages'].append(entry)
    print(
      f'{stage}: longest without CP {_k(entry["best_without_cp"]["context"])} '
      f'({entry["best_without_cp"]["layout"]}), with CP {_k(entry["best_with_cp"]["context"])} '
      f'({entry["best_with_cp"]["layout"]})',
      flush=True,
    )
  if checked:
    sizes = (layers - 1, layers) if layers else (model.num_layers,)
    with contextlib.ExitStack() as stack:
      exes = [stack.enter_context(Executables(model.replace(num_layers=k))) for k in sizes]
      peak = memory.compiled_peak(exes, model.num_layers)
      for stage in checked:
        rows = xla_checks(peak, stage, fits_by_stage[stage], contexts, _MARGIN.value)
        entry = next(e for e in result['stages'] if e['stage'] == str(stage))
        entry['xla_without_cp'] = xla_longest(rows, with_cp=False)
        entry['xla_with_cp'] = xla_longest(rows, with_cp=True)
        for row in rows:
          result['xla'].append(row)
          print(
            f'  XLA {row["stage"]} {row["layout"]} @ {_k(row["context"])}: '
            f'{row["xla_peak"] / 1e9:.1f} GB (analytic {row["analytic"] / 1e9:.1f}), '
            f'{"fits" if row["fits"] else "over budget"}',
            flush=True,
          )
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, 'context_fit.json'), 'w') as f:
    json.dump(result, f, indent=1)
  text = markdown(result)
  with open(os.path.join(_OUT.value, 'context_fit.md'), 'w') as f:
    f.write(text)
  plot(result, os.path.join(_OUT.value, 'context_fit.png'))
  print(text)
  print(f'wrote {_OUT.value}/context_fit.{{json,md,png}}')


if __name__ == '__main__':
  runtime.run(main)
