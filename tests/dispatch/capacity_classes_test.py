"""Capacity classes: the main job's rollout -> experience moves where the layouts alone move
nothing (dp4.tp2 -> dp8 and dp2.tp4 -> dp8, the default's since issue 31's selector prior), so
only the balancing permutation's few rows move, over pairs that change every move."""

import numpy as np
import pytest

from earl_jax.dispatch import DispatchConfig, Dispatcher, Layout, balanced_permutation
from earl_jax.dispatch.schedule import capacity_bucket
from earl_jax.testing import dispatch_bodies as bodies

ROWS, LENGTH, MOVES = 64, 32, 12


def _moves(src_text: str, dst_text: str, seed: int, **config) -> tuple[list[dict], Dispatcher]:
  """MOVES balanced permutations of random episode lengths, each dispatched from a fresh copy
  of the batch on `src` and checked against the dense reference (the host batch permuted).
  Returns per move the bytes that had to move, the wire bytes, the plan and the kernels so far."""
  host = bodies.host_batch(ROWS, LENGTH, seed=seed)
  src, dst = Layout.parse(src_text, host), Layout.parse(dst_text, host)
  d = Dispatcher(DispatchConfig(**config))
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(MOVES):
    # Whole turns of LENGTH // 8 tokens, as the default's episodes are whole turns.
    lengths = rng.integers(1, 9, ROWS) * (LENGTH // 8)
    perm = balanced_permutation(lengths, src, dst, like=host)
    moved, report = d.dispatch(bodies.device_copy(bodies.place(host, src)), dst, src=src, perm=perm)
    assert bodies.check_placed(moved, host, dst, perm) == []
    d.release(moved)
    plan = d.plan(host, src, dst, perm=perm)
    out.append(
      {
        'bytes': report.min_bytes,
        'wire': sum(report.scheduled_sent),
        'plan': plan,
        'kernels': d.traces,
      }
    )
  return out, d


@pytest.mark.parametrize(('src_text', 'dst_text'), [('dp4.tp2', 'dp8'), ('dp2.tp4', 'dp8')])
@pytest.mark.parametrize('seed', [0, 1])
def test_capacity_classes_bound_the_padding_of_a_few_moving_rows(src_text, dst_text, seed):
  """Every move sends its class's capacity over the pairs a permutation may use, the class being
  the capacity bucket of the move's largest pair, so no move pays for an earlier move's largest
  pair; one kernel per class (the
  kernel count is the number of classes seen), fewer kernels and less wire over the sequence than the ring shifts' power-of-two capacities (fec4bf3's fit
  for these moves), and the values equal the dense reference."""
  moves, d = _moves(src_text, dst_text, seed)
  classes = set()
  for m in moves:
    plan = m['plan']
    [group] = plan.groups
    remote = group.counts.copy()
    np.fill_diagonal(remote, 0)
    limit = min(group.src_units, group.dst_units)
    level = capacity_bucket(int(remote.max()), limit, d.config.buckets_per_octave)
    # The class over the reachable pairs ('local' permutations are no rings).
    assert m['wire'] == level * int(group.reach.sum()) * group.unit_bytes
    classes.add(level)
    assert m['bytes'] <= m['wire']
    assert m['kernels'] <= len(classes)  # one kernel per class, compiled once
  assert d.traces == len(classes) <= 3
  shifts, s = _moves(src_text, dst_text, seed, stable_fit='shifts')
  assert [m['bytes'] for m in shifts] == [m['bytes'] for m in moves]
  assert sum(m['wire'] for m in moves) < sum(m['wire'] for m in shifts)
  assert d.traces <= s.traces


def test_a_replicated_source_block_is_sent_by_every_replica():
  """dp2.tp4 -> dp8: each source block is on four devices; the fixed routing takes it from a
  different replica for each target device, so the classes' rounds are one ring shift of every
  device (not four rounds from one replica)."""
  host = bodies.host_batch(ROWS, LENGTH)
  src, dst = Layout.parse('dp2.tp4', host), Layout.parse('dp8', host)
  d = Dispatcher()
  perm = np.arange(ROWS)
  perm[[0, ROWS - 1]] = perm[[ROWS - 1, 0]]  # one row of each half trades places
  plan = d.plan(host, src, dst, perm=perm)
  [group] = plan.groups
  assert group.reach.sum(axis=0).tolist() == [1] * 8  # each target from one replica
  assert group.reach.sum(axis=1).tolist() == [1] * 8  # each replica to one target
  assert len(plan.rounds) == 1


@pytest.mark.parametrize('src_text', ['dp8', 'dp2.tp4'])
def test_ring_moves_send_exactly_what_moves(src_text):
  """dp8 or dp2.tp4 -> dp8 (the default's rollout -> experience moves) with 'ring'
  permutations: every rank sends j rows to the next, so a move's class covers the pairs it uses
  (all of one shift from dp8; the two that cross a source block from dp2.tp4) and the wire
  carries exactly the bytes that move; one kernel per j; the values equal the dense reference."""
  host = bodies.host_batch(ROWS, LENGTH, seed=0)
  src, dst = Layout.parse(src_text, host), Layout.parse('dp8', host)
  d = Dispatcher()
  rng = np.random.default_rng(0)
  per = ROWS // 8
  sent = set()
  for _ in range(MOVES):
    lengths = rng.integers(1, 9, ROWS) * (LENGTH // 8)
    perm = balanced_permutation(lengths, src, dst, like=host, method='ring')
    moved, report = d.dispatch(bodies.device_copy(bodies.place(host, src)), dst, src=src, perm=perm)
    assert bodies.check_placed(moved, host, dst, perm) == []
    d.release(moved)
    slots = np.flatnonzero(perm != np.arange(ROWS))
    if not (perm[slots] // per == (slots // per - 1) % 8).all():
      continue  # 'local' balanced better than any ring for this move
    sent.add(len(slots) // 8)
    assert sum(report.scheduled_sent) == report.min_bytes > 0
  assert len(sent) >= 2
  assert d.traces <= len(sent) + 1  # one kernel per j (and one for a 'local' move)
