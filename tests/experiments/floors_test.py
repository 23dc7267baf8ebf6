"""The transport floors of the dispatch benchmark (experiments/floors.py), across processes."""

import numpy as np
import pytest

from earl_jax.testing import multiprocess
from experiments.floors import SocketMesh


def socket_mesh_exchange(matrix: list[list[int]]) -> dict:
  """One `SocketMesh.exchange` of `matrix`: what this process received from each peer (its
  length and the byte values in it)."""
  mesh = SocketMesh()
  try:
    seconds = mesh.exchange(np.asarray(matrix))
    again = mesh.exchange(np.asarray(matrix))  # the buffers are reused
  finally:
    mesh.close()
  return {
    'seconds': [seconds, again],
    'received': {str(q): [len(b), sorted(set(b.tolist()))] for q, b in mesh.received.items()},
  }


@pytest.mark.multiprocess
def test_socket_mesh_carries_each_pairs_bytes_from_that_peer():
  """3 processes: every pair a different byte count (one pair none); each process receives
  exactly its column of the matrix, and every byte came from the peer it names."""
  matrix = [[0, 5 << 20, 3], [1, 0, 0], [(4 << 20) + 7, 2, 0]]
  results = multiprocess.run(
    'tests.experiments.floors_test:socket_mesh_exchange',
    num_processes=3,
    devices_per_process=1,
    kwargs={'matrix': matrix},
  )
  for p, r in enumerate(results):
    want = {str(q): [matrix[q][p], [q + 1] if matrix[q][p] else []] for q in range(3) if q != p}
    assert r['received'] == want
    assert all(s > 0 for s in r['seconds'])
