"""Placement: the one retry protocol for decisions XLA refuses, and the train state, reference
parameters and stage copies, each on its layout."""

import dataclasses

import jax
import numpy as np
import pytest

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.profiling.table import Cell, Profile
from earl_jax.programs import Executables, StageSpec, memory
from earl_jax.selector.selector import ProfileSettings, Selector, SelectorConfig, StepStats
from earl_jax.stage import Stage
from earl_jax.testing.configs import smoke_experiment
from earl_jax.train.placement import StagePlacement, decide_compiled, tree_bytes

DP8, DP4TP2, TP8 = ParallelConfig(dp=8), ParallelConfig(dp=4, tp=2), ParallelConfig(tp=8)


def _selector() -> Selector:
  """dp8 fastest, then dp4.tp2, then tp8, everything fits (as a wrong estimate would say)."""
  cells = {}
  for c, tgs in ((DP8, 300.0), (DP4TP2, 200.0), (TP8, 100.0)):
    cells[(Stage.ROLLOUT, 1024, 16, c.name)] = Cell(
      stage=Stage.ROLLOUT,
      config=c.name,
      bucket=1024,
      rows=16,
      peak_bytes=1,
      oom=False,
      throughput=tgs,
    )
  key = {
    'stages': ['rollout'],
    'candidates': {'rollout': [DP8.name, DP4TP2.name, TP8.name]},
    'buckets': [1024],
    'rows': [16],
  }
  table = BucketConfig(lengths=(1024,))
  return Selector(SelectorConfig(), buckets=table, rows=16, profile=Profile(key=key, cells=cells))


def test_a_refused_program_marks_its_layout_and_the_stage_is_decided_again():
  sel, lines, built = _selector(), [], []
  stats = StepStats(episode_lengths=(900,), num_responses=16)

  def build(decision):
    built.append(decision.config)
    if decision.config != TP8:
      raise memory.InfeasibleError(f'{decision.config.name} needs 99 MiB; the budget is 90 MiB')
    return 'program'

  decision, program = decide_compiled(sel, Stage.ROLLOUT, stats, build, log=lines.append)
  assert program == 'program' and decision.config == TP8 and built == [DP8, DP4TP2, TP8]
  # The refused decisions are logged, marked; only the accepted one moved the state on.
  assert ['REFUSED' in d.reason for d in sel.history] == [True, True, False]
  assert sel.state(Stage.ROLLOUT).decisions == 1 and decision.step == 0
  assert 'first decision' in decision.reason and 'infeasible: dp8.tp1, dp4.tp2' in decision.reason
  assert lines == [
    'refused at compile time, deciding again: dp8.tp1 needs 99 MiB; the budget is 90 MiB',
    'refused at compile time, deciding again: dp4.tp2 needs 99 MiB; the budget is 90 MiB',
  ]
  # Another error is not a refusal: it propagates, and nothing is committed.
  with pytest.raises(RuntimeError, match='boom'):
    decide_compiled(sel, Stage.ROLLOUT, stats, _raise, log=lines.append)
  assert sel.state(Stage.ROLLOUT).decisions == 1 and len(sel.history) == 3
  # Every layout refused: the selector says so.
  with pytest.raises(memory.InfeasibleError, match='XLA refused every candidate'):
    decide_compiled(sel, Stage.ROLLOUT, stats, lambda d: build(d) + _refuse(d), log=lines.append)


def _raise(decision):
  raise RuntimeError('boom')


def _refuse(decision):
  raise memory.InfeasibleError(f'{decision.config.name} refused')


@pytest.fixture(scope='module')
def placed():
  config = smoke_experiment()
  model = ModelConfig.preset(config.model)
  spec = StageSpec(optim=config.optim, loss=config.loss)
  with Executables(model, spec=spec) as exe:
    yield StagePlacement.initialize(config, model, exe, DP8), exe


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_parameters_on_each_layout_and_the_reshard_rate(placed):
  placement, exe = placed
  assert placement.train_config == DP8 and placement.has_reference
  # The train layout gets the state's own arrays; another one a copy with its shardings.
  assert placement.params_on(DP8) is placement.state.params
  assert placement.switch_cost_ms(Stage.ROLLOUT, DP4TP2, 64, 8, compile_ms=7.0) == 7.0
  copy = placement.params_on(DP4TP2)
  want = jax.tree.leaves(exe.param_shardings(DP4TP2))
  assert [x.sharding for x in jax.tree.leaves(copy)] == want
  for a, b in zip(_host(copy), _host(placement.state.params)):
    np.testing.assert_array_equal(a, b)
  # The move's rate prices a train switch: the state's bytes at that rate.
  state_bytes = tree_bytes(placement.state)
  assert state_bytes > tree_bytes(placement.state.params) > 0
  train_cost = placement.switch_cost_ms(Stage.TRAIN, DP4TP2, 64, 8, compile_ms=0.0)
  assert train_cost > 0
  assert placement.switch_cost_ms(Stage.TRAIN, DP4TP2, 64, 8, compile_ms=5.0) == pytest.approx(
    train_cost + 5.0
  )
  # The reference policy moves (once) to the experience layout and stays there.
  ref = placement.ref_on(DP4TP2)
  assert [x.sharding for x in jax.tree.leaves(ref)] == want
  assert placement.ref_on(DP4TP2) is ref


def test_a_train_switch_moves_the_whole_state(placed):
  placement, exe = placed
  before = _host(placement.state)
  table = BucketConfig(lengths=(64,))
  config = SelectorConfig(profile=ProfileSettings(stages=()))  # analytic only
  sel = Selector(config, buckets=table, rows=8, model=exe.model, spec=exe.spec)
  decision, _ = sel.propose(Stage.TRAIN, None)
  decision = dataclasses.replace(decision, config=DP4TP2)
  program, record = placement.switch_train(decision, 64, None, step=3, budget=None, margin=0.0)
  assert placement.train_config == DP4TP2 and record.target == 'dp4.tp2' and record.step == 3
  assert program.key.config == DP4TP2
  for a, b in zip(_host(placement.state), before):
    np.testing.assert_array_equal(a, b)
  # Its program is compiled now: a switch back there would cost the state's move only.
  assert exe.requested(exe.key(Stage.TRAIN, DP4TP2, 64, 8))
