"""Orbax checkpoints: a train state saved on one layout restores onto another, with its meta;
checksums catch corrupted data, and an unreadable latest checkpoint falls back to the previous."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.programs import builders
from earl_jax.rl import train_step as train_lib
from earl_jax.run import checkpointing
from earl_jax.sharding import mesh as mesh_lib

CFG = ModelConfig.preset('tiny')
OPTIM = train_lib.OptimConfig()


def _state(parallel, seed):
  _, params = qwen2.init_model(CFG, mesh_lib.make_mesh(parallel), seed=seed)
  state = train_lib.init_train_state(params, train_lib.make_optimizer(OPTIM))
  # Non-zero moments and counters, so that a lost or mixed-up leaf would show.
  return state.replace(
    opt_state=jax.tree.map(
      lambda x: x + 0.25 if jnp.issubdtype(x.dtype, jnp.floating) else x + 2, state.opt_state
    ),
    step=jnp.int32(7),
  )


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_save_on_one_layout_restore_on_another(tmp_path):
  saved_on, restore_on = ParallelConfig(dp=2, tp=4), ParallelConfig(dp=4, tp=2)
  state = _state(saved_on, seed=1)
  ckpt = checkpointing.Checkpointer(str(tmp_path / 'ckpt'), max_to_keep=2)
  meta = {'step': 3, 'history': [{'step': 1, 'win_rate': 0.5}], 'note': 'x'}
  ckpt.save(3, state, meta)
  ckpt.wait()
  assert ckpt.latest_step() == 3 and ckpt.read_meta() == meta
  target = builders.abstract_train_state(CFG, restore_on, OPTIM)
  restored, got_meta = ckpt.restore(target)
  assert got_meta == meta
  for a, b in zip(_host(restored), _host(state)):
    np.testing.assert_array_equal(a, b)
  q = restored.params['layers'][0]['self_attn']['q_proj'][...]
  assert q.addressable_data(0).shape == (CFG.hidden_size, CFG.num_heads // 2, CFG.head_dim)
  mu = restored.opt_state[1][0].mu['layers'][0]['self_attn']['q_proj'][...]
  assert mu.sharding.is_equivalent_to(q.sharding, 3)
  ckpt.close()


def test_keeps_the_newest_and_names_missing_steps(tmp_path):
  state = _state(ParallelConfig(dp=8), seed=2)
  ckpt = checkpointing.Checkpointer(str(tmp_path / 'ckpt'), max_to_keep=2)
  for step in (1, 2, 3):
    ckpt.save(step, state, {'step': step})
  ckpt.wait()
  assert ckpt.all_steps() == [2, 3]
  assert ckpt.read_meta(2) == {'step': 2}
  with pytest.raises(checkpointing.CheckpointError, match=r'No checkpoint for step 1 .* \[2, 3\]'):
    ckpt.read_meta(1)
  ckpt.close()
  empty = checkpointing.Checkpointer(str(tmp_path / 'empty'))
  assert empty.latest_step() is None
  with pytest.raises(checkpointing.CheckpointError, match='No checkpoint in'):
    empty.read_meta()
  empty.close()


def _files(folder):
  return [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]


def test_checksums_do_not_depend_on_the_layout_and_see_one_bit():
  a = _state(ParallelConfig(dp=2, tp=4), seed=3)
  target = builders.abstract_train_state(CFG, ParallelConfig(dp=8), OPTIM)
  on_other = jax.device_put(a, jax.tree.map(lambda t: t.sharding, target))
  sums = checkpointing.checksums(a)
  assert sums == checkpointing.checksums(on_other)
  leaf = np.asarray(a.params['layers'][0]['mlp']['up_proj'][...])
  flipped = leaf.copy().view(np.uint32)
  flipped[1, 2] ^= 1  # one bit of one float
  assert checkpointing.checksums([jnp.asarray(flipped.view(np.float32))]) != (
    checkpointing.checksums([jnp.asarray(leaf)])
  )
  swapped = leaf.copy()
  swapped[[0, 1]] = swapped[[1, 0]]  # the same values, moved
  assert checkpointing.checksums([jnp.asarray(swapped)]) != checkpointing.checksums([leaf])


def test_a_checksum_mismatch_is_an_error(tmp_path):
  state = _state(ParallelConfig(dp=8), seed=4)
  ckpt = checkpointing.Checkpointer(str(tmp_path / 'ckpt'))
  ckpt.save(1, state, {'step': 1})
  ckpt.wait()
  (meta_file,) = [f for f in _files(tmp_path / 'ckpt' / '1' / 'meta') if 'metadata' in f]
  with open(meta_file) as f:
    meta = json.load(f)
  meta[checkpointing.CHECKSUMS][3] ^= 1
  with open(meta_file, 'w') as f:
    json.dump(meta, f)
  target = builders.abstract_train_state(CFG, ParallelConfig(dp=8), OPTIM)
  with pytest.raises(checkpointing.CheckpointError, match=r'1 of \d+ arrays do not match'):
    ckpt.restore(target, 1)
  ckpt.close()


@pytest.mark.parametrize('damage', ['random_bytes', 'missing_state', 'garbage_meta'])
def test_an_unreadable_latest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
  states = {step: _state(ParallelConfig(dp=8), seed=step) for step in (1, 2)}
  ckpt = checkpointing.Checkpointer(str(tmp_path / 'ckpt'))
  for step, state in states.items():
    ckpt.save(step, state, {'step': step})
  ckpt.wait()
  latest = tmp_path / 'ckpt' / '2'
  if damage == 'random_bytes':  # 64 random bytes into the middle of every data file
    rng = np.random.default_rng(0)
    for path in _files(latest / 'state'):
      size = os.path.getsize(path)
      if size > 256:
        with open(path, 'r+b') as f:
          f.seek(size // 2)
          f.write(rng.integers(0, 256, 64, dtype=np.uint8).tobytes())
  elif damage == 'missing_state':
    shutil.rmtree(latest / 'state')
  else:
    for path in _files(latest / 'meta'):
      with open(path, 'wb') as f:
        f.write(b'\xff\xfe not json')
  skipped = []
  target = builders.abstract_train_state(CFG, ParallelConfig(dp=8), OPTIM)
  step, restored, meta = ckpt.restore_newest_readable(
    lambda meta: target, on_skip=lambda s, why: skipped.append((s, why))
  )
  assert step == 1 and meta == {'step': 1}
  assert [s for s, _ in skipped] == [2] and skipped[0][1]
  for a, b in zip(_host(restored), _host(states[1])):
    np.testing.assert_array_equal(a, b)
  ckpt.set_aside([2], suffix='unreadable')
  assert ckpt.all_steps() == [1]
  assert any(p.startswith('2.unreadable-') for p in os.listdir(tmp_path / 'ckpt'))
  ckpt.close()
