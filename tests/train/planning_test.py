"""The stage planner's precompiles of a train plan's neighbours (`StagePlanner.precompile`): each
key once, with the train state as it is laid out now (so that its move is compiled too)."""

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


def test_lookahead_is_precompiled_with_the_train_state():
  exe = _Executables()
  placement = types.SimpleNamespace(state='train state')
  with unchecked():  # stand-ins for the run's parts
    planner = StagePlanner(None, None, None, exe, placement, log=print)
  dp8, fsdp8 = ParallelConfig(dp=8), ParallelConfig(fsdp=8)
  planner.precompile([(Stage.TRAIN, dp8, 512, 64), (Stage.TRAIN, fsdp8, 256, 64)])
  assert exe.started == [
    ((Stage.TRAIN, 'dp8.tp1', 512, 64), 'train state'),
    ((Stage.TRAIN, 'dp1.fsdp8.tp1', 256, 64), 'train state'),
  ]
