"""The dispatcher across processes: 2 processes x 4 devices over loopback (gloo)."""

import pytest

from earl_jax.testing import multiprocess


@pytest.mark.multiprocess
def test_two_processes_dispatch_every_strategy():
  results = multiprocess.run(
    'earl_jax.testing.dispatch_bodies:dispatch_body',
    num_processes=2,
    devices_per_process=4,
    kwargs={'rows': 32, 'length': 16},
  )
  assert [r['process_index'] for r in results] == [0, 1]
  for r in results:
    # 3 layout pairs x 2 permutations x 5 strategies, each checked shard by shard.
    assert len(r['problems']) == 30
    assert {k: v for k, v in r['problems'].items() if v} == {}
    assert r['group_mean_ok']
    # The first recycling dispatch allocates; the next ones land in the spent sources.
    assert r['recycled_problems'] == []
    assert r['recycled'] == [0, r['local_batch_bytes'], r['local_batch_bytes']]
    assert r['num_local_rows'] == 16
    # dp4.tp2 (rows replicated over tensor) -> dp8 through process 0: process 1 holds half the
    # unique source blocks (2 of 4, sent once each) and half the target devices (4 of 8).
    c = r['controller']
    assert c['in'] == c['out'] == c['total'] // 2
    assert c['transfers'] == c['fields'] * (2 + 4)


@pytest.mark.multiprocess
def test_socket_mesh_carries_each_pairs_bytes_from_that_peer():
  """3 processes: every pair a different byte count (one pair none); each process receives
  exactly its column of the matrix, and every byte came from the peer it names."""
  matrix = [[0, 5 << 20, 3], [1, 0, 0], [(4 << 20) + 7, 2, 0]]
  results = multiprocess.run(
    'earl_jax.testing.mp_bodies:socket_mesh_exchange',
    num_processes=3,
    devices_per_process=1,
    kwargs={'matrix': matrix},
  )
  for p, r in enumerate(results):
    want = {str(q): [matrix[q][p], [q + 1] if matrix[q][p] else []] for q in range(3) if q != p}
    assert r['received'] == want
    assert all(s > 0 for s in r['seconds'])
