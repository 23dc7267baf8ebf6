"""HF checkpoint import: config parsing, sharded loading, bf16, round trip, and clear errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from earl_jax.config import ModelConfig
from earl_jax.models import hf_import
from earl_jax.testing import fixture_path, small_mesh

TINY = fixture_path('qwen2_tiny')


def _copy(tmp_path, src=TINY):
  dst = tmp_path / 'ckpt'
  shutil.copytree(src, dst)
  return str(dst)


def test_config_matches_tiny_preset_shapes():
  cfg = hf_import.load_config(TINY)
  preset = ModelConfig.preset('tiny')
  for field in ('vocab_size', 'hidden_size', 'intermediate_size', 'num_layers', 'num_heads'):
    assert getattr(cfg, field) == getattr(preset, field), field
  assert cfg.num_kv_heads == 4 and cfg.head_dim == 8
  assert cfg.rope_theta == 10_000.0  # read from transformers 5's rope_parameters
  assert not cfg.tie_word_embeddings
  assert hf_import.load_config(fixture_path('qwen2_tiny_tied')).tie_word_embeddings


def test_old_style_config_keys(tmp_path):
  """transformers 4 wrote rope_theta at the top level and torch_dtype; both layouts load."""
  d = _copy(tmp_path)
  with open(os.path.join(d, 'config.json')) as f:
    hf = json.load(f)
  hf.pop('rope_parameters')
  hf['rope_theta'] = 1234.0
  hf['torch_dtype'] = hf.pop('dtype')
  with open(os.path.join(d, 'config.json'), 'w') as f:
    json.dump(hf, f)
  assert hf_import.load_config(d).rope_theta == 1234.0


def test_bf16_load_is_the_rounded_f32_load():
  mesh = small_mesh(dp=2, tp=2)
  _, _, f32 = hf_import.load(TINY, mesh, param_dtype='float32')
  cfg, _, bf16 = hf_import.load(TINY, mesh, param_dtype='bfloat16')
  assert cfg.param_dtype == 'bfloat16' and cfg.dtype == 'bfloat16'
  for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16)):
    assert b.dtype == jnp.bfloat16
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_bf16_checkpoint_file_loads(tmp_path):
  """A checkpoint stored in bf16 (as real Qwen2.5 releases are) is read without numpy bf16 support."""
  import ml_dtypes

  d = _copy(tmp_path)
  path = os.path.join(d, 'model.safetensors')
  tensors = load_file(path)
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, path)
  mesh = small_mesh(dp=1, tp=4)
  _, _, state = hf_import.load(d, mesh, param_dtype='float32')
  embed = np.asarray(state['embed_tokens'][...])
  expected = tensors['model.embed_tokens.weight'].astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(embed, expected)


def test_export_round_trip(tmp_path):
  mesh = small_mesh(dp=4, tp=2)
  cfg, _, state = hf_import.load(TINY, mesh)
  out = str(tmp_path / 'export')
  hf_import.export_safetensors(cfg, state, out)
  original = load_file(os.path.join(TINY, 'model.safetensors'))
  exported = load_file(os.path.join(out, 'model.safetensors'))
  assert set(exported) == set(original)
  for name, value in original.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_missing_directory_or_files(tmp_path):
  mesh = small_mesh()
  with pytest.raises(hf_import.CheckpointError, match='does not exist'):
    hf_import.load(str(tmp_path / 'nope'), mesh)
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(hf_import.CheckpointError, match=r'No config\.json'):
    hf_import.load(str(empty), mesh)
  d = _copy(tmp_path)
  os.remove(os.path.join(d, 'model.safetensors'))
  with pytest.raises(
    hf_import.CheckpointError, match=r'No model\.safetensors or model\.safetensors\.index\.json'
  ):
    hf_import.load(d, mesh)


def test_missing_shard_file(tmp_path):
  d = _copy(tmp_path, fixture_path('qwen2_tiny_tied'))
  os.remove(os.path.join(d, 'model-00002-of-00003.safetensors'))
  with pytest.raises(
    hf_import.CheckpointError, match=r'model-00002-of-00003\.safetensors.*does not exist'
  ):
    hf_import.load(d, small_mesh())


def test_missing_tensor_is_named(tmp_path):
  d = _copy(tmp_path)
  path = os.path.join(d, 'model.safetensors')
  tensors = load_file(path)
  del tensors['model.layers.1.self_attn.k_proj.bias']
  save_file(tensors, path)
  with pytest.raises(
    hf_import.CheckpointError, match=r'missing 1 tensors.*layers\.1\.self_attn\.k_proj\.bias'
  ):
    hf_import.load(d, small_mesh())


def test_shape_that_does_not_match_config(tmp_path):
  d = _copy(tmp_path)
  with open(os.path.join(d, 'config.json')) as f:
    hf = json.load(f)
  hf['intermediate_size'] = 256
  with open(os.path.join(d, 'config.json'), 'w') as f:
    json.dump(hf, f)
  with pytest.raises(
    hf_import.CheckpointError,
    match=r'gate_proj.weight: checkpoint \(192, 64\), config expects \(256, 64\)',
  ):
    hf_import.load(d, small_mesh())


def test_unsupported_architecture(tmp_path):
  d = _copy(tmp_path)
  with open(os.path.join(d, 'config.json')) as f:
    hf = json.load(f)
  hf['model_type'] = 'llama'
  with open(os.path.join(d, 'config.json'), 'w') as f:
    json.dump(hf, f)
  with pytest.raises(hf_import.CheckpointError, match=r"model_type='llama'"):
    hf_import.load(d, small_mesh())


def test_not_a_safetensors_file(tmp_path):
  d = _copy(tmp_path)
  with open(os.path.join(d, 'model.safetensors'), 'wb') as f:
    f.write(b'garbage!' * 4)
  with pytest.raises(hf_import.CheckpointError, match='not a safetensors file'):
    hf_import.load(d, small_mesh())


@pytest.mark.multiprocess
def test_two_process_load_matches_reference():
  """Each of 2 processes reads only its shards of a (dp=2, tp=2) mesh that spans both."""
  from earl_jax.testing import multiprocess

  results = multiprocess.run(
    'earl_jax.testing.mp_bodies:load_tiny_checkpoint_and_score',
    num_processes=2,
    devices_per_process=2,
    kwargs={'model_dir': TINY, 'reference': fixture_path('qwen2_tiny_reference.npz')},
  )
  for r in results:
    assert r['max_abs_diff'] < 1e-4
    assert r['addressable_devices'] == 2
    assert r['global_devices'] == 4
