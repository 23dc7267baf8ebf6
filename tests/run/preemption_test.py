import os
import signal
import sys
import time

import pytest

from earl_jax.run import preemption


def test_the_first_signal_is_recorded_and_the_handlers_are_put_back():
  before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  with preemption.StopRequests() as stops:
    assert stops.agreed() == 0
    os.kill(os.getpid(), signal.SIGTERM)
    assert stops.signum == signal.SIGTERM and stops.agreed() == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)  # again: ignored, the stop is under way
    assert stops.agreed() == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after it: at once
  assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before


def test_a_second_ctrl_c_raises_at_once():
  with preemption.StopRequests() as stops:
    os.kill(os.getpid(), signal.SIGINT)
    assert stops.signum == signal.SIGINT  # the first one: recorded, nothing raised
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)


def test_a_second_ctrl_c_that_lands_in_a_finalizer_still_stops_at_once():
  """Python drops an exception raised in a finalizer or a gc callback (JAX's runs at every
  collection); the second Ctrl-C must not be lost there."""

  class Finalized:
    def __del__(self):
      os.kill(os.getpid(), signal.SIGINT)  # handled here, inside __del__: the raise is dropped

  def second_ctrl_c_in_a_finalizer(stops):
    os.kill(os.getpid(), signal.SIGINT)
    assert stops.signum == signal.SIGINT
    Finalized()
    time.sleep(5)  # interrupted at once when the signal is sent again

  hook = sys.unraisablehook
  with preemption.StopRequests() as stops, pytest.raises(KeyboardInterrupt):
    second_ctrl_c_in_a_finalizer(stops)
  assert sys.unraisablehook is hook


def test_stopped_says_what_to_do_and_exits_with_the_signals_code():
  stopped = preemption.Stopped(7, signal.SIGTERM, saved=True)
  assert str(stopped) == 'stopped at step 7 by SIGTERM; checkpoint saved; resume with --resume'
  assert stopped.exit_code == 143
  assert 'keeps no checkpoints' in str(preemption.Stopped(3, signal.SIGINT, saved=False))
  assert preemption.Stopped(3, signal.SIGINT, saved=False).exit_code == 130
