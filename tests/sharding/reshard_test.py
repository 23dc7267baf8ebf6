"""Weights and optimizer state move between every pair of layouts, on device, unchanged; the
resharder owns its compiled moves and keeps a bounded number of them."""

import itertools
import os

import jax
import numpy as np
import pytest
from jax._src import array as array_impl

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.programs import builders
from earl_jax.rl import train_step as train_lib
from earl_jax.selector.candidates import stage_candidates
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding import reshard
from earl_jax.stage import Stage

# One layer and K = H = 8 so that tp = 8 is valid too: every factorisation of 8 devices.
CFG = ModelConfig.preset('small-kv').replace(name='small-kv-1l', num_layers=1, vocab_size=64)


class HostBounces:
  """Counts device-to-host reads (`np.asarray(jax.Array)` and friends go through `_value`).

  The CPU transfer guard does not flag device-to-host reads (host and device share memory), so
  the tests watch the one place JAX turns a device array into host numpy.
  """

  def __init__(self, monkeypatch):
    self.count = 0
    original = array_impl.ArrayImpl._value

    def counted(arr):
      self.count += 1
      return original.fget(arr)

    monkeypatch.setattr(array_impl.ArrayImpl, '_value', property(counted))


def _abstract_on(tree, shardings):
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _euler_circuit(nodes):
  """A walk that takes every ordered pair (a, b), a != b, exactly once as a step (Hierholzer)."""
  out_edges = {a: [b for b in nodes if b != a] for a in nodes}
  stack, walk = [nodes[0]], []
  while stack:
    v = stack[-1]
    if out_edges[v]:
      stack.append(out_edges[v].pop())
    else:
      walk.append(stack.pop())
  return walk[::-1]


def test_params_between_every_pair_of_candidates(monkeypatch):
  cands = stage_candidates(Stage.ROLLOUT, CFG, num_devices=8)
  assert len(cands) == 10  # every ordered (dp, fsdp, tp) with product 8
  shardings = {c: builders.param_shardings(CFG, c) for c in cands}
  resharder = reshard.Resharder()
  walk = _euler_circuit(cands)
  steps = list(itertools.pairwise(walk))
  assert sorted(steps, key=str) == sorted(itertools.permutations(cands, 2), key=str)
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(walk[0]), seed=3)
  expected = _host(params)
  bounces = HostBounces(monkeypatch)
  for a, b in steps:
    src = params
    assert not reshard.needs_reshard(src, shardings[a])
    with jax.transfer_guard('disallow'):
      params = resharder(src, shardings[b])
    leaf = params['layers'][0]['self_attn']['q_proj'][...]
    assert leaf.addressable_data(0).shape == (
      CFG.hidden_size // b.fsdp,
      CFG.num_heads // b.tp,
      CFG.head_dim,
    ), (a, b)
    assert not reshard.needs_reshard(params, shardings[b])
    assert src['embed_tokens'][...].is_deleted()  # donated: the old layout is freed
  assert bounces.count == 0
  for got, want in zip(_host(params), expected):
    np.testing.assert_array_equal(got, want)


def test_the_host_bounce_detector_catches_device_put(monkeypatch):
  # device_put between two shardings over the same devices reads through the host here: the
  # detector must see it, or the test above would prove nothing.
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(ParallelConfig(dp=8)))
  bounces = HostBounces(monkeypatch)
  target = builders.param_shardings(CFG, ParallelConfig(tp=8))
  jax.block_until_ready(jax.device_put(params, target))
  assert bounces.count > 0


@pytest.mark.parametrize(
  'src,dst',
  [
    (ParallelConfig(dp=8), ParallelConfig(dp=2, fsdp=2, tp=2)),
    (ParallelConfig(tp=8), ParallelConfig(fsdp=8)),
  ],
)
def test_train_state_moves_with_its_optimizer_moments(monkeypatch, src, dst):
  optim = train_lib.OptimConfig()
  optimizer = train_lib.make_optimizer(optim)
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(src), seed=1)
  state = train_lib.init_train_state(params, optimizer)
  # Non-zero moments, so that a lost or mixed-up leaf would show.
  state = state.replace(opt_state=jax.tree.map(lambda x: x + 0.5, state.opt_state))
  expected = _host(state)
  bounces = HostBounces(monkeypatch)
  target = jax.tree.map(lambda a: a.sharding, builders.abstract_train_state(CFG, dst, optim))
  with jax.transfer_guard('disallow'):
    moved = reshard.Resharder()(state, target)
  assert bounces.count == 0
  mu = moved.opt_state[1][0].mu['layers'][0]['mlp']['up_proj'][...]
  p = moved.params['layers'][0]['mlp']['up_proj'][...]
  assert mu.sharding.is_equivalent_to(p.sharding, 2)
  assert p.addressable_data(0).shape == (
    CFG.hidden_size // dst.fsdp,
    CFG.intermediate_size // dst.tp,
  )
  for got, want in zip(_host(moved), expected):
    np.testing.assert_array_equal(got, want)


def test_a_move_to_replicated_tp_params_does_not_rebuild_every_leaf():
  """fsdp8 -> dp2.tp4: XLA's direct reshard rebuilds every leaf whole on every device (temporary
  memory of the whole model's size); the resharder's staged move stays far below it, and moves
  the same values."""
  src, dst = ParallelConfig(fsdp=8), ParallelConfig(dp=2, tp=4)
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(src), seed=2)
  expected = _host(params)
  target = builders.param_shardings(CFG, dst)
  whole = sum(x.nbytes for x in jax.tree.leaves(params))
  direct = jax.jit(lambda t: t, out_shardings=target).lower(params).compile()
  assert direct.memory_analysis().temp_size_in_bytes >= whole / 2
  resharder = reshard.Resharder()
  moved = resharder(params, target)
  (key, _) = resharder._key(params, target, True)
  staged = resharder._compiled.get(key).memory_analysis().temp_size_in_bytes
  assert staged <= whole / 4, (staged, whole)
  assert not reshard.needs_reshard(moved, target)
  for got, want in zip(_host(moved), expected):
    np.testing.assert_array_equal(got, want)


def test_xla_rematerialization_warnings_are_held_back_and_other_lines_passed_on(capfd):
  """XLA's C++ logging writes to file descriptor 2 directly; while the resharder measures a
  direct move, its rematerialization lines are dropped and every other line still appears."""
  with reshard._without_rematerialization_warnings():
    os.write(2, b'W1203 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. x\n')
    os.write(2, b'another warning\n')
  err = capfd.readouterr().err
  assert err == 'another warning\n', err
  src, dst = ParallelConfig(fsdp=8), ParallelConfig(dp=4, tp=2)
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(src), seed=3)
  reshard.Resharder()(params, builders.param_shardings(CFG, dst))
  assert 'rematerialization' not in capfd.readouterr().err


def test_no_move_is_a_no_op():
  pc = ParallelConfig(dp=2, tp=4)
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(pc))
  assert not reshard.needs_reshard(params, builders.param_shardings(CFG, pc))
  resharder = reshard.Resharder()
  assert resharder(params, builders.param_shardings(CFG, pc)) is params
  assert len(resharder) == 0  # nothing to move: nothing compiled


def test_the_resharder_keeps_a_bounded_number_of_moves():
  layouts = [ParallelConfig(dp=8), ParallelConfig(tp=8), ParallelConfig(dp=2, tp=4)]
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(layouts[0]), seed=2)
  expected = _host(params)
  resharder = reshard.Resharder(max_entries=2)
  for dst in [*layouts[1:], layouts[0], layouts[1]]:  # 4 distinct (source, target) moves
    params = resharder(params, builders.param_shardings(CFG, dst))
  assert resharder.compiles == 4 and len(resharder) == 2
  # The two most recent moves are kept (dp2.tp4 -> dp8, dp8 -> tp8); the older ones are gone.
  on = {c: _abstract_on(params, builders.param_shardings(CFG, c)) for c in layouts}
  sh = {c: builders.param_shardings(CFG, c) for c in layouts}
  assert resharder.is_prepared(on[layouts[2]], sh[layouts[0]])
  assert resharder.is_prepared(on[layouts[0]], sh[layouts[1]])
  assert not resharder.is_prepared(on[layouts[1]], sh[layouts[2]])
  for got, want in zip(_host(params), expected):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match='max_entries must be >= 1'):
    reshard.Resharder(max_entries=0)
