"""Dispatch latency, the analogue of the paper's Fig. 4: gather_scatter, allgather, xla, layout_aware.

Moves an RL batch between two layouts in N local worker processes (jax.distributed over
loopback, gloo collectives) and times each strategy side by side in the same run.

  python experiments/dispatch_latency.py --out=runs/dispatch.json           # 8 workers x 1 device
  python experiments/dispatch_latency.py --scale=0.1 --out=/tmp/d.json       # quick
  python experiments/dispatch_latency.py --src=dp2.tp4:seq --dst=dp4.tp2 --permutation=none
  python scripts/plot_dispatch.py --json=runs/dispatch.json --out=runs/dispatch.png

Multi-process by default: unless it is already inside a launched group, the script re-launches
itself as --num_workers processes with --devices_per_worker fake CPU devices each
(earl_jax.distributed.launch_local); process 0 prints the table and writes the JSON.

Payload: per worker 46, 93 and 187 MiB at 8K, 16K and 32K context (the paper's Fig. 4, which
moved reference log-probs: f32 [B, T]); --fields=rl moves the whole RL batch instead (tokens,
loss mask, sampling / reference log-probs, advantages, rewards, lengths, group ids) at the same
bytes per worker. --scale multiplies the payload. Rows are rounded down to what the layouts
split evenly.

Strategies (`earl_jax.dispatch.dispatcher`, `earl_jax.dispatch.baselines`): gather_scatter is the paper's single-controller
baseline (every worker's rows to process 0, which scatters each worker's target rows back: N-1
transfers in and N-1 out through its links, staged in its host memory); allgather is a host
all-gather in which every process receives the whole batch; xla is jit with out_shardings;
layout_aware is ours; layout_aware_fresh is the same kernels with recycling off, so every output is
a fresh allocation (with --donate on CPU, layout_aware lands its outputs in the source blocks
spent by its previous call, or in its previous call's outputs, which the benchmark releases once
timed as the main job releases each step's train batch, `DispatchConfig.recycle_buffers` and
`Dispatcher.release`: XLA:CPU has no caching allocator, and first-touch page faults on a fresh
block cost about as much as moving it over loopback).
The bytes that cross the controller's links are reported beside them.

Default movement: every row goes to another process (both layouts dp8 with rows on every device,
and the rows rotated by one process's share). 'xla' applies a rotation as `jnp.roll` (XLA lowers
it to one collective-permute, its best case) and any other permutation as `jnp.take` (XLA lowers
that to an all-gather); with --permutation=none it is a plain jit reshard.

Timing: --warmup calls per strategy (the first compiles; its result is verified bit for bit
against the source on every process, with the target sharding), then --reps rounds in which every
strategy runs once (interleaved, in a rotating order, so background load on the shared machine
hits all strategies alike), each call between barriers (`sync_global_devices`) so every process
is timed on the same interval; a repetition's time is the max over processes; the table reports
the median over repetitions. A recycling layout_aware is also verified on its last warm-up call,
which lands in recycled buffers. With --donate (the default, as in the main job) layout_aware and
xla consume their source batch, so every call gets a fresh on-device copy made before its
barrier and timer.
"""

import dataclasses
import json
import os
import sys
import time

from absl import flags

from earl_jax import distributed, runtime
from earl_jax.errors import UserError

FLAGS = flags.FLAGS
flags.DEFINE_integer(
  'num_workers', 8, 'Worker processes (the paper counts workers).', lower_bound=1
)
flags.DEFINE_integer('devices_per_worker', 1, 'Fake CPU devices per worker process.', lower_bound=1)
flags.DEFINE_list('lengths', ['8192', '16384', '32768'], 'Context lengths T.')
flags.DEFINE_list('payload_mib', ['46', '93', '187'], 'Payload per worker (MiB) per length.')
flags.DEFINE_float(
  'scale', 1.0, 'Multiplies every payload (e.g. 0.05 for a quick run).', lower_bound=1e-9
)
flags.DEFINE_enum('fields', 'logprobs', ['logprobs', 'rl'], 'What the batch holds.')
flags.DEFINE_string('src', 'dp8', "Source layout, '<parallel>[:rep|rows|seq|perm]'.")
flags.DEFINE_string('dst', 'dp8', 'Target layout, same syntax.')
flags.DEFINE_enum(
  'permutation',
  'rotate',
  ['none', 'rotate', 'random', 'balanced'],
  'Row permutation: rotate = every row to the next process; balanced = token balancing of '
  'random lengths (KK).',
)
flags.DEFINE_list(
  'strategies',
  ['gather_scatter', 'allgather', 'xla', 'layout_aware_fresh', 'layout_aware'],
  'Strategies to time (layout_aware_fresh: the same kernels without recycled output buffers).',
)
flags.DEFINE_integer('reps', 5, 'Timed repetitions per strategy (median reported).', lower_bound=1)
flags.DEFINE_integer('warmup', 1, 'Untimed calls per strategy before timing.', lower_bound=1)
flags.DEFINE_enum('collective', 'ppermute', ['ppermute', 'all_to_all'], 'layout_aware rounds.')
flags.DEFINE_integer(
  'gather_chunk_mib', 64, 'allgather: largest global chunk gathered.', lower_bound=1
)
flags.DEFINE_float(
  'pack_max_mib', 4.0, 'layout_aware: rounds up to this size travel as one packed collective.'
)
flags.DEFINE_integer('seed', 0, 'Seed of random permutations and lengths.')
flags.DEFINE_bool(
  'socket_floor',
  True,
  'Also time the transport floors: a raw TCP ring exchange of the same bytes per process, and '
  'the same bytes between the same pairs of processes over a TCP connection per pair.',
)
flags.DEFINE_bool(
  'donate',
  True,
  'Donate the source batch to the layout_aware / xla programs, as the main job does (each call '
  'gets a fresh on-device copy, made before its timer starts).',
)
flags.DEFINE_string('out', None, 'Write the results JSON here.')
flags.DEFINE_float(
  'timeout', 3600.0, 'Seconds before the launched workers are killed.', lower_bound=1.0
)

MiB = 1 << 20


def _fields(kind: str, rows: int, length: int):
  import jax
  import numpy as np

  f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
  if kind == 'logprobs':
    spec = {'ref_logprobs': ((rows, length), f32)}
  else:
    spec = {
      'tokens': ((rows, length), i32),
      'loss_mask': ((rows, length), np.dtype(bool)),
      'logprobs': ((rows, length), f32),
      'ref_logprobs': ((rows, length), f32),
      'advantages': ((rows, length), f32),
      'rewards': ((rows,), f32),
      'lengths': ((rows,), i32),
      'group_ids': ((rows,), i32),
    }
  return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in spec.items()}


def _row_bytes(structs) -> int:
  import numpy as np

  return sum(int(np.prod(s.shape[1:], dtype=np.int64)) * s.dtype.itemsize for s in structs.values())


def _values(salt: int, dtype, rows, cols):
  """Deterministic content of (global rows, global cols): exact in every dtype.

  Filled in row chunks with int32 arithmetic, so that a 187 MiB block needs no more than a few
  MiB of temporaries (8 workers share this machine's memory).
  """
  import numpy as np

  modulus = 16_777_213  # < 2**24: exact in float32
  rows = np.asarray(rows, np.int64)
  a = ((rows * 7919 + salt * 15_485_863) % modulus).astype(np.int32)
  if cols is None:
    v = a
    return (v % 3 == 0) if dtype == np.dtype(bool) else v.astype(dtype)
  b = ((np.asarray(cols, np.int64) * 104_729) % modulus).astype(np.int32)
  out = np.empty((len(rows), len(b)), dtype)
  step = max(1, (4 << 20) // max(1, 4 * len(b)))
  for start in range(0, len(rows), step):
    v = a[start : start + step, None] + b[None, :]  # < 2 * modulus: no int32 overflow
    v %= modulus
    out[start : start + step] = (v % 3 == 0) if dtype == np.dtype(bool) else v
  return out


def _block(salt: int, struct, index, perm=None):
  """The block `index` (tuple of slices) of a field, rows permuted by `perm`."""
  import numpy as np

  shape = struct.shape
  r0, r1, _ = index[0].indices(shape[0])
  rows = np.arange(r0, r1) if perm is None else perm[r0:r1]
  cols = None
  if len(shape) >= 2:
    c0, c1, _ = index[1].indices(shape[1])
    cols = np.arange(c0, c1)
  return _values(salt, struct.dtype, rows, cols)


def _verify(out, structs, salts, shardings, perm) -> bool:
  """Every addressable shard equals the source rows (permuted), bit for bit, with the target
  sharding; compared in row chunks to keep memory low."""
  import numpy as np

  ok = True
  for k, s in structs.items():
    arr = out[k]
    ok &= arr.sharding == shardings[k]
    for shard in arr.addressable_shards:
      got = np.asarray(shard.data)
      r0, r1, _ = shard.index[0].indices(s.shape[0])
      step = 64
      for start in range(r0, r1, step):
        stop = min(r1, start + step)
        index = (slice(start, stop), *shard.index[1:])
        want = _block(salts[k], s, index, perm)
        ok &= got[start - r0 : stop - r0].tobytes() == want.tobytes()
  return bool(ok)


def _run_worker() -> None:
  distributed.initialize_from_env()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils

  from earl_jax.dispatch import (
    DispatchConfig,
    Dispatcher,
    Layout,
    balanced_permutation,
    hlo_received_bytes,
    row_multiple,
  )
  from earl_jax.dispatch.baselines import link_bytes

  n_dev = jax.device_count()
  n_proc = jax.process_count()
  lengths = [int(x) for x in FLAGS.lengths]
  payloads = [float(x) for x in FLAGS.payload_mib]
  # Per-permutation kernels (no stable capacities), as this benchmark has always measured them.
  config = DispatchConfig(
    strategy='auto',
    stable_kernels=False,
    collective=FLAGS.collective,
    gather_chunk_bytes=FLAGS.gather_chunk_mib * MiB,
    pack_max_bytes=int(FLAGS.pack_max_mib * MiB),
    donate=FLAGS.donate,
  )
  dispatcher = Dispatcher(config)
  # layout_aware_fresh: the same kernels, every output a fresh allocation (no recycling).
  fresh_outputs = Dispatcher(dataclasses.replace(config, recycle_buffers=False))

  def run(name: str, batch, dst, perm):
    if name == 'layout_aware_fresh':
      return fresh_outputs.dispatch(batch, dst, perm=perm, strategy='layout_aware', account=False)
    return dispatcher.dispatch(batch, dst, perm=perm, strategy=name, account=False)

  fresh = jax.jit(lambda b: jax.tree.map(jnp.copy, b))  # a donated call consumes its batch
  lead = jax.process_index() == 0
  t_start = time.perf_counter()

  def progress(text: str) -> None:  # the workers run for minutes: say where they are
    if lead:
      print(f'[{time.perf_counter() - t_start:6.1f} s] {text}', flush=True)

  ring = pairs = None
  if FLAGS.socket_floor and n_proc > 1:
    from experiments.floors import SocketMesh, SocketRing

    ring, pairs = SocketRing(), SocketMesh()
  results = []
  for length, payload in zip(lengths, payloads):
    probe = _fields(FLAGS.fields, n_dev, length)
    src = Layout.parse(FLAGS.src, probe)
    dst = Layout.parse(FLAGS.dst, probe)
    multiple = np.lcm(row_multiple(src, dst), n_proc)
    target_rows = payload * FLAGS.scale * MiB * n_proc / _row_bytes(probe)
    rows = max(int(multiple), int(target_rows // multiple) * int(multiple))
    structs = _fields(FLAGS.fields, rows, length)
    salts = {k: i + 1 for i, k in enumerate(structs)}
    rng = np.random.default_rng(FLAGS.seed)
    if FLAGS.permutation == 'none':
      perm = None
    elif FLAGS.permutation == 'rotate':
      perm = (np.arange(rows) + rows // n_proc) % rows
    elif FLAGS.permutation == 'random':
      perm = rng.permutation(rows)
    else:
      real = rng.integers(1, length + 1, rows)
      perm = balanced_permutation(real, src, dst, like=structs)
    src_sh, dst_sh = src.shardings(), dst.shardings()
    batch = {
      k: jax.make_array_from_callback(
        s.shape, src_sh[k], lambda idx, salt=salts[k], s=s: _block(salt, s, idx)
      )
      for k, s in structs.items()
    }
    jax.block_until_ready(batch)
    plan = dispatcher.plan(batch, src, dst, perm=perm)
    links = [link_bytes(st.shape, st.dtype, src_sh[k], dst_sh[k]) for k, st in structs.items()]
    # The floor: every process sends (and receives) as many bytes as its devices send in the
    # plan, over a plain TCP connection to the next process.
    owner = np.array([d.process_index for d in src.mesh.devices.flat])
    floor_bytes = int(max(plan.bytes_sent[owner == q].sum() for q in range(n_proc)))
    # The pairs floor: the same bytes between the same pairs of processes, all at once.
    member = (owner[:, None] == np.arange(n_proc)).astype(np.int64)  # [devices, processes]
    pair_matrix = member.T @ plan.min_matrix @ member
    np.fill_diagonal(pair_matrix, 0)
    entry = {
      'context': length,
      'rows': rows,
      'payload_mib_per_worker': rows * _row_bytes(structs) / n_proc / MiB,
      'median_ms': {},
      'reps_ms': {},
      'verified': {},
    }
    strategies = list(FLAGS.strategies)
    verified = {}
    t_length = time.perf_counter()
    recycles = dispatcher.recycles(src)
    entry['recycle_buffers'] = recycles
    for name in strategies:
      progress(f'{length // 1024}K: warm-up {name}')
      ok = True
      # A recycling dispatch lands in the buffers its first call spent or released: verify one
      # of those too.
      warm = max(1, FLAGS.warmup, 2 if name == 'layout_aware' and recycles else 1)
      for w in range(warm):
        src_batch = jax.block_until_ready(fresh(batch)) if FLAGS.donate else batch
        out, report = run(name, src_batch, dst, perm)
        jax.block_until_ready(out)
        if w in (0, warm - 1):
          ok &= _verify(out, structs, salts, dst_sh, perm)
        if w == warm - 1 and name == 'layout_aware':
          entry['recycled_mib_per_process'] = report.recycled_bytes / MiB
        if name == 'layout_aware':
          dispatcher.release(out)
        del out
      verified[name] = ok
    # Repetitions interleave the strategies (in a rotating order), so that background load on
    # the shared machine hits them alike.
    times = {name: [] for name in strategies}
    if ring is not None:
      times['socket_floor'], times['socket_pairs'] = [], []
      ring.exchange(floor_bytes)  # warm-ups
      pairs.exchange(pair_matrix)
    for rep in range(FLAGS.reps):
      progress(f'{length // 1024}K: repetition {rep + 1}/{FLAGS.reps}')
      for j in range(len(strategies)):
        name = strategies[(rep + j) % len(strategies)]
        src_batch = jax.block_until_ready(fresh(batch)) if FLAGS.donate else batch
        multihost_utils.sync_global_devices('dispatch_latency')
        t0 = time.perf_counter()
        out, _ = run(name, src_batch, dst, perm)
        jax.block_until_ready(out)
        times[name].append(time.perf_counter() - t0)
        if name == 'layout_aware':
          dispatcher.release(out)  # as the main job releases each step's train batch
        del out
      if ring is not None:
        multihost_utils.sync_global_devices('dispatch_latency')
        times['socket_floor'].append(ring.exchange(floor_bytes))
        multihost_utils.sync_global_devices('dispatch_latency')
        times['socket_pairs'].append(pairs.exchange(pair_matrix))
    for name in times:
      all_times = multihost_utils.process_allgather(np.array(times[name]))
      all_times = np.asarray(all_times).reshape(n_proc, -1)
      per_rep = all_times.max(axis=0) * 1e3
      entry['reps_ms'][name] = per_rep.round(3).tolist()
      entry['median_ms'][name] = float(np.median(per_rep))
    for name in strategies:
      all_ok = np.asarray(multihost_utils.process_allgather(np.array([verified[name]]))).all()
      entry['verified'][name] = bool(all_ok)
    entry['socket_floor_bytes_per_process'] = floor_bytes
    entry['socket_pairs_matrix'] = pair_matrix.tolist()
    med = entry['median_ms']
    if 'layout_aware' in med:
      others = ('gather_scatter', 'allgather', 'xla', 'layout_aware_fresh', 'socket_floor',
                'socket_pairs')  # fmt: skip
      for other in others:
        if other in med:
          entry[f'ratio_{other}_over_layout_aware'] = med[other] / med['layout_aware']
    entry['bytes'] = {
      'min_sent_per_device': plan.bytes_sent.tolist(),
      'min_received_per_device': plan.bytes_received.tolist(),
      'layout_aware_sent_per_device': plan.scheduled_sent.tolist(),
      'layout_aware_received_per_device': plan.scheduled_received.tolist(),
      # The allgather brings every other process's rows to each process.
      'allgather_received_per_process': int(rows * _row_bytes(structs) * (n_proc - 1) // n_proc),
      # The controller baseline: what crosses process 0's links, in and out.
      'controller_in': sum(x['in'] for x in links),
      'controller_out': sum(x['out'] for x in links),
    }
    if 'xla' in FLAGS.strategies:
      text = dispatcher.compiled_text(batch, dst, perm=perm, strategy='xla')
      entry['bytes']['xla_received_per_device'] = hlo_received_bytes(text, n_dev).tolist()
    entry['plan'] = plan.summary()
    progress(f'{length // 1024}K: done in {time.perf_counter() - t_length:.0f} s')
    entry['verified_all'] = all(entry['verified'].values())
    results.append(entry)
    del batch
  if lead:
    report = {
      'experiment': 'dispatch_latency',
      'processes': n_proc,
      'devices': n_dev,
      'flags': {
        k: FLAGS[k].value
        for k in (
          'num_workers',
          'devices_per_worker',
          'lengths',
          'payload_mib',
          'scale',
          'fields',
          'src',
          'dst',
          'permutation',
          'strategies',
          'reps',
          'warmup',
          'collective',
          'gather_chunk_mib',
          'pack_max_mib',
          'seed',
          'socket_floor',
          'donate',
        )
      },
      'results': results,
      'verified': all(r['verified_all'] for r in results),
    }
    print(format_table(report), flush=True)
    if FLAGS.out:
      os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
      with open(FLAGS.out, 'w') as f:
        json.dump(report, f, indent=2)
      print(f'wrote {FLAGS.out}', flush=True)


def format_table(report: dict) -> str:
  """The results as a fixed-width table."""
  strategies = report['flags']['strategies']
  floor = any('socket_floor' in r['median_ms'] for r in report['results'])
  head = ['context', 'MiB/worker'] + [f'{s} ms' for s in strategies]
  head += ['socket floor ms', 'pairs floor ms'] if floor else []
  if 'layout_aware' in strategies:
    head += [f'{s}/la' for s in strategies if s != 'layout_aware']
    head += ['la/floor', 'la/pairs'] if floor else []
  head += ['moved MiB/dev', 'controller links MiB', 'verified']
  rows = []
  for r in report['results']:
    row = [f'{r["context"] // 1024}K', f'{r["payload_mib_per_worker"]:.1f}']
    row += [f'{r["median_ms"][s]:.1f}' for s in strategies]
    row += [f'{r["median_ms"][k]:.1f}' for k in ('socket_floor', 'socket_pairs')] if floor else []
    if 'layout_aware' in strategies:
      row += [
        f'{r[f"ratio_{s}_over_layout_aware"]:.1f}x' for s in strategies if s != 'layout_aware'
      ]
      if floor:
        row += [
          f'{1 / r[f"ratio_{k}_over_layout_aware"]:.2f}x' for k in ('socket_floor', 'socket_pairs')
        ]
    row.append(f'{max(r["bytes"]["min_received_per_device"]) / MiB:.1f}')
    b = r['bytes']
    row.append(f'{(b["controller_in"] + b["controller_out"]) / MiB:.0f}')
    row.append(str(r['verified_all']).lower())
    rows.append(row)
  widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
  lines = [
    f'dispatch latency: {report["processes"]} processes, {report["devices"]} devices, '
    f'{report["flags"]["src"]} -> {report["flags"]["dst"]}, permutation '
    f'{report["flags"]["permutation"]}, fields {report["flags"]["fields"]} (median of '
    f'{report["flags"]["reps"]}, max over processes)',
    '  '.join(h.rjust(w) for h, w in zip(head, widths)),
  ]
  lines += ['  '.join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
  return '\n'.join(lines)


STRATEGIES = ('gather_scatter', 'allgather', 'xla', 'layout_aware_fresh', 'layout_aware', 'auto')
KINDS = ('rep', 'rows', 'seq', 'perm')


def check_flags() -> None:
  """Refuses bad flags in one line before any worker starts (UserError)."""
  from earl_jax.config import ParallelConfig

  try:
    lengths = [int(x) for x in FLAGS.lengths]
    payloads = [float(x) for x in FLAGS.payload_mib]
  except ValueError:
    raise UserError(
      f'--lengths {",".join(FLAGS.lengths)} / --payload_mib {",".join(FLAGS.payload_mib)}: '
      'expected integers and numbers'
    ) from None
  if not lengths or min(lengths) < 1 or min(payloads, default=0) <= 0:
    raise UserError(f'--lengths {",".join(FLAGS.lengths)}: expected positive lengths and payloads')
  if len(payloads) != len(lengths):
    raise UserError(
      f'--payload_mib {",".join(FLAGS.payload_mib)}: expected one value per --lengths entry '
      f'({len(lengths)})'
    )
  unknown = [x for x in FLAGS.strategies if x not in STRATEGIES]
  if unknown or not FLAGS.strategies:
    raise UserError(f'--strategies {",".join(unknown)}: expected any of {", ".join(STRATEGIES)}')
  devices = FLAGS.num_workers * FLAGS.devices_per_worker
  for name in ('src', 'dst'):
    text = FLAGS[name].value
    parallel, _, kind = text.partition(':')
    if kind and kind not in KINDS:
      raise UserError(f'--{name} {text}: expected a kind among {", ".join(KINDS)} after the colon')
    n = ParallelConfig.parse(parallel).num_devices
    if n != devices:
      raise UserError(
        f'--{name} {text}: expected a layout over {devices} devices (--num_workers '
        f'{FLAGS.num_workers} x --devices_per_worker {FLAGS.devices_per_worker}), not {n}'
      )


def main(argv) -> None:
  del argv
  if distributed.process_env() is None:
    check_flags()
  if distributed.process_env() is None and FLAGS.num_workers > 1:
    distributed.launch_local(
      [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
      num_processes=FLAGS.num_workers,
      devices_per_process=FLAGS.devices_per_worker,
      timeout=FLAGS.timeout,
      stream_process=0,
    )
    return
  if distributed.process_env() is None:
    import jax

    jax.config.update('jax_num_cpu_devices', FLAGS.devices_per_worker)
  _run_worker()


if __name__ == '__main__':
  runtime.run(main)
