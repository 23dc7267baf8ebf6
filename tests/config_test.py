"""Configs: presets, validation errors that name the bad value, parallel-config parsing."""

import pytest

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig


def test_presets_have_the_real_qwen25_shapes():
  m = ModelConfig.preset('qwen2.5-72b')
  assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (
    8192,
    80,
    64,
    8,
    128,
  )
  assert 72e9 < m.num_params < 73e9
  assert 0.49e9 < ModelConfig.preset('qwen2.5-0.5b').num_params < 0.5e9
  assert 1.5e9 < ModelConfig.preset('qwen2.5-1.5b').num_params < 1.6e9
  assert 7.6e9 < ModelConfig.preset('qwen2.5-7b').num_params < 7.7e9


def test_unknown_preset_lists_the_known_ones():
  with pytest.raises(ValueError, match=r"Unknown model preset 'qwen3'.*'qwen2\.5-7b'"):
    ModelConfig.preset('qwen3')


@pytest.mark.parametrize(
  'changes,match',
  [
    ({'num_kv_heads': 3}, 'num_heads=8 must be a multiple of num_kv_heads=3'),
    ({'hidden_size': 0}, 'hidden_size must be a positive int, got 0'),
    ({'dtype': 'float16'}, "dtype must be one of .*got 'float16'"),
    ({'head_dim': 7}, 'head_dim=7 must be even'),
  ],
)
def test_model_config_validation(changes, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.preset('tiny').replace(**changes)


def test_parallel_config():
  p = ParallelConfig(dp=2, fsdp=2, tp=2)
  assert p.shape == (2, 2, 2) and p.num_devices == 8 and p.batch_shards == 4
  assert p.name == 'dp2.fsdp2.tp2'
  assert ParallelConfig(dp=4, tp=2).name == 'dp4.tp2'
  assert ParallelConfig.parse('dp4.tp2') == ParallelConfig(dp=4, tp=2)
  assert ParallelConfig.parse('2x4') == ParallelConfig(dp=2, tp=4)
  assert ParallelConfig.parse('1x2x4') == ParallelConfig(dp=1, fsdp=2, tp=4)
  assert ParallelConfig.parse(p.name) == p
  with pytest.raises(ValueError, match="Cannot parse parallel config 'tp'"):
    ParallelConfig.parse('tp')
  with pytest.raises(ValueError, match='tp must be a positive int, got 0'):
    ParallelConfig(tp=0)


def test_bucket_table():
  b = BucketConfig(lengths=(64, 128, 512))
  assert [b.bucket_for(n) for n in (1, 64, 65, 512)] == [64, 64, 128, 512]
  with pytest.raises(ValueError, match=r'Length 513 is longer than the largest bucket 512'):
    b.bucket_for(513)
  with pytest.raises(ValueError, match='empty'):
    BucketConfig(lengths=())
  with pytest.raises(ValueError, match=r'strictly increasing, got \(128, 64\)'):
    BucketConfig(lengths=(128, 64))
  with pytest.raises(ValueError, match='strictly increasing'):
    BucketConfig(lengths=(64, 64))
  assert BucketConfig.powers_of_two(100, 1000).lengths == (128, 256, 512, 1000)
