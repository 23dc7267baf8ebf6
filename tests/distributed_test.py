"""The local multi-process launcher: processes join one JAX group over loopback."""

import sys

import jax
import pytest

from earl_jax import distributed
from earl_jax.testing import multiprocess


def test_eight_fake_devices():
  assert jax.device_count() == 8
  assert [d.id for d in jax.devices()] == list(range(8))


@pytest.mark.multiprocess
def test_two_processes_see_one_global_mesh():
  # The unterminated stdout line stands for gloo's "[Gloo] Rank 0 is connected ..." message,
  # which once landed in the middle of a printed result and failed CI.
  results = multiprocess.run(
    'earl_jax.testing.mp_bodies:global_psum',
    num_processes=2,
    devices_per_process=2,
    kwargs={'stdout_noise': '[Gloo] Rank 0 is connected to 1 peer ranks.'},
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


def test_launch_gives_each_child_its_id_devices_and_environment_in_process_order():
  show = 'import os; e = os.environ; print(e["EARL_PROCESS_ID"], e["EARL_NUM_PROCESSES"], '
  show += 'e["EARL_LOCAL_DEVICES"], e["EARL_COORDINATOR"], e["XLA_FLAGS"], e["EXTRA"])'
  results = distributed.launch_local(
    [sys.executable, '-c', show],
    num_processes=3,
    devices_per_process=2,
    env={'EXTRA': 'x', 'XLA_FLAGS': '--xla_force_host_platform_device_count=8 --other'},
    timeout=60,
  )
  assert [r.process_id for r in results] == [0, 1, 2]
  coordinators = set()
  for r in results:
    pid, count, devices, coordinator, *flags, extra = r.stdout.split()
    assert (pid, count, devices, extra) == (str(r.process_id), '3', '2', 'x')
    # The child's own device count replaces any earlier one; other flags stay.
    assert flags == ['--other', '--xla_force_host_platform_device_count=2']
    coordinators.add(coordinator)
  assert len(coordinators) == 1 and coordinators.pop().startswith('127.0.0.1:')


def test_launch_times_out_and_kills_every_child():
  with pytest.raises(distributed.LaunchError, match=r'2 of 2 processes failed \(timed out after 2'):
    distributed.launch_local(
      [sys.executable, '-c', 'import time; time.sleep(120)'],
      num_processes=2,
      devices_per_process=1,
      timeout=2.0,
    )


@pytest.mark.multiprocess
def test_processes_agree_on_small_values_and_hold_their_rows():
  r0, r1 = multiprocess.run(
    'earl_jax.testing.mp_bodies:agreement_and_rows', num_processes=2, devices_per_process=4
  )
  for r in (r0, r1):
    assert r['min'] == 10 and r['min_none'] == 5 and r['max'] == [1, 7]
    assert r['json'] == {'from': 0, 'cells': [0, 1, 2]}  # process 0's, everywhere
    # Row i from the first process that holds it: 0-2 from process 0, 3-7 from process 1.
    assert r['rows'] == [100, 101, 102, 203, 204, 205, 206, 207]
    for layout in r['layouts'].values():
      assert layout['back'] and layout['total'] == sum(range(16))
  # dp8 and dp2.tp4 split the rows between the processes; dp1.tp8 replicates them on both.
  assert r0['layouts']['dp8']['rows'] == list(range(8))
  assert r1['layouts']['dp8']['rows'] == list(range(8, 16))
  assert r0['layouts']['dp2.tp4']['rows'] == list(range(8))
  assert r0['layouts']['dp1.tp8']['rows'] == r1['layouts']['dp1.tp8']['rows'] == list(range(16))
