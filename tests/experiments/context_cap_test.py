"""Fig. 1's summary: the capped buckets, and the smoothed return's peak and fall."""

import pytest

from earl_jax.errors import UserError
from experiments import context_cap


def test_capped_buckets_stop_at_the_cap():
  assert context_cap.capped_buckets((128, 256, 384, 512), 300, 60) == (128, 256, 300)
  with pytest.raises(UserError, match='--cap 50: expected at least the first turn'):
    context_cap.capped_buckets((128, 256), 50, 60)
  with pytest.raises(UserError, match='expected less than the largest bucket, 256'):
    context_cap.capped_buckets((128, 256), 256, 60)


def test_smoothed_is_the_trailing_mean():
  assert context_cap.smoothed([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
  assert context_cap.smoothed([2.0, 4.0], window=5) == [2.0, 3.0]


def test_peak_and_fall_of_a_return_that_rises_then_collapses():
  steps = list(range(1, 13))
  # Rises to 0 at step 6, then falls to -1 and stays there.
  returns = [-1.0, -0.8, -0.6, -0.4, -0.2, 0.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]
  r = context_cap.peak_and_fall(steps, returns)
  ref = [
    sum(returns[max(0, i - 4) : i + 1]) / len(returns[max(0, i - 4) : i + 1]) for i in range(12)
  ]
  i = max(range(12), key=ref.__getitem__)
  assert r['peak_step'] == steps[i] == 6 and r['peak'] == pytest.approx(-0.4)
  assert r['low_after_peak'] == pytest.approx(-1.0) and r['last'] == pytest.approx(-1.0)
  assert r['fall'] == pytest.approx(0.6)
  # A return that only rises does not fall.
  rising = context_cap.peak_and_fall(steps, [0.1 * s for s in steps])
  assert rising['peak_step'] == 12 and rising['fall'] == 0.0
