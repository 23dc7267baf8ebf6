"""Context-parallel attention kernels against data-parallel blockwise attention (issue 44).

  python experiments/context_attention_bench.py --out=runs/context_attention_bench
  python experiments/context_attention_bench.py --lengths=512,1024 --reps=3 --nograd

For every context length T, mesh and kernel, causal grouped-query attention over the same global
batch of B rows on --cpu_devices fake CPU devices, timed as training runs it: the gradient of
sum(out * cotangent) with respect to q, k and v (--grad, the default), or the forward alone.
A mesh `dpX.cpY` is ('data', 'context') of shape (X, Y): the batch split X ways, each sequence Y
ways. The kernels (`earl_jax.models.context_attention`):

  blockwise    the baseline, on `dpN` (N = all devices): each device holds whole sequences and
               runs `models.attention.blockwise_causal_attention` (tiles of gcd(T, --block)).
  ring         `ring_attention`, contiguous shards (the last device does the most causal work),
               each visit in tiles of gcd(T / Y, ring_tile(--block, Y)): as the model runs it,
               the tile shrunk by sqrt(Y) for the Y times more rows a device holds.
  ring_zigzag  `ring_attention` in zig-zag order (balanced; the inputs are placed in that order),
               tiles of gcd(T / 2Y, ring_tile(--block, Y)).
  ulysses      `ulysses_attention`: all-to-alls to whole sequences of K / Y kv heads, then the
               blockwise attention (tiles of gcd(T, --block)); only where Y divides K.

A combination whose shapes do not divide (the batch over X, T over Y or 2Y, K over Y) is skipped
and its reason recorded. Each run is jitted with explicit in and out shardings on inputs already
placed in its layout, lowered and compiled (cold: the persistent compilation cache is off, so
'compile s' is lower + compile from scratch), called --warmup times, then timed over --reps calls
(`block_until_ready`): median, min, max, and the noise (max - min) / median. 'vs dpN' is the
baseline's median over this one's (above 1: faster than data parallelism); a difference within
the two runs' combined noise (|median - baseline median| <= the sum of their max - min spreads)
is a 'tie'. Per-device memory is XLA's `memory_analysis()` of the compiled program: arguments +
outputs + temporaries (`programs.memory.xla_memory`).

At a fixed global batch every mesh holds the same B * T / N tokens per device, so context
parallelism cannot lower the inputs' bytes here; what differs is the temporaries (every kernel
computes [B_local, K, Q, b, b] tiles; a ring also holds a visiting kv shard and, backward, its
dk, dv). Fake CPU devices share the host's cores, so times add up every device's work: the
ring's load imbalance, which zig-zag removes, barely shows here; rerun on real devices for that.

Writes <out>/context_attention_bench.json (every row and skip, the flags, date, JAX version and
the devices) and <out>/context_attention_bench.md (the tables).
"""

import dataclasses
import datetime
import functools
import json
import math
import os
import re
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import Mesh, NamedSharding

from earl_jax import runtime
from earl_jax.config import ModelConfig
from earl_jax.errors import UserError
from earl_jax.models import attention
from earl_jax.models import context_attention as ca
from earl_jax.programs import memory as memory_lib
from earl_jax.sharding import mesh as mesh_lib

KERNELS = ('ring', 'ring_zigzag', 'ulysses')
BASELINE = 'blockwise'
DATA, CONTEXT = 'data', 'context'

_LENGTHS = flags.DEFINE_list('lengths', ['1024', '2048', '4096'], 'Context lengths T.')
_BATCH = flags.DEFINE_integer('batch', 8, 'Global batch B (rows).', lower_bound=1)
_KV_HEADS = flags.DEFINE_integer('kv_heads', 4, 'KV heads K.', lower_bound=1)
_Q_PER_KV = flags.DEFINE_integer('q_per_kv', 2, 'Query heads per KV head Q.', lower_bound=1)
_HEAD_DIM = flags.DEFINE_integer('head_dim', 32, 'Head dimension Dh.', lower_bound=1)
_BLOCK = flags.DEFINE_integer(
  'block',
  next(f.default for f in dataclasses.fields(ModelConfig) if f.name == 'attention_block'),
  'Tile of every kernel: gcd(T, block) for the baseline and Ulysses, gcd(shard, '
  "ring_tile(block, cp)) for a ring visit; default: the model's attention_block.",
  lower_bound=1,
)
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'q, k, v dtype.')
_MESHES = flags.DEFINE_list(
  'meshes',
  ['dp8', 'dp4.cp2', 'dp2.cp4', 'dp1.cp8'],
  "('data', 'context') meshes dpX.cpY (dpN alone: the data-parallel baseline).",
)
_KERNELS = flags.DEFINE_list('kernels', list(KERNELS), f'Any of {", ".join(KERNELS)}.')
_BASELINE_BLOCKS = flags.DEFINE_list(
  'baseline_blocks',
  [],
  "The baseline again at these tiles, as rows 'blockwise@<b>' (e.g. 64,32: the rings' tiles "
  'ring_tile(128, cp) for cp = 2, 4 and 8): what a smaller tile alone gains.',
)
_REPS = flags.DEFINE_integer('reps', 5, 'Timed calls per run.', lower_bound=1)
_WARMUP = flags.DEFINE_integer('warmup', 1, 'Untimed calls before timing.', lower_bound=0)
_GRAD = flags.DEFINE_bool(
  'grad', True, 'Time forward + backward (d/dq,k,v of sum(out * cotangent)); false: forward.'
)
_OUT = flags.DEFINE_string('out', 'runs/context_attention_bench', 'Output folder.')
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', 8, 'Fake CPU devices when there is no accelerator.', lower_bound=1
)

_MESH_NAME = re.compile(r'dp(\d+)(?:\.cp(\d+))?')
MiB = 1 << 20


# Flags.


def parse_lengths(texts: list[str], *, flag: str = '--lengths') -> list[int]:
  try:
    lengths = [int(x) for x in texts]
  except ValueError:
    raise UserError(f'{flag} {",".join(texts)}: expected integers') from None
  if not lengths or min(lengths) < 1:
    raise UserError(f'{flag} {",".join(texts)}: expected positive lengths')
  return lengths


def parse_mesh(name: str, devices: int | None) -> tuple[int, int]:
  """'dp2.cp4' -> (2, 4); 'dp8' -> (8, 1). The product must be `devices` (None: any)."""
  match = _MESH_NAME.fullmatch(name)
  if not match:
    raise UserError(f'--meshes {name!r}: expected dpX.cpY (or dpX alone), e.g. dp2.cp4')
  dp, cp = int(match.group(1)), int(match.group(2) or 1)
  if dp < 1 or cp < 1:
    raise UserError(f'--meshes {name}: expected positive sizes')
  if devices is not None and dp * cp != devices:
    raise UserError(f'--meshes {name}: uses {dp} x {cp} = {dp * cp} devices, expected {devices}')
  return dp, cp


def parse_kernels(names: list[str]) -> list[str]:
  unknown = [k for k in names if k not in KERNELS]
  if unknown or not names:
    raise UserError(f'--kernels {",".join(names)}: expected any of {", ".join(KERNELS)}')
  return list(dict.fromkeys(names))


# One run.


def make_mesh(dp: int, cp: int) -> Mesh:
  devices = mesh_lib.canonical_devices()
  return Mesh(np.array(devices, dtype=object).reshape(dp, cp), (DATA, CONTEXT))


def runs_of(
  mesh_names: list[str], kernels: list[str], devices: int, baseline_blocks: Sequence[int] = ()
) -> list[tuple[str, str]]:
  """(mesh, kernel) pairs: the baseline on a dpN mesh first (then at each of `baseline_blocks`,
  'blockwise@<b>'), then the kernels on the others, in flag order."""
  out = []
  for name in mesh_names:
    _, cp = parse_mesh(name, devices)
    if cp == 1:
      out += [(name, BASELINE)] + [(name, f'{BASELINE}@{b}') for b in baseline_blocks]
    else:
      out += [(name, k) for k in kernels]
  return sorted(out, key=lambda pair: not pair[1].startswith(BASELINE))


def block_of(kernel: str, block: int) -> int:
  """The tile a run asks for: `block`, or b of a 'blockwise@<b>' baseline."""
  return int(kernel.split('@')[1]) if '@' in kernel else block


def skip_reason(kernel: str, dp: int, cp: int, B: int, T: int, K: int) -> str | None:
  """Why (kernel, mesh) cannot run these shapes, or None."""
  if B % dp:
    return f'batch {B} does not split over the {dp} data shards'
  if kernel in ('ring', 'ulysses') and T % cp:
    return f'T = {T} does not split over the C = {cp} context shards'
  if kernel == 'ring_zigzag' and T % (2 * cp):
    return f'zig-zag needs 2C = {2 * cp} to divide T = {T}'
  if kernel == 'ulysses' and K % cp:
    return f'Ulysses needs C = {cp} to divide the K = {K} kv heads'
  return None


def attention_fn(kernel: str, mesh: Mesh, block: int):
  """(q, k, v) -> out, in the kernel's layout order, split by `ca.sequence_spec`."""
  if kernel in ('ring', 'ring_zigzag'):
    tile = ca.ring_tile(block, mesh.shape[CONTEXT])  # the model's tile (`qwen2.causal_attention`)
    return functools.partial(
      ca.ring_attention,
      segment_ids=None,
      mesh=mesh,
      axis=CONTEXT,
      zigzag=kernel == 'ring_zigzag',
      block=tile,
    )
  if kernel == 'ulysses':
    return functools.partial(
      ca.ulysses_attention, segment_ids=None, mesh=mesh, axis=CONTEXT, block=block
    )

  block = block_of(kernel, block)

  def local(q, k, v):
    T = q.shape[1]
    return attention.blockwise_causal_attention(q, k, v, block=math.gcd(T, block))

  specs = tuple(ca.sequence_spec(mesh, CONTEXT, n) for n in (5, 4, 4))
  # check_vma=False, as in `ulysses_attention`: the blockwise loops start from fresh zeros,
  # which the varying-axes check rejects as loop carries; there are no collectives here.
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)


def program(kernel: str, mesh: Mesh, block: int, grad: bool):
  """The jitted step: the forward, or the gradients of sum(out * cotangent) w.r.t. q, k, v."""
  attend = attention_fn(kernel, mesh, block)
  q_sh, kv_sh = (NamedSharding(mesh, ca.sequence_spec(mesh, CONTEXT, n)) for n in (5, 4))
  if not grad:
    return jax.jit(attend, in_shardings=(q_sh, kv_sh, kv_sh), out_shardings=q_sh)

  def loss(q, k, v, cotangent):
    return jnp.sum(attend(q, k, v).astype(jnp.float32) * cotangent)

  return jax.jit(
    jax.grad(loss, argnums=(0, 1, 2)),
    in_shardings=(q_sh, kv_sh, kv_sh, q_sh),
    out_shardings=(q_sh, kv_sh, kv_sh),
  )


def inputs(B: int, T: int, K: int, Q: int, Dh: int, dtype, seed: int = 0) -> dict[str, np.ndarray]:
  """Random q, k, v and cotangent, [B, T, ...] in sequence order, on the host."""
  rng = np.random.default_rng(seed)
  shapes = {'q': (B, T, K, Q, Dh), 'k': (B, T, K, Dh), 'v': (B, T, K, Dh)}
  out = {n: rng.standard_normal(s, np.float32).astype(dtype) for n, s in shapes.items()}
  out['cotangent'] = rng.standard_normal(shapes['q'], np.float32)
  return out


def place(host: dict[str, np.ndarray], kernel: str, mesh: Mesh, grad: bool) -> list[jax.Array]:
  """The arguments in the kernel's layout order, split by `ca.sequence_spec` over `mesh`."""
  names = ('q', 'k', 'v', 'cotangent') if grad else ('q', 'k', 'v')
  C = mesh.shape[CONTEXT]
  order = ca.zigzag_order(host['q'].shape[1], C) if kernel == 'ring_zigzag' else None
  out = []
  for n in names:
    x = host[n] if order is None else np.take(host[n], order, axis=1)
    out.append(jax.device_put(x, NamedSharding(mesh, ca.sequence_spec(mesh, CONTEXT, x.ndim))))
  return out


def measure(compiled, args, warmup: int, reps: int) -> tuple[dict[str, Any], Any]:
  """The timings of `reps` calls after `warmup` ones, and the last call's result."""
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  ms = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    ms.append(1e3 * (time.perf_counter() - t0))
  median = statistics.median(ms)
  timing = {
    'median_ms': median,
    'min_ms': min(ms),
    'max_ms': max(ms),
    'noise': (max(ms) - min(ms)) / median,
    'times_ms': ms,
  }
  return timing, out


def run_one(host, kernel: str, mesh: Mesh, block: int, grad: bool, warmup: int, reps: int):
  """Compile (cold), memory, then the timings of one (length, mesh, kernel).

  Returns the row and the result (out, or dq, dk, dv) on the host, in sequence order.
  """
  args = place(host, kernel, mesh, grad)
  t0 = time.perf_counter()
  lowered = program(kernel, mesh, block, grad).lower(*args)
  lower_s = time.perf_counter() - t0
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  try:
    memory = memory_lib.xla_memory(compiled).as_dict()
  except RuntimeError:  # a backend without memory_analysis()
    memory = None
  row = {'lower_s': lower_s, 'compile_s': compile_s, 'memory': memory}
  row['per_device_mib'] = None if memory is None else memory['peak'] / MiB
  timing, out = measure(compiled, args, warmup, reps)
  row.update(timing)
  out = [np.asarray(x, np.float32) for x in jax.tree.leaves(out)]
  if kernel == 'ring_zigzag':
    inverse = ca.zigzag_inverse(out[0].shape[1], mesh.shape[CONTEXT])
    out = [np.take(x, inverse, axis=1) for x in out]
  return row, out


# Comparison and report.


def compare(rows: list[dict]) -> None:
  """Adds 'vs_baseline' (baseline median / this one) and 'tie' to every row of a length."""
  base = next((r for r in rows if r['kernel'] == BASELINE), None)
  for r in rows:
    if base is None:
      r['vs_baseline'], r['tie'] = None, None
      continue
    r['vs_baseline'] = base['median_ms'] / r['median_ms']
    spreads = (r['max_ms'] - r['min_ms']) + (base['max_ms'] - base['min_ms'])
    r['tie'] = r is not base and abs(r['median_ms'] - base['median_ms']) <= spreads


def table(T: int, rows: list[dict], skipped: list[dict], setting: str, baseline: str) -> str:
  lines = [
    f'### T = {T}: {setting}',
    '',
    f'| mesh | kernel | median ms | noise | vs {baseline} | compile s | per-device MiB |',
    '| --- | --- | ---: | ---: | ---: | ---: | ---: |',
  ]
  for r in rows:
    if r['kernel'] == BASELINE:
      vs = 'baseline'
    elif r['vs_baseline'] is None:
      vs = '-'
    else:
      vs = f'{r["vs_baseline"]:.2f}x' + (' tie' if r['tie'] else '')
    mib = '-' if r['per_device_mib'] is None else f'{r["per_device_mib"]:.1f}'
    lines.append(
      f'| {r["mesh"]} | {r["kernel"]} | {r["median_ms"]:.1f} | {100 * r["noise"]:.0f}% | {vs} '
      f'| {r["compile_s"]:.2f} | {mib} |'
    )
  lines += [f'\nskipped: {s["mesh"]} {s["kernel"]}: {s["reason"]}' for s in skipped]
  return '\n'.join(lines)


def device_description() -> dict[str, Any]:
  """The profile's description of the machine (`profiler.hardware`) and the load at the start."""
  from earl_jax.profiling.profiler import hardware

  info = hardware()
  if hasattr(os, 'getloadavg'):
    info['load_average_at_start'] = list(os.getloadavg())
  return info


def main(argv):
  del argv
  lengths = parse_lengths(_LENGTHS.value)
  blocks = _BASELINE_BLOCKS.value
  baseline_blocks = parse_lengths(blocks, flag='--baseline_blocks') if blocks else []
  kernels = parse_kernels(_KERNELS.value)
  for name in _MESHES.value:  # the syntax, before JAX starts
    parse_mesh(name, None)
  runtime.setup(cpu_devices=_CPU_DEVICES.value)
  # Compile seconds are cold: no program comes from (or goes to) the persistent cache.
  jax.config.update('jax_enable_compilation_cache', False)
  N = len(jax.devices())
  # The product against the devices there are.
  pairs = runs_of(_MESHES.value, kernels, N, baseline_blocks)
  baseline = next((m for m, k in pairs if k == BASELINE), f'dp{N}')
  B, K, Q, Dh = _BATCH.value, _KV_HEADS.value, _Q_PER_KV.value, _HEAD_DIM.value
  dtype = jnp.dtype(_DTYPE.value)
  what = 'forward + backward' if _GRAD.value else 'forward'
  setting = (
    f'{what}, B = {B}, K = {K} kv x Q = {Q} query heads, Dh = {Dh}, {_DTYPE.value}, '
    f'{N} x {jax.devices()[0].device_kind}, median of {_REPS.value}'
  )
  result: dict[str, Any] = {
    'experiment': 'context_attention_bench',
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'jax': jax.__version__,
    'flags': {
      'lengths': lengths,
      'batch': B,
      'kv_heads': K,
      'q_per_kv': Q,
      'head_dim': Dh,
      'block': _BLOCK.value,
      'dtype': _DTYPE.value,
      'meshes': list(_MESHES.value),
      'kernels': kernels,
      'baseline_blocks': baseline_blocks,
      'reps': _REPS.value,
      'warmup': _WARMUP.value,
      'grad': _GRAD.value,
      'cpu_devices': _CPU_DEVICES.value,
    },
    'device': device_description(),
    'rows': [],
    'skipped': [],
  }
  tables = []
  for T in lengths:
    host = inputs(B, T, K, Q, Dh, dtype)
    rows, skipped, reference = [], [], None
    for name, kernel in pairs:
      dp, cp = parse_mesh(name, N)
      reason = skip_reason(kernel, dp, cp, B, T, K)
      if reason:
        skipped.append({'length': T, 'mesh': name, 'kernel': kernel, 'reason': reason})
        print(f'T={T} {name} {kernel}: skipped, {reason}', flush=True)
        continue
      row = {'length': T, 'mesh': name, 'dp': dp, 'cp': cp, 'kernel': kernel}
      row['per_device'] = {'rows': B // dp, 'tokens': T // cp}
      timing, out = run_one(
        host, kernel, make_mesh(dp, cp), _BLOCK.value, _GRAD.value, _WARMUP.value, _REPS.value
      )
      row.update(timing)
      # Every run computes the same thing: its result against the first run's (the baseline's
      # when it runs), in sequence order.
      if reference is None:
        reference = (f'{name} {kernel}', out)
      row['checked_against'] = reference[0]
      row['max_abs_diff'] = max(float(np.max(np.abs(a - b))) for a, b in zip(out, reference[1]))
      print(
        f'T={T} {name} {kernel}: {row["median_ms"]:.1f} ms (noise {100 * row["noise"]:.0f}%), '
        f'compile {row["compile_s"]:.2f} s, max |diff| {row["max_abs_diff"]:.1e} against '
        f'{reference[0]}',
        flush=True,
      )
      rows.append(row)
    compare(rows)
    result['rows'] += rows
    result['skipped'] += skipped
    tables.append(table(T, rows, skipped, setting, baseline))
  if hasattr(os, 'getloadavg'):
    result['device']['load_average_at_end'] = list(os.getloadavg())
  text = '\n\n'.join(tables)
  print('\n' + text)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, 'context_attention_bench.json'), 'w') as f:
    json.dump(result, f, indent=2)
  with open(os.path.join(_OUT.value, 'context_attention_bench.md'), 'w') as f:
    f.write(text + '\n')
  print(f'wrote {_OUT.value}/context_attention_bench.{{json,md}}')


if __name__ == '__main__':
  runtime.run(main)
