"""--config presets and --config.a.b=value overrides on frozen config dataclasses."""

import dataclasses
from typing import Literal

import pytest

from earl_jax import config_cli
from earl_jax.config import BucketConfig


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
