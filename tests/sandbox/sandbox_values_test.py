"""The value channel: what a program can encode, and what the parent agrees to decode."""

import json

import pytest

from earl_jax.sandbox import _wire, values

PLAIN = [
  None,
  True,
  0,
  -(2**100),
  1.5,
  float('inf'),
  -0.0,
  3 - 4j,
  '',
  'héllo\n\ud800',
  b'\x00\xff',
  [1, [2, [3]]],
  (1, 'a', None),
  {1, 2.5, 'x'},
  frozenset({(1, 2)}),
  {'k': [1, {2: (3,)}], 5: None},
]


@pytest.mark.parametrize('value', PLAIN, ids=lambda value: type(value).__name__)
def test_plain_values_round_trip_with_their_type(value):
  back = values.decode_value(json.dumps(_wire.encode_value(value)))
  assert type(back) is type(value)
  assert back == value
  if not isinstance(value, (set, frozenset)):  # a set's order may change on the way
    assert repr(back) == repr(value)


class _Int(int):
  pass


class _AlwaysEqual:
  def __eq__(self, other):
    return True


@pytest.mark.parametrize(
  'value', [_Int(3), _AlwaysEqual(), [_AlwaysEqual()], {'k': _Int(1)}, range(3), object()]
)
def test_the_program_refuses_to_encode_anything_else(value):
  with pytest.raises(_wire.UnsupportedError):
    _wire.encode_value(value)


def test_self_referencing_containers_are_refused():
  loop = []
  loop.append(loop)
  with pytest.raises(_wire.UnsupportedError, match='deeper'):
    _wire.encode_value(loop)


@pytest.mark.parametrize(
  'text',
  [
    'not json',
    '3',
    '["i", "12"]',  # not hex
    '["i", "0x1", "extra"]',
    '["b", 1]',
    '["s", 5]',
    '["q", "x"]',
    '["S", [["l", []]]]',  # an unhashable set element
    '["d", [[["i", "0x1"]]]]',
    '["y", "zz"]',
    '[' * 5000 + ']' * 5000,
    json.dumps(['l', [['l', [['l', []]]]]]).replace(
      '[]', '[' + '["l", ' * 200 + '[]' + ']' * 200 + ']'
    ),
  ],
)
def test_the_parent_decodes_only_well_formed_plain_values(text):
  with pytest.raises(values.MalformedValueError):
    values.decode_value(text)


def test_values_match_uses_equality_or_tolerances():
  assert values.values_match(True, 1)
  assert not values.values_match([1], (1,))
  assert not values.values_match(0.1 + 0.2, 0.3)
  assert values.values_match(0.1 + 0.2, 0.3, abs_tol=1e-9)
  assert values.values_match({'a': [1.0000001]}, {'a': [1.0]}, rel_tol=1e-6)
  assert not values.values_match({'a': [1.1]}, {'a': [1.0]}, rel_tol=1e-6)
  assert not values.values_match(True, 1.4, abs_tol=0.5)  # a bool is compared by ==, not closeness
