"""Routing plans (pure numpy): schedules, capacities, replica choice, determinism."""

import collections

import jax
import numpy as np
import pytest

from earl_jax.dispatch import Layout, PlanOptions, balanced_permutation, capacity_bucket, make_plan
from earl_jax.dispatch import plan as plan_lib
from earl_jax.dispatch import schedule as schedule_lib
from earl_jax.testing import dispatch_bodies as bodies

ROWS, LENGTH = 32, 16


def _plan(src_text, dst_text, perm=None, **kw):
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = Layout.parse(src_text, host), Layout.parse(dst_text, host)
  leaves = src.check(host)
  shapes, dtypes = [x.shape for x in leaves], [x.dtype for x in leaves]
  return make_plan(src, dst, shapes, dtypes, perm=perm, options=PlanOptions(**kw))


def test_capacity_buckets_bound_the_padding():
  for per_octave in (1, 2, 4, 8):
    previous = 0
    for count in range(1, 600):
      cap = capacity_bucket(count, 10_000, per_octave)
      assert cap >= count and cap >= previous
      if count >= per_octave:
        assert cap - count <= count / per_octave
      previous = cap
  assert capacity_bucket(0, 10, 4) == 0
  assert capacity_bucket(9, 10, 1) == 10  # never above the limit


def test_konig_colouring_uses_max_degree_rounds_of_valid_matchings():
  rng = np.random.default_rng(0)
  for _ in range(20):
    n = 8
    pairs = {(int(s), int(d)) for s, d in rng.integers(0, n, (20, 2)) if s != d}
    edges = [(s, d, 1) for s, d in sorted(pairs)]
    rounds = schedule_lib._konig_colouring(edges, n)
    degree = max(
      max(sum(1 for s, _, _ in edges if s == k), sum(1 for _, d, _ in edges if d == k))
      for k in range(n)
    )
    assert len(rounds) == degree
    assert sorted((s, d) for r in rounds for s, d, _ in r) == sorted(pairs)
    for r in rounds:
      assert len({s for s, _, _ in r}) == len(r) == len({d for _, d, _ in r})


def test_sequence_to_rows_takes_three_uniform_rounds():
  plan = _plan('dp2.tp4:seq', 'dp8')
  seq = next(i for i, g in enumerate(plan.groups) if g.fields[0].unit_shape)
  assert len(plan.rounds) == 3
  assert all(len(r.pairs) == 8 and r.caps[seq] for r in plan.rounds)
  # Small rounds carry the [B, T] fields in one collective per item size (int32 tokens and f32
  # log-probs together, the bool mask apart).
  assert all(r.packed for r in plan.rounds) and plan.num_collectives == 6
  assert plan.scheduled_bytes == plan.min_bytes
  unpacked = _plan('dp2.tp4:seq', 'dp8', pack_max_bytes=0)
  assert unpacked.num_collectives == 9 and unpacked.scheduled_bytes == plan.scheduled_bytes


def test_whole_block_permutation_is_one_round_with_self_pairs():
  plan = _plan('dp2.tp4:perm', 'dp8')
  (group,) = plan.groups
  (rnd,) = plan.rounds
  assert (0, 0) in rnd.pairs and (7, 7) in rnd.pairs
  assert group.send_ops[0].kind == 'full' and group.out_op.kind == 'full'
  # Self pairs are local copies: not counted as moved.
  assert plan.scheduled_bytes == plan.min_bytes == 6 * plan.bytes_received.max()


def test_replicated_source_spreads_sending_over_replicas():
  # Swap the two data halves: every target block lives on the 4 tensor replicas of the other
  # half; each replica should send one block rather than one replica sending four.
  perm = np.concatenate([np.arange(16, 32), np.arange(16)])
  plan = _plan('dp2.tp4', 'dp8', perm=perm, static=True)
  assert len(set(plan.bytes_sent.tolist())) == 1
  assert plan.min_bytes == plan.bytes_received.sum() > 0


def test_replicated_source_to_fewer_replicas_is_local():
  plan = _plan('dp2.tp4', 'dp4.tp2')
  assert plan.is_local and plan.min_bytes == 0


def test_plans_are_deterministic_and_bucketed_structure_ignores_row_order():
  rng = np.random.default_rng(1)
  perm = rng.permutation(ROWS)
  a = _plan('dp8', 'dp2.tp4:seq', perm=perm)
  b = _plan('dp8', 'dp2.tp4:seq', perm=perm)
  for ga, gb in zip(a.groups, b.groups):
    for ta, tb in zip(ga.send_tables, gb.send_tables):
      assert (ta is None and tb is None) or np.array_equal(ta, tb)
    assert (ga.out_table is None and gb.out_table is None) or np.array_equal(
      ga.out_table, gb.out_table
    )
  shuffled = np.concatenate([rng.permutation(block) for block in perm.reshape(2, -1)])
  assert _plan('dp8', 'dp2.tp4:seq', perm=shuffled).structure() == a.structure()
  assert not a.static
  assert all(c == capacity_bucket(c, 10**9, 4) for r in a.rounds for c in r.caps)


def test_every_strategy_of_schedule_routes_every_unit_once():
  plan = _plan('dp4.tp2:seq', 'dp2.tp4:perm', perm=np.random.default_rng(2).permutation(ROWS))
  for gi, g in enumerate(plan.groups):
    # counts[:, d] sums to the target's units; rounds carry every remote unit.
    np.testing.assert_array_equal(g.counts.sum(axis=0), [g.dst_units] * g.num_devices)
    remote = g.counts.copy()
    np.fill_diagonal(remote, 0)
    carried = np.zeros_like(remote)
    for r in plan.rounds:
      for s, d in r.pairs:
        if s != d:
          carried[s, d] += r.caps[gi]
    assert np.all(carried >= remote)


def _large_plan(src_text, dst_text, perm, rows=512, length=8192, **kw):
  """A plan for a batch big enough that bytes, not per-round latency, set the schedule's cost
  (plans never touch the payload, so this stays cheap)."""
  structs = {
    'logprobs': jax.ShapeDtypeStruct((rows, length), np.float32),
    'lengths': jax.ShapeDtypeStruct((rows,), np.int32),
  }
  src, dst = Layout.parse(src_text, structs), Layout.parse(dst_text, structs)
  leaves = src.check(structs)
  shapes, dtypes = [x.shape for x in leaves], [x.dtype for x in leaves]
  return make_plan(src, dst, shapes, dtypes, perm=perm, options=PlanOptions(**kw))


@pytest.mark.parametrize('static', [True, None])
def test_uneven_pairs_are_cut_over_rounds_so_each_device_receives_its_minimum(static):
  # Sequence-split rows rotated by one device's share: devices 0, 1, 4, 5 receive a lot from 3
  # devices, devices 2, 3, 6, 7 a little from 7. Whole pairs per round pad the small receivers'
  # rounds to the big pairs; cut in two, the big pairs fill max-degree rounds evenly.
  rows = 512
  perm = (np.arange(rows) + rows // 8) % rows
  plan = _large_plan('dp2.tp4:seq', 'dp4.tp2', perm, static=static)
  seq = next(i for i, g in enumerate(plan.groups) if g.fields[0].unit_shape)
  counts = plan.groups[seq].counts
  assert sorted(set(counts[counts > 0].tolist())) == [64, 128]
  uses = collections.Counter(pair for r in plan.rounds for pair in r.pairs)
  assert max(uses.values()) == 2 and len(plan.rounds) == 7
  # The busiest receiver gets exactly its minimum; the rest pad only a few [B] rows.
  assert plan.scheduled_received.max() == plan.bytes_received.max()
  assert plan.scheduled_bytes <= 1.001 * plan.min_bytes
  # Over the fixed ring shifts, every device's rounds would have carried 1.57x as much.
  groups = plan.groups
  limits = [min(g.src_units, g.dst_units) for g in groups]
  ring = schedule_lib._bucketed_rounds([g.counts for g in groups], limits, 4)

  def padded(rounds):
    return sum(c * g.unit_bytes for r in rounds for c, g in zip(r.caps, groups))

  assert padded(ring) > 1.5 * padded(plan.rounds) == 1.5 * plan.scheduled_received.max()


def test_even_pairs_keep_the_ring_shifts():
  perm = np.random.default_rng(3).permutation(512)
  plan = _large_plan('dp8', 'dp8', perm)
  assert [r.pairs for r in plan.rounds] == [
    tuple((s, (s + k) % 8) for s in range(8)) for k in range(1, 8)
  ]


def test_bad_permutation_shapes():
  with pytest.raises(ValueError, match='outside'):
    plan_lib.check_permutation(np.arange(1, ROWS + 1), ROWS)


@pytest.mark.parametrize(
  ('src_text', 'dst_text', 'perm_kind', 'options'),
  [
    ('dp4.tp2:seq', 'dp2.tp4', 'none', {}),  # static
    ('dp8', 'dp8', 'random', {}),  # bucketed
    ('dp8', 'dp4.tp2', 'random', {'stable': True}),
    ('dp2.tp4', 'dp8:perm', 'random', {'collective': 'all_to_all'}),
  ],
)
def test_landing_plans_scatter_every_target_unit_from_where_the_gather_reads_it(
  src_text, dst_text, perm_kind, options
):
  """With `land`, an output that would gather from the pool of received buffers is a 'scatter':
  the local section's slots and source units, then every round's received units in pool order,
  each written to the slot the gather would have filled with it; padding slots are dst_units."""
  perm = None if perm_kind == 'none' else np.random.default_rng(5).permutation(ROWS)
  gathered = _plan(src_text, dst_text, perm=perm, **options)
  landed = _plan(src_text, dst_text, perm=perm, land=True, land_min_bytes=0, **options)
  assert landed.rounds == gathered.rounds
  pairs = [(g, h) for g, h in zip(gathered.groups, landed.groups) if g.out_op.kind == 'gather']
  assert pairs  # every case has a gathered output
  for g, h in pairs:
    assert h.out_op.kind == 'scatter'
    width, table = h.out_op.updates, h.out_table
    for d in range(g.num_devices):
      slots, units = table[d, 0], table[d, 1]
      written = slots[slots < g.dst_units]
      np.testing.assert_array_equal(np.sort(written), np.arange(g.dst_units))  # each slot once
      for j, at in enumerate(g.out_table[d]):
        if at < g.src_units:  # a local unit: in the local section, with its source unit
          [pos] = np.nonzero(slots[:width] == j)[0]
          assert units[pos] == at
        else:  # a received unit: at its pool position past the local section
          assert slots[width + at - g.src_units] == j
    local = int(max((g.out_table[d] < g.src_units).sum() for d in range(g.num_devices)))
    if perm is None:
      assert width == local  # static: exact
    elif options.get('stable'):
      assert width >= local and width & (width - 1) == 0  # a power of two
    else:
      assert width == capacity_bucket(local, g.dst_units, 4)


def test_stable_landing_plans_keep_their_local_section_in_the_floor():
  """Stable plans record the scatter's local width in their floor (`Floor.local`); a later
  permutation that keeps fewer rows local keeps that width (the same kernel structure)."""
  perm = np.random.default_rng(6).permutation(ROWS)
  first = _plan('dp8', 'dp4.tp2', perm=perm, stable=True, land=True, land_min_bytes=0)
  floor = first.floor
  assert floor.local == tuple(g.out_op.updates for g in first.groups) and max(floor.local) > 0
  again = _plan('dp8', 'dp4.tp2', perm=np.arange(ROWS)[::-1].copy(), stable=True, land=True, land_min_bytes=0,
                floor=floor)  # fmt: skip
  assert all(a >= f for a, f in zip(again.floor.local, floor.local))
  grown = plan_lib.Floor(pairs=floor.pairs, local=tuple(2 * w for w in floor.local))
  wider = _plan('dp8', 'dp4.tp2', perm=perm, stable=True, land=True, land_min_bytes=0, floor=grown)
  assert [g.out_op.updates for g in wider.groups] == [
    min(2 * w, g.dst_units) for w, g in zip(floor.local, wider.groups)
  ]


def test_landing_scatters_only_when_the_rounds_carry_enough_bytes():
  """Below LAND_MIN_BYTES received per device a landing plan keeps the gather (its buffers stay
  small; the scatter chain only compiles slower); a Fig. 4-sized batch scatters."""
  perm = np.random.default_rng(7).permutation(ROWS)
  assert _plan('dp8', 'dp8', perm=perm, land=True).groups[0].out_op.kind == 'gather'
  assert _plan('dp8', 'dp8', perm=perm, land=True, land_min_bytes=0).groups[0].out_op.kind == (
    'scatter'
  )
  perm = np.random.default_rng(7).permutation(4096)  # 16 MiB per device
  big = _large_plan('dp8', 'dp8', perm, rows=4096, land=True)
  received = sum(r.caps[0] * big.groups[0].unit_bytes for r in big.rounds)
  assert received >= plan_lib.LAND_MIN_BYTES
  assert {g.out_op.kind for g in big.groups} == {'scatter'}


def test_plan_options_are_validated():
  # Under the test suite's runtime type checker a bad Literal is a TypeError before __post_init__.
  with pytest.raises((ValueError, TypeError), match='collective'):
    PlanOptions(collective='allreduce')
  with pytest.raises(ValueError, match=r'buckets_per_octave must be an int >= 1, got 0'):
    PlanOptions(buckets_per_octave=0)
  with pytest.raises(ValueError, match=r'pack_max_bytes must be an int >= 0, got -1'):
    PlanOptions(pack_max_bytes=-1)
  with pytest.raises(ValueError, match=r'land_min_bytes must be an int >= 0, got -8'):
    PlanOptions(land=True, land_min_bytes=-8)
  # Under the test suite's runtime type checker a bad annotation is a TypeError first.
  with pytest.raises((ValueError, TypeError), match='fit'):
    PlanOptions(stable=True, fit='rings')
  with pytest.raises(ValueError, match=r'max_padding must be a number >= 1, got 0.5'):
    PlanOptions(max_padding=0.5)
  floor = plan_lib.Floor(pairs=(np.zeros((8, 8), np.int64),), local=(0,))
  with pytest.raises(ValueError, match='floor is for stable plans only'):
    PlanOptions(floor=floor)
  with pytest.raises((ValueError, TypeError), match='floor'):
    PlanOptions(stable=True, floor={1: (4,)})
  with pytest.raises(ValueError, match='stable=True needs a bucketed plan'):
    PlanOptions(stable=True, static=True)
  with pytest.raises(ValueError, match=r'one non-negative \[n, n\] capacity matrix'):
    plan_lib.Floor(pairs=(np.zeros((8, 4), np.int64),), local=(0,))
  pairs = np.ones((8, 8), np.int64)
  floor = plan_lib.Floor(pairs=(pairs,), local=(0,))
  pairs[0, 1] = 64  # the floor keeps its own copy
  assert floor.pairs[0][0, 1] == 1
  other = plan_lib.Floor(pairs=(pairs, pairs), local=(0, 0))  # two groups: another plan's
  with pytest.raises(ValueError, match='a floor serves only the layouts and shapes'):
    _plan('dp8', 'dp4.tp2', perm=np.arange(ROWS)[::-1].copy(), stable=True, floor=other)


def test_stable_options_shape_only_permuted_plans():
  """`stable` and its `floor` change only plans given a permutation: without one, or with the
  identity and no floor, the plan is the one without them; the identity with a floor takes the
  floor's kernel; with a permutation, the floor sets the capacities."""
  perm = np.random.default_rng(8).permutation(ROWS)
  assert _plan('dp8', 'dp4.tp2', stable=True).structure() == _plan('dp8', 'dp4.tp2').structure()
  identity = np.arange(ROWS)
  assert _plan('dp8', 'dp4.tp2', perm=identity, stable=True).structure() == (
    _plan('dp8', 'dp4.tp2', perm=identity).structure()
  )
  stable = _plan('dp8', 'dp4.tp2', perm=perm, stable=True)
  assert stable.floor is not None and _plan('dp8', 'dp4.tp2', perm=perm).floor is None
  floored = _plan('dp8', 'dp4.tp2', perm=identity, stable=True, floor=stable.floor)
  assert floored.floor.fits(stable.floor)  # a stable plan, at least the floor
  again = _plan('dp8', 'dp4.tp2', perm=perm, stable=True, floor=floored.floor)
  assert again.structure() == floored.structure()  # both fit: one kernel
  doubled = plan_lib.Floor(pairs=tuple(2 * p for p in stable.floor.pairs), local=stable.floor.local)
  raised = _plan('dp8', 'dp4.tp2', perm=perm, stable=True, floor=doubled)
  assert all((r == p).all() for r, p in zip(raised.floor.pairs, doubled.pairs))
  assert raised.scheduled_bytes > stable.scheduled_bytes


def test_stable_plans_route_from_fixed_replicas_and_provision_what_later_moves_reach():
  """dp4.tp2 -> dp2.tp4 (the main job's move): stable plans take each source block from one
  fixed replica per target device, so every permutation's pairs lie in `reach` (one sender per
  block a device lacks). The first plan also provisions every reachable pair while that keeps
  the wire within the padding budget; with no budget (max_padding=1) it provisions only what
  the move needs."""
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = Layout.parse('dp4.tp2', host), Layout.parse('dp2.tp4', host)
  rng = np.random.default_rng(12)
  reach = None
  for _ in range(4):
    perm = balanced_permutation(rng.integers(1, 16, ROWS), src, dst, like=host)
    plan = _plan('dp4.tp2', 'dp2.tp4', perm=perm, stable=True)
    [group] = plan.groups
    reach = group.reach if reach is None else reach
    np.testing.assert_array_equal(group.reach, reach)  # the same for every permutation
    off = group.counts.copy()
    np.fill_diagonal(off, 0)
    assert not (off.astype(bool) & ~reach).any()
    assert (reach.sum(axis=0) == 3).all()  # 4 source blocks, one held locally
    assert (plan.floor.pairs[0][reach] > 0).all() and not plan.floor.pairs[0][~reach].any()
    tight = _plan('dp4.tp2', 'dp2.tp4', perm=perm, stable=True, max_padding=1.0)
    np.testing.assert_array_equal(tight.floor.pairs[0] > 0, off > 0)
    assert plan.min_bytes <= tight.scheduled_bytes <= plan.scheduled_bytes
