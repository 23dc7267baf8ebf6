"""--config presets and --config.a.b=value overrides on frozen config dataclasses."""

import dataclasses
from typing import Literal

import pytest

from earl_jax import config_cli
from earl_jax.config import BucketConfig
from experiments.configs import train as train_presets


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
  lr: float = 1e-3
  mode: Literal['a', 'b'] = 'a'
  note: str | None = None

  def __post_init__(self):
    if self.lr <= 0:
      raise ValueError(f'Inner.lr must be > 0, got {self.lr}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
  inner: Inner = dataclasses.field(default_factory=Inner)
  steps: int = 3
  flag: bool = False
  buckets: BucketConfig = dataclasses.field(default_factory=BucketConfig)


def test_overrides_apply_with_types_and_validation():
  c = Outer()
  c = config_cli.apply_override(c, 'inner.lr', '0.5')
  c = config_cli.apply_override(c, 'steps', '7')
  c = config_cli.apply_override(c, 'flag', 'true')
  c = config_cli.apply_override(c, 'inner.mode', 'b')
  c = config_cli.apply_override(c, 'inner.note', 'none')
  c = config_cli.apply_override(c, 'buckets.lengths', '64,128')
  assert c == Outer(
    inner=Inner(lr=0.5, mode='b'), steps=7, flag=True, buckets=BucketConfig(lengths=(64, 128))
  )
  assert config_cli.apply_override(c, 'buckets.lengths', '(32, 64)').buckets.lengths == (32, 64)


def test_bad_overrides_name_the_field():
  with pytest.raises(
    config_cli.ConfigOverrideError,
    match=r"Outer has no field 'stepz'; fields: \['buckets', 'flag', 'inner', 'steps'\]",
  ):
    config_cli.apply_override(Outer(), 'stepz', '1')
  with pytest.raises(config_cli.ConfigOverrideError, match=r"Outer.steps: 'x' is not an int"):
    config_cli.apply_override(Outer(), 'steps', 'x')
  with pytest.raises(
    config_cli.ConfigOverrideError, match=r"Inner.mode: 'c' is not one of \['a', 'b'\]"
  ):
    config_cli.apply_override(Outer(), 'inner.mode', 'c')
  with pytest.raises(ValueError, match=r'Inner\.lr must be > 0, got -1\.0'):
    config_cli.apply_override(Outer(), 'inner.lr', '-1')  # __post_init__ still validates
  with pytest.raises(ValueError, match='strictly increasing'):
    config_cli.apply_override(Outer(), 'buckets.lengths', '128,64')


def test_split_overrides_from_argv():
  config_cli.DEFINE_config('cfgtest', presets={'p': Outer}, default='p')
  rest, found = config_cli.split_overrides(
    ['prog', '--cfgtest.steps=4', '--other=1', '--cfgtest.inner.lr=2'], ['cfgtest']
  )
  assert rest == ['prog', '--other=1']
  assert found['cfgtest'] == [('steps', '4'), ('inner.lr', '2')]
  with pytest.raises(config_cli.ConfigOverrideError, match='overrides need a value'):
    config_cli.split_overrides(['prog', '--cfgtest.steps'], ['cfgtest'])
  # An override the config refuses (or that does not parse) names its flag first.
  bad = [('steps', '4'), ('buckets.lengths', '(64,128')]
  with pytest.raises(config_cli.ConfigOverrideError) as e:
    config_cli.apply_overrides(Outer(), bad, flag='cfgtest')
  assert str(e.value).startswith("--cfgtest.buckets.lengths=(64,128: BucketConfig.lengths: '(64,")
  with pytest.raises(ValueError, match=r'^--cfgtest.buckets.lengths=128,64: .*strictly increasing'):
    config_cli.apply_overrides(Outer(), [('buckets.lengths', '128,64')], flag='cfgtest')


def test_overrides_apply_in_any_order_and_the_last_of_a_path_wins():
  """A combination the config refuses half-way (rloo needs groups of two or more) is tried again
  once the other overrides are applied; a path given twice takes its last value."""
  base = train_presets.PRESETS['smoke']()
  assert base.rollout.group_size == 1
  for order in (
    [('advantages.estimator', 'rloo'), ('rollout.group_size', '2')],
    [('rollout.group_size', '2'), ('advantages.estimator', 'rloo')],
  ):
    config = config_cli.apply_overrides(base, order, flag='config')
    assert config.advantages.estimator == 'rloo' and config.rollout.group_size == 2
  twice = [('steps', '5'), ('advantages.estimator', 'rloo'), ('steps', '7')]
  with pytest.raises(ValueError, match=r'^--config.advantages.estimator=rloo: .*group_size=1'):
    config_cli.apply_overrides(base, twice, flag='config')  # refused whatever the order
  twice[1] = ('rollout.group_size', '2')
  assert config_cli.apply_overrides(base, twice, flag='config').steps == 7


def _leaves(config, prefix=''):
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if dataclasses.is_dataclass(value):
      yield from _leaves(value, f'{prefix}{f.name}.')
    else:
      yield f'{prefix}{f.name}', value


def _as_text(value) -> str:
  if value is None:
    return 'none'
  if isinstance(value, tuple) and any(isinstance(v, tuple) for v in value):
    return repr(value)  # pairs, as a user writes them: ((0, 1), (3, 3))
  if isinstance(value, tuple):
    return ','.join(_as_text(v) for v in value)
  return str(value.value if hasattr(value, 'value') else value)


@pytest.mark.parametrize('preset', sorted(train_presets.PRESETS))
def test_every_leaf_field_of_every_preset_can_be_set_from_the_command_line(preset):
  """Each leaf field, tuples and sequences of strings included, set to its own value from text,
  gives the same config back: nothing is out of reach of --config.a.b=value."""
  config = train_presets.PRESETS[preset]()
  leaves = list(_leaves(config))
  assert len(leaves) > 90
  for path, value in leaves:
    assert config_cli.apply_override(config, path, _as_text(value)) == config, path


def test_sequences_of_strings_and_layouts_are_overridden():
  config = train_presets.PRESETS['default']()
  got = config_cli.apply_override(config, 'selector.candidates', 'dp8,dp2.tp4')
  assert got.selector.candidates == ('dp8', 'dp2.tp4')
  got = config_cli.apply_override(config, 'selector.profile.stages', 'rollout,train')
  assert [str(s) for s in got.selector.profile.stages] == ['rollout', 'train']
  got = config_cli.apply_override(config, 'rollout.reply_tokens', '(1, 2, 3)')
  assert got.rollout.reply_tokens == ('1', '2', '3')


def test_a_kl_adaptive_rate_needs_a_second_update_a_batch():
  """`optim.kl_target` reads an update's move in the next update on the same batch: with one
  update a batch it is refused, naming both values, and accepted once a second is asked for."""
  base = train_presets.PRESETS['smoke']()
  assert base.update_epochs == 1
  one = [('optim.kl_target', '0.01'), ('optim.kl_rate_range', '0.1,2')]
  with pytest.raises(ValueError, match=r'^--config.optim.kl_target=0.01: .*update_epochs=1'):
    config_cli.apply_overrides(base, one, flag='config')
  config = config_cli.apply_overrides(base, [*one, ('update_epochs', '2')], flag='config')
  assert config.optim.kl_target == 0.01 and config.optim.kl_rate_range == (0.1, 2.0)
