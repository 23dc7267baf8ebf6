"""The executable cache: one compile per key, a bucket never retraces, background precompile, switch."""

import os
import threading

import jax
import numpy as np
import pytest

from earl_jax import buckets
from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.programs import builders, memory
from earl_jax.programs import executables as executables_lib
from earl_jax.programs.executables import Executables, switch
from earl_jax.rollout.sampler import SamplingConfig
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage

CFG = ModelConfig.preset('tiny')  # K = 4: tp <= 4
SPEC = builders.StageSpec(sampling=SamplingConfig(max_new_tokens=4))
DP8, DP2TP4 = ParallelConfig(dp=8), ParallelConfig(dp=2, tp=4)


def test_each_bucket_compiles_once_and_is_reused(monkeypatch):
  traces = []
  original = qwen2.token_logprobs

  def counting(model, tokens, *args, **kwargs):
    traces.append(tokens.shape)  # runs only while tracing
    return original(model, tokens, *args, **kwargs)

  monkeypatch.setattr(qwen2, 'token_logprobs', counting)
  table = BucketConfig(lengths=(32, 64))
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(DP2TP4), seed=0)
  rng = np.random.RandomState(0)
  with Executables(CFG, spec=SPEC) as exe:
    seen = {}
    for n in (5, 17, 32, 33, 60, 64, 20, 48):
      tokens = rng.randint(1, CFG.vocab_size, (8, n)).astype(np.int32)
      padded, bucket = buckets.pad_to_bucket(tokens, table, axis=1)
      entry = exe.get(exe.key(Stage.EXPERIENCE, DP2TP4, bucket, 8))
      lp = entry(params, jax.device_put(padded, entry.program.in_shardings[1]))
      assert lp.shape == (8, bucket)
      seen.setdefault(bucket, entry)
      assert entry is seen[bucket]
    assert sorted(traces) == [(8, 32), (8, 64)]  # one trace per bucket, ever
    assert exe.compiles == 2 and exe.hits == 6
    assert [r['key'] for r in exe.log] == ['experience/dp2.tp4/S32/R8', 'experience/dp2.tp4/S64/R8']
    assert all(r['compile_ms'] > 0 and r['lower_ms'] > 0 for r in exe.log)
  # Padding never changes the log-probs of real tokens: the 32 and 64 buckets agree.
  short = rng.randint(1, CFG.vocab_size, (8, 20)).astype(np.int32)
  lps = []
  for bucket in (32, 64):
    padded, _ = buckets.pad_to_bucket(short, BucketConfig(lengths=(bucket,)), axis=1)
    entry = seen[bucket]
    lps.append(np.asarray(entry(params, jax.device_put(padded, entry.program.in_shardings[1]))))
  np.testing.assert_allclose(lps[0][:, :20], lps[1][:, :20], atol=1e-5)


def test_background_precompile_switch_and_refusal():
  mesh_a = mesh_lib.make_mesh(DP8)
  _, params = qwen2.init_model(CFG, mesh_a, seed=1)
  before = [np.asarray(x) for x in jax.tree.leaves(params)]
  with Executables(CFG, spec=SPEC) as exe:
    exe.get(exe.key(Stage.ROLLOUT, DP8, 32, 8))
    with jax.set_mesh(mesh_a):
      future = exe.precompile(exe.key(Stage.ROLLOUT, DP2TP4, 64, 8))
      assert exe.precompile(exe.key(Stage.ROLLOUT, DP2TP4, 64, 8)) is future  # in flight: not twice
      # With the current weights: the move onto the new layout is compiled as well.
      move = exe.precompile(exe.key(Stage.ROLLOUT, DP2TP4, 64, 8), tree=params)
      entry = future.result()
      assert move.result() is entry
      # Lowering in the background thread never touched this thread's mesh.
      assert dict(jax.sharding.get_abstract_mesh().shape) == {
        'data': 8,
        'fsdp': 1,
        'context': 1,
        'tensor': 1,
      }
    assert entry.background and exe.log[-1]['thread'].startswith('earl-precompile')
    assert exe.resharder.is_prepared(params, entry.program.tree_shardings)
    params, got, record = switch(Stage.ROLLOUT, params, exe, DP2TP4, 64, 8, source=DP8, step=3)
    assert got is entry and exe.compiles == 2
    assert record.precompiled and record.source == 'dp8.tp1' and record.target == 'dp2.tp4'
    assert record.stall_ms == pytest.approx(record.wait_ms + record.reshard_ms)
    assert record.compile_ms == pytest.approx(entry.lower_ms + entry.compile_ms)
    assert record.reshard_ms > 0
    q = params['layers'][0]['self_attn']['q_proj'][...]
    assert q.addressable_data(0).shape == (CFG.hidden_size, CFG.num_heads // 4, CFG.head_dim)
    for got_leaf, want in zip(jax.tree.leaves(params), before):
      np.testing.assert_array_equal(np.asarray(got_leaf), want)
    # The switched-to executable runs: N = 4 tokens for every row, written into the cache.
    args = builders.make_inputs(got.program, params)
    gen, cache = got(*args)
    assert np.all(np.asarray(gen.num_tokens) == 4)
    assert np.all(np.asarray(cache.lengths) == 64)
    # Over budget: refused before running, and the weights stay where they were.
    with pytest.raises(memory.InfeasibleError, match=r'rollout/dp8\.tp1/S64/R8/P16 needs'):
      switch(Stage.ROLLOUT, params, exe, DP8, 64, 8, budget=1024)
    assert not q.is_deleted()


def test_train_switch_moves_params_and_moments_and_steps():
  with Executables(CFG, spec=SPEC) as exe:
    # A train state on another layout, with every moment non-zero.
    _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(DP8), seed=2)
    key = builders.ProgramKey(stage=Stage.TRAIN, config=DP8, bucket=32, rows=8)
    program = builders.build(key, CFG, SPEC)
    state = builders.make_inputs(program, params, seed=0)[0]
    state = state.replace(opt_state=jax.tree.map(lambda x: x + 1, state.opt_state))
    state, got, record = switch(Stage.TRAIN, state, exe, DP2TP4, 32, 8, source=DP8)
    # Not precompiled: the step waited for the whole compile.
    assert not record.precompiled and record.wait_ms >= got.compile_ms
    assert exe.get(exe.key(Stage.TRAIN, DP2TP4, 32, 8)) is got
    entry = got
    mu = state.opt_state[1][0].mu['layers'][0]['mlp']['up_proj'][...]
    p = state.params['layers'][0]['mlp']['up_proj'][...]
    assert mu.sharding.is_equivalent_to(p.sharding, 2)
    assert mu.addressable_data(0).shape == (CFG.hidden_size, CFG.intermediate_size // 4)
    batch = builders.make_inputs(entry.program, state.params, seed=1)[1]
    state, metrics = got(state, batch)
    assert np.isfinite(float(metrics['loss'])) and int(state.step) == 1
    want = jax.tree.map(lambda a: a.sharding, exe.abstract_train_state(DP2TP4))
    assert not jax.tree.leaves(
      jax.tree.map(lambda x, s: None if x.sharding.is_equivalent_to(s, x.ndim) else x, state, want)
    )


def test_background_compiles_run_below_the_step_priority():
  """Compiles nothing waits on yet run niced (per thread on Linux), so on a machine with few
  cores the step keeps its CPU; the calling thread keeps its own priority."""
  own = os.getpriority(os.PRIO_PROCESS, 0)
  pool = executables_lib.background_pool(1, 'earl-test')
  try:
    niced = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert niced.result() == min(19, own + executables_lib.BACKGROUND_NICE)
  finally:
    pool.shutdown()
  assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


def test_held_precompiles_wait_until_released_or_needed():
  """`hold`: queued precompiles do not start (the host is quiet: not `busy`) until released, or
  until the step needs one of them (`get`), which lets them go on."""
  with Executables(CFG, spec=SPEC) as exe:
    exe.hold(True)
    first = exe.key(Stage.EXPERIENCE, DP8, 32, 8)
    second = exe.key(Stage.EXPERIENCE, DP2TP4, 32, 8)
    futures_ = [exe.precompile(first), exe.precompile(second)]
    assert not exe.busy()  # queued, held: nothing compiles
    assert not any(f.done() for f in futures_) and exe.compiles == 0
    exe.hold(False)
    assert exe.busy()
    futures_[1].result()
    assert exe.compiles == 2 and not exe.busy()
    # Held again, a program the step needs is built: the queue goes on, nothing deadlocks.
    exe.hold(True)
    third = exe.key(Stage.EXPERIENCE, DP8, 64, 8)
    exe.precompile(third)
    assert not exe.busy()
    entry = exe.get(third)
    assert entry.background and exe.compiles == 3  # built by the queue, which `get` let go
    # `wait` lets a held queue go on too.
    exe.hold(True)
    exe.precompile(exe.key(Stage.EXPERIENCE, DP2TP4, 64, 8))
    exe.wait()
    assert exe.compiles == 4 and not exe.busy()
