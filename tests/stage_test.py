"""The Stage enum: its members are their own names in JSON and logs; bad names are refused."""

import json

import pytest

from earl_jax.stage import STAGES, Stage


def test_members_are_strings_in_step_order():
  assert STAGES == (Stage.ROLLOUT, Stage.EXPERIENCE, Stage.TRAIN)
  assert [str(s) for s in STAGES] == ['rollout', 'experience', 'train']
  assert f'{Stage.TRAIN}/dp8' == 'train/dp8'
  assert json.dumps({Stage.ROLLOUT: [Stage.TRAIN]}) == '{"rollout": ["train"]}'


def test_parse_round_trips_and_names_the_known_stages():
  for s in STAGES:
    assert Stage.parse(str(s)) is s and Stage.parse(s) is s
  with pytest.raises(ValueError, match=r"Unknown stage 'decode'; stages are \('rollout', "):
    Stage.parse('decode')
