"""The dispatcher on 8 fake devices: every strategy delivers the batch bit for bit, with the
target sharding, without touching the host (layout_aware, xla), moving the bytes the plan says."""

import jax
import numpy as np
import pytest

from earl_jax.dispatch import (
  DispatchConfig,
  Dispatcher,
  Layout,
  LayoutError,
  balanced_permutation,
  hlo_collective_counts,
  hlo_received_bytes,
)
from earl_jax.dispatch import dispatcher as dispatcher_lib
from earl_jax.testing import dispatch_bodies as bodies

ROWS, LENGTH = 32, 16


def _config(**overrides) -> DispatchConfig:
  """The settings these tests were written against (auto, per-permutation kernels, no donation),
  with `overrides`; `DispatchConfig()` itself holds the main job's."""
  return DispatchConfig(
    **{'strategy': 'auto', 'stable_kernels': False, 'donate': False, **overrides}
  )


PARALLEL = ['dp8', 'dp4.tp2', 'dp2.tp4', 'dp1.tp8', 'dp2.fsdp2.tp2', 'dp4.fsdp2']
KINDS = ['rep', 'rows', 'seq', 'perm']


def _layout(text, host):
  return Layout.parse(text, host)


def _random_cases(count, seed):
  rng = np.random.default_rng(seed)
  cases = []
  for _ in range(count):
    src = f'{rng.choice(PARALLEL)}:{rng.choice(KINDS)}'
    dst = f'{rng.choice(PARALLEL)}:{rng.choice(KINDS)}'
    perm = str(rng.choice(['none', 'random', 'balanced']))
    cases.append((src, dst, perm))
  return cases


def _perm(kind, host, src, dst, seed=0):
  rng = np.random.default_rng(seed)
  if kind == 'none':
    return None
  if kind == 'random':
    return rng.permutation(ROWS)
  from earl_jax.dispatch import balanced_permutation

  return balanced_permutation(rng.integers(1, LENGTH + 1, ROWS), src, dst, like=host)


@pytest.mark.parametrize(('src_text', 'dst_text', 'perm_kind'), _random_cases(14, seed=20251005))
def test_layout_aware_property(src_text, dst_text, perm_kind):
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout(src_text, host), _layout(dst_text, host)
  perm = _perm(perm_kind, host, src, dst)
  batch = bodies.place(host, src)
  dispatcher = Dispatcher(_config(strategy='layout_aware'))
  with jax.transfer_guard('disallow'):
    out, report = dispatcher.dispatch(batch, dst, src=src, perm=perm)
    jax.block_until_ready(out)
  assert bodies.check_placed(out, host, dst, perm) == []
  plan = dispatcher.plan(batch, src, dst, perm=perm)
  # The compiled kernel moves exactly what the plan schedules, never less than the minimum.
  hlo = hlo_received_bytes(dispatcher.compiled_text(batch, dst, src=src, perm=perm), 8)
  np.testing.assert_array_equal(hlo, plan.scheduled_received)
  assert np.all(plan.scheduled_received >= plan.bytes_received)
  assert report.bytes_received == tuple(plan.bytes_received.tolist())
  assert report.scheduled_received == tuple(plan.scheduled_received.tolist())
  if perm is None:
    # Layout-only plans have exact capacities; with uniform blocks nothing is padded.
    assert plan.scheduled_bytes == plan.min_bytes


@pytest.mark.parametrize(
  ('src_text', 'dst_text', 'perm_kind'),
  [('dp2.tp4:seq', 'dp4.tp2', 'balanced'), ('dp2.tp4:rep', 'dp8:perm', 'random')],
)
@pytest.mark.parametrize('strategy', ['xla', 'gather_scatter', 'allgather', 'auto'])
def test_other_strategies_deliver_the_same_batch(src_text, dst_text, perm_kind, strategy):
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout(src_text, host), _layout(dst_text, host)
  perm = _perm(perm_kind, host, src, dst)
  batch = bodies.place(host, src)
  dispatcher = Dispatcher(_config(gather_chunk_bytes=256))  # forces column chunks
  guard = 'allow' if strategy in ('gather_scatter', 'allgather') else 'disallow'
  with jax.transfer_guard(guard):
    out, report = dispatcher.dispatch(batch, dst, src=src, perm=perm, strategy=strategy)
  assert bodies.check_placed(out, host, dst, perm) == []
  assert report.strategy == ('layout_aware' if strategy == 'auto' else strategy)


def test_sequence_sharded_to_tp2_moves_the_minimum_and_xla_moves_more():
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp2.tp4:seq', host), _layout('dp4.tp2', host)
  batch = bodies.place(host, src)
  dispatcher = Dispatcher(_config())
  plan = dispatcher.plan(batch, src, dst)
  # Each device holds a quarter of its target rows' columns and receives the other three
  # quarters of B/4 rows x T of tokens (4 B), loss mask (1 B) and log-probs (4 B); [B] fields
  # are replicated over tensor in the source and already local.
  per_device = 3 * (ROWS // 4) * (LENGTH // 4) * (4 + 1 + 4)
  np.testing.assert_array_equal(plan.bytes_received, [per_device] * 8)
  assert plan.scheduled_bytes == plan.min_bytes
  la = hlo_received_bytes(dispatcher.compiled_text(batch, dst, src=src), 8)
  xla = hlo_received_bytes(dispatcher.compiled_text(batch, dst, src=src, strategy='xla'), 8)
  np.testing.assert_array_equal(la, plan.bytes_received)
  assert xla.sum() >= 2 * la.sum()


def test_auto_picks_noop_rewrap_local_slice_and_kernel():
  host = bodies.host_batch(ROWS, LENGTH)
  d = Dispatcher(_config())
  dp8 = _layout('dp8', host)
  batch = bodies.place(host, dp8)
  with jax.transfer_guard('disallow'):
    same, report = d.dispatch(batch, dp8)
    assert report.strategy == 'noop' and same is batch
    # Same blocks on the same devices, another mesh: re-wrapped, zero copy.
    rows42 = _layout('dp4.tp2:rows', host)
    out, report = d.dispatch(batch, rows42)
    assert report.strategy == 'rewrap'
    assert bodies.check_placed(out, host, rows42) == []
    assert (
      out['logprobs'].addressable_shards[3].data.unsafe_buffer_pointer()
      == batch['logprobs'].addressable_shards[3].data.unsafe_buffer_pointer()
    )
    # A TP-replicated rollout batch: every target block is already local.
    rep = _layout('dp2.tp4', host)
    rep_batch = bodies.place(host, rep)
    out, report = d.dispatch(rep_batch, dp8)
    assert report.strategy == 'layout_aware' and report.min_bytes == 0
    assert bodies.check_placed(out, host, dp8) == []
  assert hlo_collective_counts(d.compiled_text(rep_batch, dp8), 8) == {}


def test_new_permutation_with_same_structure_does_not_retrace():
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp2.tp4', host), _layout('dp4.tp2', host)
  batch = bodies.place(host, src)
  d = Dispatcher(_config(strategy='layout_aware'))
  rng = np.random.default_rng(3)
  perm1 = rng.permutation(ROWS)
  # Same rows per (source, target) pair, in another order inside each target rank.
  perm2 = np.concatenate([rng.permutation(block) for block in perm1.reshape(4, -1)])
  with jax.transfer_guard('disallow'):
    out1, r1 = d.dispatch(batch, dst, perm=perm1)
    out2, r2 = d.dispatch(batch, dst, perm=perm2)
  assert (
    d.plan(batch, src, dst, perm=perm1).structure()
    == d.plan(batch, src, dst, perm=perm2).structure()
  )
  assert r1.compiled and not r2.compiled
  assert d.traces == 1
  assert bodies.check_placed(out1, host, dst, perm1) == []
  assert bodies.check_placed(out2, host, dst, perm2) == []
  # An RL loop: a new balancing permutation every step compiles once per capacity structure.
  from earl_jax.dispatch import balanced_permutation

  structures = set()
  for step in range(6):
    lengths = np.random.default_rng(100 + step).integers(1, LENGTH + 1, ROWS)
    perm = balanced_permutation(lengths, src, dst, like=host)
    structures.add(d.plan(batch, src, dst, perm=perm).structure())
    with jax.transfer_guard('disallow'):
      out, _ = d.dispatch(batch, dst, perm=perm)
    assert bodies.check_placed(out, host, dst, perm) == []
  assert d.traces == 1 + len(structures - {d.plan(batch, src, dst, perm=perm1).structure()})


@pytest.mark.parametrize(
  ('src_text', 'dst_text', 'collective', 'pack_max_bytes'),
  [
    ('dp2.tp4:seq', 'dp8', 'all_to_all', 1 << 20),
    ('dp8', 'dp4.tp2', 'all_to_all', 0),
    ('dp2.tp4:seq', 'dp2.fsdp2.tp2:perm', 'ppermute', 0),
    ('dp4.tp2:rep', 'dp8:seq', 'ppermute', 0),
  ],
)
def test_collective_kinds_and_unpacked_rounds(src_text, dst_text, collective, pack_max_bytes):
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout(src_text, host), _layout(dst_text, host)
  batch = bodies.place(host, src)
  config = _config(strategy='layout_aware', collective=collective, pack_max_bytes=pack_max_bytes)
  for perm in (None, np.random.default_rng(5).permutation(ROWS)):
    d = Dispatcher(config)
    with jax.transfer_guard('disallow'):
      out, report = d.dispatch(batch, dst, src=src, perm=perm)
    assert bodies.check_placed(out, host, dst, perm) == []
    plan = d.plan(batch, src, dst, perm=perm)
    text = d.compiled_text(batch, dst, src=src, perm=perm)
    kind = 'all-to-all' if collective == 'all_to_all' else 'collective-permute'
    counts = hlo_collective_counts(text, 8)
    assert set(counts) <= {kind}
    assert sum(counts.values()) == plan.num_collectives == report.num_collectives
    assert all(r.packed == (pack_max_bytes > 0) for r in plan.rounds)
    np.testing.assert_array_equal(hlo_received_bytes(text, 8), plan.scheduled_received)


def test_timed_report_and_donation():
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp8', host), _layout('dp2.tp4:seq', host)
  d = Dispatcher(_config(strategy='layout_aware', timed=True, donate=True))
  batch = bodies.place(host, src)
  out, report = d.dispatch(batch, dst, src=src)
  assert report.wall_s is not None and report.wall_s > 0
  assert report.num_collectives > 0 and report.min_bytes > 0
  assert bodies.check_placed(out, host, dst) == []


def test_bad_permutations_are_rejected():
  host = bodies.host_batch(ROWS, LENGTH)
  src = _layout('dp8', host)
  batch = bodies.place(host, src)
  d = Dispatcher(_config())
  with pytest.raises(LayoutError, match='repeats rows'):
    d.dispatch(batch, src, perm=np.zeros(ROWS, np.int64))
  with pytest.raises(LayoutError, match=r'shape \(32,\).*got int64 \(31,\)'):
    d.dispatch(batch, src, perm=np.arange(ROWS - 1))


def test_config_validation():
  with pytest.raises(ValueError, match='strategy must be one of'):
    DispatchConfig(strategy='broadcast')
  # Under the test suite's runtime type checker a bad Literal is a TypeError before __post_init__.
  with pytest.raises((ValueError, TypeError), match='collective'):
    DispatchConfig(collective='allreduce')
  with pytest.raises(ValueError, match='buckets_per_octave'):
    DispatchConfig(buckets_per_octave=0)
  with pytest.raises((ValueError, TypeError), match='stable_fit'):
    DispatchConfig(stable_fit='rings')
  for bad in (0.9, float('nan'), True, '2'):
    with pytest.raises((ValueError, TypeError), match='max_padding'):
      DispatchConfig(max_padding=bad)
  assert DispatchConfig(max_padding=float('inf')).max_padding == float('inf')


@pytest.mark.parametrize('dst_text', ['dp4.tp2', 'dp8'])
def test_stable_kernels_serve_every_permutation_with_one_compile(dst_text):
  """A training loop balances with a new permutation every step: with stable kernels, every
  permutation whose rows fit the same capacities reuses one compiled kernel (also
  where the blocks match, dp8 -> dp8, whose output could be a slot update)."""
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp8', host), _layout(dst_text, host)
  batch = bodies.place(host, src)
  rng = np.random.default_rng(7)
  stable = Dispatcher(_config(strategy='layout_aware', stable_kernels=True))
  plain = Dispatcher(_config(strategy='layout_aware'))
  structures = set()
  for _ in range(6):
    perm = np.arange(ROWS)
    swap = rng.choice(ROWS, 4, replace=False)  # a few rows change place, as balancing does
    perm[swap] = perm[swap[::-1]]
    for d in (stable, plain):
      out, _ = d.dispatch(batch, dst, src=src, perm=perm)
      assert bodies.check_placed(out, host, dst, perm) == []
    plan = stable.plan(batch, src, dst, perm=perm)
    structures.add(plan.structure())
    assert all(op.kind == 'gather' for g in plan.groups for op in g.send_ops)
  assert stable.traces == len(structures) < plain.traces


def test_stable_capacities_per_pair_only_grow_and_idle_pairs_send_nothing():
  """dp8 -> dp2.tp4 with a few rows swapped: each (source, target) pair gets its own capacity
  and only pairs with one are in a round; a later permutation that fits keeps the capacities
  (no compile), and one that needs more raises them where it must (one compile)."""
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp8', host), _layout('dp2.tp4', host)
  batch = bodies.place(host, src)
  d = Dispatcher(_config(strategy='layout_aware', stable_kernels=True))

  def run(*swaps):
    perm = np.arange(ROWS)
    for a, b in swaps:
      perm[[a, b]] = perm[[b, a]]
    out, _ = d.dispatch(batch, dst, src=src, perm=perm)
    assert bodies.check_placed(out, host, dst, perm) == []
    return d.plan(batch, src, dst, perm=perm)

  first = run((0, 31), (1, 30))
  traces = d.traces
  [pairs] = first.floor.pairs
  sent = {p for r in first.rounds for p in r.pairs}
  assert sent == {(int(s), int(t)) for s, t in zip(*np.nonzero(pairs))}  # idle pairs: no round
  again = run((0, 30), (1, 31))  # another permutation that fits: the same kernel
  assert again.structure() == first.structure() and d.traces == traces
  grown = run((0, 31), (1, 30), (2, 29), (3, 28), (4, 27), (8, 23))
  assert d.traces == traces + 1
  assert (grown.floor.pairs[0] >= pairs).all() and (grown.floor.pairs[0] > pairs).any()


def _balanced_moves(src_text, dst_text, moves, *, rows, length, seed, **config):
  """Moves a batch from src to dst under `moves` balanced permutations of random lengths with
  a stable-kernel Dispatcher; returns (per move (bytes that had to move, wire bytes), the
  dispatcher). Every move's values are checked against the host batch permuted."""
  host = bodies.host_batch(rows, length, seed=seed)
  src, dst = _layout(src_text, host), _layout(dst_text, host)
  d = Dispatcher(DispatchConfig(**config))
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(moves):
    lengths = rng.integers(1, 16, rows) * length // 16
    perm = balanced_permutation(lengths, src, dst, like=host)
    moved, report = d.dispatch(bodies.device_copy(bodies.place(host, src)), dst, src=src, perm=perm)
    assert bodies.check_placed(moved, host, dst, perm) == []
    d.release(moved)
    out.append((report.min_bytes, sum(report.scheduled_sent)))
  return out, d


@pytest.mark.parametrize(('src_text', 'dst_text'), [('dp4.tp2', 'dp2.tp4'), ('dp8', 'dp2.tp4')])
def test_stable_kernels_bound_the_padding_over_balanced_permutations(src_text, dst_text):
  """The main job's rollout -> experience moves (the layouts move rows, the balancing a few
  more): after the first moves, every move puts at most `max_padding` (1.5) times the bytes that
  must move on the wire, with a few kernels, and the values equal the dense reference. The
  earlier capacities (one power of two per ring shift) pad about twice."""
  kwargs = {'rows': 64, 'length': 32, 'seed': 3}
  moves, d = _balanced_moves(src_text, dst_text, 16, **kwargs)
  assert d.config.max_padding == 1.5
  for needed, wire in moves[4:]:
    assert needed <= wire <= 1.5 * needed
  assert d.traces <= 4
  shifts, _ = _balanced_moves(
    src_text, dst_text, 16, stable_fit='shifts', max_padding=float('inf'), **kwargs
  )
  assert sum(w for _, w in shifts[4:]) > 1.5 * sum(n for n, _ in shifts[4:])


def test_stable_capacities_shed_after_a_run_of_smaller_moves():
  """Many rows balanced once, then a few for several moves: the capacities the big move raised
  pad the small ones beyond `max_padding`; after `_SHED_AFTER` of them the floor is rebuilt from
  their own needs (one compile) and the wire is back within the bound."""
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp4.tp2', host), _layout('dp2.tp4', host)
  d = Dispatcher(DispatchConfig())

  def move(*rows):
    perm = np.arange(ROWS)
    for a in rows:  # row a of rank 0 (the first half) trades places with row ROWS-1-a of rank 1
      perm[[a, ROWS - 1 - a]] = perm[[ROWS - 1 - a, a]]
    out, report = d.dispatch(bodies.device_copy(bodies.place(host, src)), dst, src=src, perm=perm)
    assert bodies.check_placed(out, host, dst, perm) == []
    return sum(report.scheduled_sent) / report.min_bytes

  assert move(0, 1, 2, 3, 4, 5) <= 1.5
  traces = d.traces
  # One row each (a new permutation each time): the first also needs base rows the big move
  # did not (a growth, one compile); all are padded beyond the bound by the big capacities.
  over = [move(6 + k) for k in range(dispatcher_lib._SHED_AFTER - 1)]
  assert all(r > 1.5 for r in over) and d.traces == traces + 1
  assert move(0) <= 1.5 and d.traces == traces + 2  # rebuilt from the small moves' needs
  assert move(1) <= 1.5 and move(2) <= 1.5 and d.traces == traces + 2  # and they fit it


@pytest.mark.parametrize('dst_text', ['dp8', 'dp4.tp2'])
def test_stable_kernels_settle_where_a_few_rows_move_over_changing_pairs(dst_text):
  """A few rows swapped each move: no floor is tight (a few rows over pairs that change every
  move). dp8 -> dp8 (the layouts alone move nothing) takes capacity classes from the first move
  (every reachable pair at the class of the move's largest pair, tests/dispatch/
  capacity_classes_test.py); dp8 -> dp4.tp2 fits per ring shift after
  `_FLOORS_BEFORE_SETTLING` floors. Either way a handful of kernels, not one per move."""
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp8', host), _layout(dst_text, host)
  batch = bodies.place(host, src)
  d = Dispatcher(_config(strategy='layout_aware', stable_kernels=True))
  rng = np.random.default_rng(11)
  structures, plans = [], []
  for _ in range(24):
    perm = np.arange(ROWS)
    swap = rng.choice(ROWS, 2, replace=False)
    perm[swap] = perm[swap[::-1]]
    plans.append(d.plan(batch, src, dst, perm=perm))
    if plans[-1].structure() not in structures:
      structures.append(plans[-1].structure())
  assert len(structures) <= dispatcher_lib._FLOORS_BEFORE_SETTLING + 3
  [state] = d._capacities.values()
  assert state.settled and state.shifts == (dst_text == 'dp4.tp2')
  assert state.classes == (dst_text == 'dp8')
  ring = lambda plan: all(len({(t - s) % 8 for s, t in r.pairs}) == 1 for r in plan.rounds)  # noqa: E731
  if dst_text == 'dp8':  # every pair at one unit whichever two rows move, or none (same rank)
    assert len(structures) <= 2
    for p in plans:
      assert (p.floor.pairs[0] == 1 - np.eye(8, dtype=int)).all() or not p.rounds
  else:
    assert ring(plans[-1]) and not ring(plans[0])


def test_rows_that_stay_in_their_slot_are_not_gathered_again():
  """dp8 -> dp8 with a few rows swapped between devices: the output op writes only the arriving
  rows into the local block (from the received buffers alone, so a donated block is updated in
  place), and the batch arrives bit for bit, donated or not."""
  host = bodies.host_batch(ROWS, LENGTH)
  src = dst = _layout('dp8', host)
  perm = np.arange(ROWS)
  perm[[1, 6, 13]] = perm[[13, 1, 6]]  # three rows on three devices change place
  for donate in (True, False):
    d = Dispatcher(_config(strategy='layout_aware', donate=donate))
    batch = bodies.place(host, src)
    [group] = d.plan(batch, src, dst, perm=perm).groups
    assert group.out_op.kind == 'update' and group.out_op.region == 1
    assert group.out_op.updates == 1  # one slot per device
    out, _ = d.dispatch(batch, dst, src=src, perm=perm)
    assert bodies.check_placed(out, host, dst, perm) == []
    if not donate:  # the source is still whole
      assert bodies.check_placed(batch, host, src) == []
  # A row moving within its device is read from the whole pool (region 0).
  perm = np.arange(ROWS)
  perm[[0, 1, 8]] = perm[[1, 8, 0]]
  d = Dispatcher(_config(strategy='layout_aware'))
  batch = bodies.place(host, src)
  [group] = d.plan(batch, src, dst, perm=perm).groups
  assert group.out_op.kind == 'update' and group.out_op.region == 0
  out, _ = d.dispatch(batch, dst, src=src, perm=perm)
  assert bodies.check_placed(out, host, dst, perm) == []


def _pointers(tree) -> dict:
  """{(leaf, device): buffer address} of every addressable shard."""
  return {
    (i, d): at for i, x in enumerate(jax.tree.leaves(tree)) for d, at in bodies.buffers(x).items()
  }


@pytest.mark.parametrize('perm_kind', ['rotate', 'random'])
def test_donated_dispatches_land_in_the_previous_sources_memory(perm_kind):
  """On CPU a donating dispatcher recycles: the second dispatch's outputs are written into the
  very buffers its first source occupied (no fresh allocation), report those bytes, and arrive
  bit for bit; the pool holds at most two spent batches."""
  host = bodies.host_batch(ROWS, LENGTH)
  src = _layout('dp8', host)
  perm = (
    (np.arange(ROWS) + ROWS // 8) % ROWS
    if perm_kind == 'rotate'
    else np.random.default_rng(3).permutation(ROWS)
  )
  d = Dispatcher(_config(strategy='layout_aware', donate=True))
  assert d.recycles(src)
  first = bodies.device_copy(bodies.place(host, src))
  first_at = _pointers(first)
  out, report = d.dispatch(first, src, src=src, perm=perm)
  assert report.recycled_bytes == 0  # nothing spent yet: fresh landing buffers
  assert all(x.is_deleted() for x in jax.tree.leaves(first))  # donated
  assert bodies.check_placed(out, host, src, perm) == []
  batch_bytes = sum(x.nbytes for x in jax.tree.leaves(out))
  del out
  out, report = d.dispatch(bodies.place(host, src), src, src=src, perm=perm)
  assert bodies.check_placed(out, host, src, perm) == []
  assert report.recycled_bytes == batch_bytes
  assert _pointers(out) == first_at
  for _ in range(3):
    out, _ = d.dispatch(bodies.place(host, src), src, src=src, perm=perm)
  assert bodies.check_placed(out, host, src, perm) == []
  assert d._pool.nbytes <= 2 * batch_bytes


def test_recycling_is_off_without_donation_or_when_asked():
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp8', host), _layout('dp4.tp2', host)
  assert not Dispatcher(_config(strategy='layout_aware')).recycles(src)
  d = Dispatcher(_config(strategy='layout_aware', donate=True, recycle_buffers=False))
  assert not d.recycles(src)
  for _ in range(2):
    batch = bodies.place(host, src)
    out, report = d.dispatch(batch, dst, src=src)
    assert report.recycled_bytes == 0 and bodies.check_placed(out, host, dst) == []
  with pytest.raises(ValueError, match='recycle_buffers=True needs donate=True'):
    DispatchConfig(recycle_buffers=True, donate=False)


def test_a_buffer_held_by_two_fields_is_donated_and_recycled_once():
  """Reference log-probs are the policy's own array when there is no reference model: the
  recycling kernel takes that buffer once, and both fields still arrive."""
  host = bodies.host_batch(ROWS, LENGTH)
  host['ref_logprobs'] = host['logprobs']
  src, dst = _layout('dp8', host), _layout('dp4.tp2', host)
  d = Dispatcher(_config(strategy='layout_aware', donate=True))
  for _ in range(3):
    batch = dict(bodies.device_copy(bodies.place(host, src)))
    batch['ref_logprobs'] = batch['logprobs']
    out, _ = d.dispatch(batch, dst, src=src)
    assert bodies.check_placed(out, host, dst) == []


def test_released_batches_land_outputs_larger_than_the_spent_sources():
  """dp8 -> dp4.tp2: every target block is twice a source block, so spent sources cannot land
  the outputs. A released batch (the last step's, done with) can: the next dispatch writes
  into its very buffers, reports those bytes and arrives bit for bit; the released arrays are
  deleted (donated). Without recycling, release is a no-op."""
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp8', host), _layout('dp4.tp2', host)
  perm = np.random.default_rng(4).permutation(ROWS)
  d = Dispatcher(_config(strategy='layout_aware', donate=True))
  out, report = d.dispatch(bodies.device_copy(bodies.place(host, src)), dst, src=src, perm=perm)
  assert report.recycled_bytes == 0
  out, report = d.dispatch(bodies.device_copy(bodies.place(host, src)), dst, src=src, perm=perm)
  assert report.recycled_bytes == 0  # the spent source blocks are half the size
  assert bodies.check_placed(out, host, dst, perm) == []
  released_at = _pointers(out)
  out_bytes = sum(s.data.nbytes for x in jax.tree.leaves(out) for s in x.addressable_shards)
  assert d.release(out) == out_bytes
  released = out
  out, report = d.dispatch(bodies.device_copy(bodies.place(host, src)), dst, src=src, perm=perm)
  assert report.recycled_bytes == out_bytes and _pointers(out) == released_at
  assert bodies.check_placed(out, host, dst, perm) == []
  assert all(x.is_deleted() for x in jax.tree.leaves(released))
  assert d.release(released) == 0  # deleted arrays are skipped
  plain = Dispatcher(_config(strategy='layout_aware'))
  assert plain.release(out) == 0 and plain._pool.nbytes == 0
  assert bodies.check_placed(out, host, dst, perm) == []  # untouched


def test_the_default_config_is_the_main_jobs_path():
  """`DispatchConfig()` holds the main job's settings: layout_aware kernels with stable
  capacities (row gathers whatever the permutation), donating the source, and on CPU landing the
  outputs in recycled buffers."""
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = _layout('dp8', host), _layout('dp4.tp2', host)
  d = Dispatcher()
  assert d.config.strategy.value == 'layout_aware' and d.recycles(src)
  perm = np.random.default_rng(9).permutation(ROWS)
  batch = bodies.device_copy(bodies.place(host, src))
  out, report = d.dispatch(batch, dst, src=src, perm=perm)
  assert report.strategy == 'layout_aware' and report.requested == 'layout_aware'
  assert all(x.is_deleted() for x in jax.tree.leaves(batch))  # donated
  assert bodies.check_placed(out, host, dst, perm) == []
  plan = d.plan(bodies.place(host, src), src, dst, perm=perm)
  assert all(op.kind == 'gather' for g in plan.groups for op in g.send_ops)  # stable
  assert plan.floor is not None and d.config.stable_fit == 'pairs'  # capacities per pair
