"""Orbax checkpoints: a train state saved on one layout restores onto another, with its meta."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from earl_jax import checkpointing
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.programs import builders
from earl_jax.rl import train_step as train_lib
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
