"""Stopping a run at a step boundary when it is asked to (preemption, Ctrl-C).

A cluster scheduler or a preemptible VM sends SIGTERM some seconds before it kills a job; a
user presses Ctrl-C (SIGINT). Inside `StopRequests`, the first of either is only recorded: the
loop finishes its step, every process agrees on the stop at the same step (`agreed`, a
collective that makes any process's request every process's), the run saves that step and ends
with `Stopped`, whose exit code is the conventional 128 + the signal's number. A second Ctrl-C
stops at once (KeyboardInterrupt); further SIGTERMs are ignored, the stop being under way. Python
drops an exception raised where nothing can catch it (a garbage-collector callback such as
JAX's, a finalizer) and reports it to `sys.unraisablehook`; inside `StopRequests` that hook
sends the dropped KeyboardInterrupt's SIGINT again, so the run still stops at once.

JAX's own preemption service (`multihost_utils.reached_preemption_sync_point`) plays the same
part for SIGTERM alone: its notifier is a C++ SIGTERM handler, which a Python handler replaces,
and it does not see Ctrl-C. Here both signals are handled in Python and the processes agree
through one small all-gather per step (`distributed.process_max`), on one process none.

  with StopRequests() as stops:
    while training:
      step()
      if signum := stops.agreed():
        save()
        raise Stopped(step, signum, saved=True)

Outside the steps (building the run, its first compiles, the evaluation before the first step, the
plots after the last), there is no step to finish: a job's entry point installs `StopAtOnce`,
under which either signal raises `Stopped` at once, with a line that says so (before the first
step: nothing to save). `StopRequests` takes over while the loop steps, and gives back.
"""

import os
import signal
import sys
import threading
import types

from earl_jax import distributed

SIGNALS = (signal.SIGTERM, signal.SIGINT)


# A BaseException, as KeyboardInterrupt is: no `except Exception` on the way may swallow a stop.
class Stopped(BaseException):
  """The run stopped because it was asked to (SIGTERM or SIGINT): at a step boundary, or at once
  outside the steps (`StopAtOnce`).

  Attributes:
    step: the last step done (and saved, with `saved`); None: the signal came outside the steps
      (`StopAtOnce`), before the first one when `stepped` is False.
    signum: the signal that asked for the stop.
    saved: whether a checkpoint of `step` was written.
    exit_code: 128 + `signum`, the shell's convention for a process ended by a signal.
  """

  def __init__(self, step: int | None, signum: int, *, saved: bool, stepped: bool = True):
    self.step = step
    self.signum = signum
    self.saved = saved
    self.exit_code = 128 + signum
    name = signal.Signals(signum).name
    if step is None and not stepped:
      line = f'stopped by {name} before the first step: nothing to save'
    elif step is None:
      line = f'stopped by {name} after the training steps (their checkpoints are complete)'
    elif saved:
      line = f'stopped at step {step} by {name}; checkpoint saved; resume with --resume'
    else:
      line = f'stopped at step {step} by {name}; this run keeps no checkpoints (checkpoint_every=0)'
    super().__init__(line)


class StopAtOnce:
  """Outside the steps, SIGTERM and SIGINT raise `Stopped` at once (see the module docstring);
  installed for the rest of the process by a job's entry point (`install`, main thread only).
  `stepped`: a `StopRequests` has run inside it (the loop has stepped)."""

  def __init__(self):
    self.stepped = False

  def install(self) -> 'StopAtOnce':
    if threading.current_thread() is threading.main_thread():
      for s in SIGNALS:
        signal.signal(s, self._handle)
    return self

  def _handle(self, signum: int, frame: types.FrameType | None) -> None:
    del frame
    raise Stopped(None, signum, saved=False, stepped=self.stepped)


class StopRequests:
  """Records SIGTERM and SIGINT while inside (see the module docstring); the handlers that were
  there before are put back on exit. Outside the main thread (where Python cannot install signal
  handlers) it records nothing and the signals keep their usual effect."""

  def __init__(self):
    self.signum = 0  # the first signal received (0: none)
    self._previous: dict[int, object] = {}
    self._previous_hook = None

  def __enter__(self) -> 'StopRequests':
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
      for handler in self._previous.values():  # the loop steps: a later stop is after them
        if isinstance(getattr(handler, '__self__', None), StopAtOnce):
          handler.__self__.stepped = True
      self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}
    if self._previous_hook is not None:
      sys.unraisablehook, self._previous_hook = self._previous_hook, None

  def _unraisable(self, unraisable) -> None:
    """A second Ctrl-C's KeyboardInterrupt raised where Python drops it (a gc callback): the
    signal again, handled at the next point where it can stop the run. Anything else goes to
    the previous hook."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.signum:
      # From another thread, a moment later: sent from here it would be handled (and dropped)
      # in this hook.
      resend = threading.Timer(0.01, os.kill, args=(os.getpid(), signal.SIGINT))
      resend.daemon = True
      resend.start()
      return
    self._previous_hook(unraisable)

  def _handle(self, signum: int, frame: types.FrameType | None) -> None:
    del frame
    if self.signum:
      if signum == signal.SIGINT:  # the second Ctrl-C: at once
        raise KeyboardInterrupt
      return
    self.signum = signum
    # os.write, not print: a handler may run in the middle of another write to the stream.
    os.write(
      2,
      f'\n{signal.Signals(signum).name}: stopping at the end of this step, after saving it '
      '(Ctrl-C again to stop at once)\n'.encode(),
    )

  def agreed(self) -> int:
    """The signal that stops every process at this step, or 0 to go on: the same on every
    process (a collective: every process calls it once per step)."""
    return distributed.process_max([self.signum])[0]
