"""Batches for dispatcher tests, and the bodies multi-process tests run in every process.

`host_batch` builds an RL-shaped batch (tokens, loss mask, log-probs, rewards, group ids) on the
host from a seed; `place` puts it on a layout (each process builds only its own shards, so it
works across processes); `check_placed` compares every addressable shard of a dispatched batch
with the host batch, bit for bit, and checks the target sharding.

The `*_body` functions run under `earl_jax.testing.multiprocess.run` in N processes; they return
JSON-serialisable results (per-process booleans and counts) for the test to assert on.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def host_batch(rows: int, length: int, *, seed: int = 0, num_groups: int = 4) -> dict:
  """A host RL batch: [B, T] tokens / loss_mask / logprobs, [B] rewards / group_ids / valid."""
  rng = np.random.default_rng(seed)
  return {
    'tokens': rng.integers(0, 1000, (rows, length)).astype(np.int32),
    'loss_mask': rng.random((rows, length)) > 0.3,
    'logprobs': rng.standard_normal((rows, length)).astype(np.float32),
    'rewards': rng.standard_normal(rows).astype(np.float32),
    'group_ids': (np.arange(rows) % num_groups).astype(np.int32),
    'valid': np.ones(rows, bool),
  }


def place(host: Any, layout: Any) -> Any:
  """The host batch on `layout` (explicit per-device transfers of this process's shards)."""
  shardings = layout.shardings()

  def put(x, sharding):
    index_map = sharding.addressable_devices_indices_map(x.shape)
    arrays = [jax.device_put(np.ascontiguousarray(x[idx]), d) for d, idx in index_map.items()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, arrays)

  return jax.tree.map(put, host, shardings)


def device_copy(tree: Any) -> Any:
  """A copy made on the devices. (A `device_put` of host memory may borrow that memory, and a
  borrowed buffer is copied rather than donated, so donation tests start from device copies.)"""
  return jax.jit(lambda t: jax.tree.map(jnp.copy, t))(tree)


def buffers(x: jax.Array) -> dict:
  """{device: buffer address} of an array's addressable shards."""
  return {s.device: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def check_placed(out: Any, host: Any, layout: Any, perm: np.ndarray | None = None) -> list[str]:
  """Problems with `out` as the host batch (rows permuted by perm) on `layout`; [] if none."""
  problems = []
  expected = host if perm is None else jax.tree.map(lambda x: x[np.asarray(perm)], host)
  flat_out, _ = jax.tree_util.tree_flatten_with_path(out)
  flat_exp = jax.tree.leaves(expected)
  for (path, arr), (want_sharding), exp in zip(
    flat_out, jax.tree.leaves(layout.shardings()), flat_exp
  ):
    name = jax.tree_util.keystr(path)
    if arr.shape != exp.shape or arr.dtype != exp.dtype:
      problems.append(f'{name}: {arr.dtype}{arr.shape} != {exp.dtype}{exp.shape}')
      continue
    if arr.sharding != want_sharding:
      problems.append(f'{name}: sharding {arr.sharding} != {want_sharding}')
    for shard in arr.addressable_shards:
      got = np.asarray(shard.data)
      want = exp[shard.index]
      if got.shape != want.shape or got.tobytes() != want.tobytes():
        problems.append(f'{name}: shard on {shard.device} differs')
  return problems


def dispatch_body(rows: int = 32, length: int = 16, seed: int = 0) -> dict:
  """Every strategy, with and without a permutation, across processes; plus group stats."""
  from earl_jax.dispatch import (
    DispatchConfig,
    Dispatcher,
    Layout,
    balanced_permutation,
    group_stats,
  )
  from earl_jax.dispatch.baselines import link_bytes

  host = host_batch(rows, length, seed=seed)
  results: dict[str, Any] = {'process_index': jax.process_index(), 'problems': {}}
  n = jax.device_count()
  cases = [
    (f'dp{n // 2}.tp2:rep', f'dp{n}'),
    (f'dp{n // 2}.tp2:seq', f'dp{n // 2}.tp2:perm'),
    (f'dp{n}', f'dp{n // 2}.tp2:rep'),
  ]
  dispatcher = Dispatcher(DispatchConfig(strategy='auto', stable_kernels=False, donate=False))
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, length + 1, rows)
  for src_text, dst_text in cases:
    src = Layout.parse(src_text, host)
    dst = Layout.parse(dst_text, host)
    batch = place(host, src)
    perms = {'none': None, 'balanced': balanced_permutation(lengths, src, dst, like=host)}
    for perm_name, perm in perms.items():
      for strategy in ('layout_aware', 'xla', 'gather_scatter', 'allgather', 'auto'):
        guard = 'allow' if strategy in ('gather_scatter', 'allgather') else 'disallow'
        with jax.transfer_guard(guard):
          out, _ = dispatcher.dispatch(batch, dst, src=src, perm=perm, strategy=strategy)
        key = f'{src_text}->{dst_text}/{perm_name}/{strategy}'
        results['problems'][key] = check_placed(out, host, dst, perm)
  # The controller baseline's traffic for the first case: what crosses process 0's links, and
  # the point-to-point transfers of one call.
  src, dst = Layout.parse(cases[0][0], host), Layout.parse(cases[0][1], host)
  batch = place(host, src)
  before = dispatcher.controller.transfers
  dispatcher.dispatch(batch, dst, src=src, strategy='gather_scatter')
  leaves = src.check(batch)
  links = [
    link_bytes(x.shape, x.dtype, src.sharding(i), dst.sharding(i)) for i, x in enumerate(leaves)
  ]
  results['controller'] = {
    'transfers': dispatcher.controller.transfers - before,
    'in': sum(x['in'] for x in links),
    'out': sum(x['out'] for x in links),
    'total': sum(int(x.nbytes) for x in leaves),
    'fields': len(leaves),
  }
  # Group statistics on the target layout, across processes.
  dst = Layout.parse(f'dp{n // 2}.tp2', host)
  batch = place(host, dst)
  mean, std, count = group_stats(
    batch['rewards'], batch['group_ids'], batch['valid'], num_groups=4, mesh=dst.mesh
  )
  ref_mean = np.array([host['rewards'][host['group_ids'] == g].mean() for g in range(4)])
  got = {}
  for shard in mean.addressable_shards:
    got.update(zip(np.arange(rows)[shard.index].tolist(), np.asarray(shard.data).tolist()))
  results['group_mean_ok'] = all(
    abs(v - ref_mean[host['group_ids'][r]]) < 1e-5 for r, v in got.items()
  )
  results['num_local_rows'] = len(got)
  results['traces'] = dispatcher.traces
  # Recycling across processes: donated sources land the next dispatch's outputs.
  recycling = Dispatcher(DispatchConfig(strategy='layout_aware', stable_kernels=False, donate=True))
  src = Layout.parse(f'dp{n}', host)
  rotate = (np.arange(rows) + rows // jax.process_count()) % rows  # every row to the next process
  results['recycled'], results['recycled_problems'] = [], []
  for _ in range(3):
    out, report = recycling.dispatch(device_copy(place(host, src)), src, src=src, perm=rotate)
    results['recycled'].append(report.recycled_bytes)
    results['recycled_problems'] += check_placed(out, host, src, rotate)
  results['local_batch_bytes'] = sum(
    s.data.nbytes for x in jax.tree.leaves(out) for s in x.addressable_shards
  )
  del std, count
  return results
