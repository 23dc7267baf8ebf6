"""The stage planner's precompiles of a train plan's neighbours (`StagePlanner.precompile`): after
the update, and held back while a profile measurement waits for a quiet step boundary."""

import types

from earl_jax.config import ParallelConfig
from earl_jax.stage import Stage
from earl_jax.testing.typecheck import unchecked
from earl_jax.train.planning import StagePlanner


class _Executables:
  """What `precompile` asks of `Executables`: keys, and the background compiles started."""

  def __init__(self):
    self.started = []

  def key(self, stage, config, bucket, rows):
    return (stage, config.name, bucket, rows)

  def precompile(self, key, *, tree=None):
    self.started.append((key, tree))


def test_lookahead_waits_while_a_measurement_holds_precompiles():
  scheduler = types.SimpleNamespace(hold_precompiles=False)
  exe = _Executables()
  placement = types.SimpleNamespace(state='train state')
  with unchecked():  # stand-ins for the run's parts
    planner = StagePlanner(None, None, scheduler, exe, placement, log=print)
  dp8, fsdp8 = ParallelConfig(dp=8), ParallelConfig(fsdp=8)
  up, down = (Stage.TRAIN, dp8, 512, 64), (Stage.TRAIN, fsdp8, 256, 64)
  planner.precompile([up])
  assert exe.started == [((Stage.TRAIN, 'dp8.tp1', 512, 64), 'train state')]
  exe.started.clear()
  scheduler.hold_precompiles = True  # a compiled cell waits for a quiet boundary
  planner.precompile([up, down])
  assert exe.started == []
  scheduler.hold_precompiles = False  # measured: the held ones go with the next step's
  planner.precompile([down])
  assert [k for k, _ in exe.started] == [
    (Stage.TRAIN, 'dp8.tp1', 512, 64),
    (Stage.TRAIN, 'dp1.fsdp8.tp1', 256, 64),
  ]
  planner.precompile([])
  assert len(exe.started) == 2  # each once
