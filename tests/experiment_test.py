"""ExperimentConfig: validation before anything is built, JSON form, the --resume fingerprint."""

import dataclasses
import json

import pytest

from earl_jax.config import BucketConfig
from earl_jax.experiment import ExperimentConfig
from earl_jax.testing.configs import smoke_experiment


def test_fingerprint_ignores_the_schedule_but_not_the_run():
  base = smoke_experiment()
  same = dataclasses.replace(base, steps=99, eval_every=7, checkpoint_every=5, name='other')
  assert same.fingerprint() == base.fingerprint()
  assert dataclasses.replace(base, seed=1).fingerprint() != base.fingerprint()
  assert (
    dataclasses.replace(base, buckets=BucketConfig(lengths=(64, 256))).fingerprint()
    != base.fingerprint()
  )
  # The JSON form is plain data (stages and other enums as their names).
  text = json.dumps(base.to_json())
  assert '"stages": []' in text and json.loads(text)['rollout']['num_episodes'] == 8


@pytest.mark.parametrize(
  ('changes', 'match'),
  [
    ({'steps': 0}, 'ExperimentConfig.steps must be a positive int, got 0'),
    ({'seed': -1}, r'ExperimentConfig.seed=-1: expected an int in \[0, 2147483646\]'),
    ({'micro_batches': 3}, 'micro_batches=3 must divide rollout.num_episodes=8'),
    ({'model': 'huge'}, "Unknown model preset 'huge'"),
    ({'buckets': BucketConfig(lengths=(8,))}, 'does not fit the largest context bucket 8'),
  ],
)
def test_bad_values_are_refused_where_they_are_written(changes, match):
  with pytest.raises(ValueError, match=match):
    smoke_experiment(**changes)


def test_the_default_is_a_valid_config():
  assert ExperimentConfig().rollout.num_episodes == 64


@pytest.mark.parametrize(
  ('rollout', 'match'),
  [
    ({'reply_tokens': ('A', 'B')}, r"rollout.reply_tokens=\('A', 'B'\): .*character 'A'"),
    ({'reply_tokens': ('12',)}, "entry '12' encodes to 2 tokens"),
    ({'prompt_buckets': (4,)}, r'the largest, 4, is shorter than the first turn prompt of env'),
  ],
)
def test_what_needs_the_tokenizer_is_checked_before_a_run_starts(rollout, match):
  from earl_jax.models.tokenizer import load_tokenizer

  base = smoke_experiment()
  config = smoke_experiment(rollout=dataclasses.replace(base.rollout, **rollout))
  with pytest.raises(ValueError, match=match):
    config.check_tokenizer(load_tokenizer('game'), 64)
  base.check_tokenizer(load_tokenizer('game'), 64)  # the smoke preset itself passes
