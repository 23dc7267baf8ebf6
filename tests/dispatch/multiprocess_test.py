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
