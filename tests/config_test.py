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
  assert p.shape == (2, 2, 1, 2) and p.num_devices == 8 and p.batch_shards == 4
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


# Config-level bad inputs, as `--config.<path>=<text>` sets them on the smoke preset: each raises
# a UserError (one line, exit code 2 from an entry point) naming the value.
BAD_FIELDS = [
  (
    'loss.kl_coef',
    'nan',
    'LossConfig.kl_coef must be a finite number (float32 holds up to 3.4e38), got nan',
  ),
  ('loss.entropy_coef', 'inf', 'LossConfig.entropy_coef must be a finite number'),
  ('loss.clip_eps_high', '1e39', 'LossConfig.clip_eps_high must be a finite'),
  ('optim.b1', '1.5', 'OptimConfig.b1 must be in [0, 1), got 1.5'),
  ('optim.b1', '-0.1', 'OptimConfig.b1 must be in [0, 1), got -0.1'),
  ('optim.b2', '1', 'OptimConfig.b2 must be in [0, 1), got 1.0'),
  ('optim.eps', '-1', 'OptimConfig.eps must be > 0, got -1.0'),
  ('optim.eps', '0', 'OptimConfig.eps must be > 0, got 0.0'),
  (
    'env.win_reward',
    '1e39',
    'EnvConfig.win_reward must be a finite number (float32 holds up to 3.4e38), got 1e+39',
  ),
  ('eval_env.loss_reward', '-inf', 'EnvConfig.loss_reward must be a finite number'),
  ('env.legal_move_reward', 'nan', 'EnvConfig.legal_move_reward must be a finite'),
  ('keep_checkpoints', '-1', 'keep_checkpoints must be a positive int, got -1'),
  ('keep_checkpoints', '0', 'keep_checkpoints must be a positive int, got 0'),
  ('seed', '2147483647', 'ExperimentConfig.seed=2147483647: expected an int in [0, 2147483646]'),
  ('seed', '-1', 'ExperimentConfig.seed=-1'),
  ('init_seed', '4294967296', 'ExperimentConfig.init_seed=4294967296'),
  ('eval_seed', '2147483648', 'ExperimentConfig.eval_seed=2147483648'),
  ('name', '', "ExperimentConfig.name='': expected a non-empty name"),
  ('name', '   ', "ExperimentConfig.name='   '"),
  ('name', '..', "ExperimentConfig.name='..': expected one folder name"),
  ('name', 'a/b', "ExperimentConfig.name='a/b'"),
  ('name', 'n' * 256, 'at most 255 bytes'),
  ('selector.with_fsdp', 'train,nope', "Unknown stage 'nope'"),
]


@pytest.mark.parametrize('path, text, fragment', BAD_FIELDS)
def test_bad_fields_raise_a_user_error_naming_the_value(path, text, fragment):
  from earl_jax import config_cli
  from earl_jax.errors import UserError
  from earl_jax.testing import configs

  with pytest.raises(UserError) as info:
    config_cli.apply_override(configs.smoke_experiment(), path, text)
  assert fragment in str(info.value)


@pytest.mark.parametrize(
  'path, text',
  [
    ('optim.b1', '0'),
    ('optim.b2', '0.999'),
    ('optim.eps', '1e-12'),
    ('env.win_reward', '3e38'),
    ('keep_checkpoints', '1'),
    ('seed', '2147483646'),
    ('init_seed', '0'),
    ('name', 'run-1.b'),
    ('loss.kl_coef', '0'),
  ],
)
def test_the_edges_of_the_valid_ranges_are_accepted(path, text):
  from earl_jax import config_cli
  from earl_jax.testing import configs

  value = config_cli.apply_override(configs.smoke_experiment(), path, text)
  for part in path.split('.'):
    value = getattr(value, part)
  assert value == (text if isinstance(value, str) else type(value)(text))


def test_check_float32_and_check_seed():
  import dataclasses

  from earl_jax.config import MAX_SEED, check_float32, check_seed

  @dataclasses.dataclass
  class C:
    x: object = 1.0
    seed: object = 0

  check_float32(C(x=-3.4e38), 'x')
  for bad in (float('nan'), float('inf'), 3.5e38, True, '1', None):
    with pytest.raises(ValueError, match=r'C\.x must be a finite number'):
      check_float32(C(x=bad), 'x')
  check_seed(C(seed=MAX_SEED), 'seed')
  for bad in (MAX_SEED + 1, -1, 1.0, True):
    with pytest.raises(ValueError, match=r'C\.seed='):
      check_seed(C(seed=bad), 'seed')
