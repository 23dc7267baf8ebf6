"""Stable kernels' padding on the wire: a run's rollout -> experience moves replayed through the
Data Dispatcher with the earlier capacities (one power of two per ring shift) and the current ones
side by side.

The policies: 'shifts' (`stable_fit='shifts'`, capacities that only grow: the fit before commit
f32e822 for every move, and fec4bf3's default fit for moves between layouts that alone move
nothing) and 'pairs' (`DispatchConfig()`: a capacity per pair where the layouts move rows,
capacity classes where they alone move nothing, dispatch/dispatcher.py), both with the 'local'
balancing permutation (the main job's until commit 8ea0b5f); 'ring' (the main job's since: the
'pairs' dispatcher with the 'ring' balancing permutation of fewest packed rows,
`dispatch.balance`).

  python experiments/wire_padding.py --metrics=runs/default/metrics.jsonl --out=/tmp/wire.json
  python experiments/wire_padding.py --metrics=... --steps=20 --policies=pairs

The moves: every train step of the run's metrics.jsonl names the rollout and experience layouts
(`plan/rollout`, `plan/experience`) and the bucket the batch moved at (`bucket`). metrics.jsonl
does not hold the episode lengths, so they are drawn from the step's context statistics (whole
turns of `ctx/turn_len_mean` tokens, `ctx/turns_mean` turns on average, one episode of
`ctx/episode_len_max`; seeded) and balanced over the experience ranks as the trainer does
(`dispatch.balanced_permutation`, with the policy's method). Each policy's Dispatcher (otherwise the main job's settings:
`DispatchConfig()`) moves an RL batch (`rl.Batch`, --rows rows) of those shapes, the two
interleaved step by step, and the output is released afterwards as the trainer releases its
train batch. Reported per policy: the bytes that had to move and the bytes on the wire
(padding included) over all moves and their ratio, the kernels compiled, and the median move
time over the moves that compiled nothing, in all and per (source -> target) layouts.
"""

import json
import statistics
import time

import numpy as np
from absl import flags

from earl_jax import runtime
from earl_jax.errors import UserError
from experiments.wire_replay import replayed_moves

_METRICS = flags.DEFINE_string('metrics', None, "A run's metrics.jsonl.", required=True)
_STEPS = flags.DEFINE_integer('steps', 0, 'Replay only the first this many steps (0: all).')
_ROWS = flags.DEFINE_integer('rows', 64, 'Rows of the batch (rollout.num_episodes).')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the drawn episode lengths.')
_POLICIES = flags.DEFINE_list(
  'policies', ['shifts', 'pairs', 'ring'], 'Capacities and balancing to compare (see above).'
)
_ROW_MULTIPLE = flags.DEFINE_integer(
  'row_multiple', 8, "'ring': the packed rows' multiple (the default's: its 8 batch shards)."
)
_OUT = flags.DEFINE_string('out', None, 'Write the results JSON here.')


def _by_layouts(done: list[dict]) -> dict[str, dict]:
  """Moves, bytes moved, wire bytes and their ratio per (source -> target) layouts."""
  out: dict[str, dict] = {}
  for r in done:
    b = out.setdefault(r['layouts'], {'moves': 0, 'bytes': 0, 'wire_bytes': 0})
    b['moves'] += 1
    b['bytes'] += r['bytes']
    b['wire_bytes'] += r['wire_bytes']
  for b in out.values():
    b['wire_ratio'] = b['wire_bytes'] / b['bytes'] if b['bytes'] else None
  return out


def main(argv):
  del argv
  runtime.setup(cpu_devices=8)
  import jax
  import jax.numpy as jnp

  from earl_jax import dispatch
  from earl_jax.config import ParallelConfig
  from earl_jax.rl import packing
  from earl_jax.rl.batch import Batch
  from earl_jax.sharding import mesh as mesh_lib

  for policy in _POLICIES.value:
    if policy not in ('shifts', 'pairs', 'ring'):
      raise UserError(f"--policies: {policy!r} is not 'shifts', 'pairs' or 'ring'.")
  moves = replayed_moves(_METRICS.value, _STEPS.value, _ROWS.value, _SEED.value)
  layouts: dict[str, dispatch.Layout] = {}

  def layout(name: str) -> dispatch.Layout:
    if name not in layouts:
      mesh = mesh_lib.make_mesh(ParallelConfig.parse(name))
      specs = jax.tree.map(lambda s: s.spec, Batch.shardings(mesh))
      layouts[name] = dispatch.Layout(mesh=mesh, specs=specs)
    return layouts[name]

  makers = {}

  def batch_on(src: dispatch.Layout, bucket: int):
    """A fresh batch made on the devices of `src` (donated by the move)."""
    key = (src.key(), bucket)
    if key not in makers:
      make = lambda: Batch.zeros(_ROWS.value, bucket, xp=jnp)  # noqa: E731
      makers[key] = jax.jit(make, out_shardings=src.shardings())
    return jax.block_until_ready(makers[key]())

  dispatchers = {
    # The earlier policy: a power-of-two capacity per ring shift that only grows.
    'shifts': dispatch.Dispatcher(
      dispatch.DispatchConfig(stable_fit='shifts', max_padding=float('inf'))
    ),
    'pairs': dispatch.Dispatcher(dispatch.DispatchConfig()),
    'ring': dispatch.Dispatcher(dispatch.DispatchConfig()),
  }

  def permutation(policy: str, move: dict, src, dst, like):
    lengths = np.asarray(move['lengths'])
    if policy != 'ring':
      return dispatch.balanced_permutation(lengths, src, dst, like=like)
    shape = {
      'ranks': dispatch.target_ranks(dst, _ROWS.value),
      'bucket': move['bucket'],
      'row_multiple': _ROW_MULTIPLE.value,
    }
    return dispatch.balanced_permutation(
      lengths,
      src,
      dst,
      like=like,
      method='ring',
      cost=lambda p: packing.rows_needed(lengths[p], **shape),
    )

  rows = {p: [] for p in _POLICIES.value}
  for i, move in enumerate(moves):
    src, dst = layout(move['src']), layout(move['dst'])
    like = jax.eval_shape(lambda b=move['bucket']: Batch.zeros(_ROWS.value, b, xp=jnp))
    order = _POLICIES.value if i % 2 == 0 else _POLICIES.value[::-1]
    for policy in order:
      d = dispatchers[policy]
      perm = permutation(policy, move, src, dst, like)
      batch = batch_on(src, move['bucket'])
      traces = d.traces
      t0 = time.perf_counter()
      out, report = d.dispatch(batch, dst, src=src, perm=perm)
      jax.block_until_ready(out)
      ms = 1e3 * (time.perf_counter() - t0)
      d.release(out)
      wire = sum(report.scheduled_sent) if report.scheduled_sent is not None else 0
      rows[policy].append(
        {
          'step': move['step'],
          'layouts': f'{move["src"]}->{move["dst"]}',
          'move': f'{move["src"]}->{move["dst"]}@{move["bucket"]}',
          'bytes': int(report.min_bytes or 0),
          'wire_bytes': int(wire),
          'compiled': d.traces > traces,
          'ms': ms,
        }
      )
  results = {}
  for policy, done in rows.items():
    needed = sum(r['bytes'] for r in done)
    wire = sum(r['wire_bytes'] for r in done)
    warm = [r['ms'] for r in done if not r['compiled']]
    results[policy] = {
      'bytes': needed,
      'wire_bytes': wire,
      'wire_ratio': wire / needed if needed else None,
      'kernels': dispatchers[policy].traces,
      'median_ms': statistics.median(warm) if warm else None,
      'compile_moves_ms': sum(r['ms'] for r in done if r['compiled']),
      'by_layouts': _by_layouts(done),
      'moves': done,
    }
  print(f'{len(moves)} rollout -> experience moves of {_METRICS.value}')
  print(f'{"policy":8} {"MB moved":>9} {"MB wire":>9} {"wire/bytes":>10} {"kernels":>7} '
        f'{"median ms":>9}')  # fmt: skip
  for policy, r in results.items():
    ratio = f'{r["wire_ratio"]:.2f}' if r['wire_ratio'] is not None else '-'
    median = f'{r["median_ms"]:.1f}' if r['median_ms'] is not None else '-'
    print(
      f'{policy:8} {r["bytes"] / 1e6:9.1f} {r["wire_bytes"] / 1e6:9.1f} {ratio:>10} '
      f'{r["kernels"]:7d} {median:>9}'
    )
  for policy, r in results.items():
    for pair, b in r['by_layouts'].items():
      ratio = f'{b["wire_ratio"]:.2f}' if b['wire_ratio'] is not None else '-'
      print(
        f'  {policy:8} {pair:18} {b["moves"]:3d} moves {b["bytes"] / 1e6:7.2f} MB moved '
        f'{b["wire_bytes"] / 1e6:7.2f} MB wire {ratio:>6}'
      )
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump({'metrics': _METRICS.value, 'seed': _SEED.value, 'policies': results}, f, indent=2)


if __name__ == '__main__':
  runtime.run(main)
