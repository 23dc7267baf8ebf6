"""The local multi-process launcher: processes join one JAX group over loopback."""

import jax
import pytest

from earl_jax import distributed
from earl_jax.testing import multiprocess


def test_eight_fake_devices():
  assert jax.device_count() == 8
  assert [d.id for d in jax.devices()] == list(range(8))


@pytest.mark.multiprocess
def test_two_processes_see_one_global_mesh():
  results = multiprocess.run(
    'earl_jax.testing.mp_bodies:global_psum', num_processes=2, devices_per_process=2
  )
  assert [r['process_index'] for r in results] == [0, 1]
  for r in results:
    assert r['device_count'] == 4
    assert r['local_device_count'] == 2
    # Each device contributes its global index: 0 + 1 + 2 + 3.
    assert r['psum'] == 6.0


def test_launch_reports_failures_with_stderr():
  with pytest.raises(distributed.LaunchError, match='boom'):
    distributed.launch_local(
      ['python', '-c', 'import sys; sys.stderr.write("boom\\n"); sys.exit(3)'],
      num_processes=2,
      devices_per_process=1,
      timeout=60,
    )
