"""XLA's memory analysis against running a program, and the per-device budget."""

import re

import pytest

from earl_jax.programs import memory
from earl_jax.testing import multiprocess

MiB = memory.MiB


@pytest.mark.multiprocess
def test_xla_feasibility_agrees_with_running_near_the_budget_edge():
  # 16 responses x 1024 of a model whose weights weigh megabytes: dp1.tp8 holds an eighth of
  # them, dp2.tp4 a quarter, on top of the same K/V cache per device. Put the budget between
  # their peaks, then really run both and measure what each held (in a fresh process, since the
  # measurement reads the process's resident memory).
  bucket, rows = 1024, 16
  [r] = multiprocess.run(
    'earl_jax.testing.mp_bodies:rollout_peaks_near_a_budget',
    num_processes=1,
    devices_per_process=8,
    kwargs={'bucket': bucket, 'rows': rows, 'small': 'dp1.tp8', 'big': 'dp2.tp4'},
  )
  small, big, budget = r['dp1.tp8'], r['dp2.tp4'], r['budget']
  assert small['need'] < budget < big['need']
  assert re.search(r'dp2\.tp4.*needs .* MiB per device.*Refused', r['refused'])
  for c in (small, big):
    assert c['decoded_to'] == bucket  # it decoded N tokens into the last slots
    # The run's peak is read from the process's resident memory, the least of 3 runs: a single
    # run was seen from -7% to +10% of XLA's figure (allocator pages and thread scratch).
    assert abs(c['measured'] - c['need']) <= 0.10 * c['need'], c
  assert small['measured'] <= budget < big['measured']


def test_device_budget_on_cpu_needs_an_emulated_figure():
  with pytest.raises(ValueError, match="platform 'cpu' report no memory limit"):
    memory.device_budget()
  assert memory.device_budget(emulated=64 * MiB) == 64 * MiB


def test_a_peak_extrapolated_from_fewer_layers_is_near_the_whole_models():
  """`compiled_peak` (experiments/context_fit.py `--xla_layers`): the peaks of 2 and 3 layers of
  a 4-layer model, extrapolated to 4, against the 4-layer program's own (the train step on dp8
  and on a context-parallel layout, and the experience forward)."""
  from earl_jax.config import ModelConfig, ParallelConfig
  from earl_jax.programs import Executables
  from earl_jax.stage import Stage

  model = ModelConfig.preset('tiny').replace(num_layers=4)
  cells = [
    (Stage.TRAIN, 'dp8', 512),
    (Stage.TRAIN, 'dp2.cp4', 1024),
    (Stage.EXPERIENCE, 'dp8', 1024),
  ]
  with Executables(model) as whole:
    truth = memory.compiled_peak([whole], 4)
    expected = [truth(s, ParallelConfig.parse(n), t) for s, n, t in cells]
  with (
    Executables(model.replace(num_layers=2)) as two,
    Executables(model.replace(num_layers=3)) as three,
  ):
    extrapolated = memory.compiled_peak([two, three], 4)
    got = [extrapolated(s, ParallelConfig.parse(n), t) for s, n, t in cells]
  for cell, g, e in zip(cells, got, expected):
    assert g == pytest.approx(e, rel=0.02), cell
