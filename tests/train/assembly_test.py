"""The composition root's checks and engines (`earl_jax.train.assembly`)."""

import dataclasses

import pytest

from earl_jax.config import ModelConfig
from earl_jax.errors import ConfigError
from earl_jax.programs import Executables
from earl_jax.train import assembly
from experiments.configs import train as presets


@pytest.mark.parametrize(
  ('fields', 'match'),
  [
    ({'eval_episodes': 12}, r'eval_episodes=12: .* split rows over up to 8 batch shards'),
    (
      {'eval_samples': 3, 'eval_sample_tasks': 5},
      r'eval_samples=3 x eval_sample_tasks=5 = 15 sampled episodes: .* expected a multiple of 8',
    ),
  ],
)
def test_evaluation_sizes_that_a_rollout_layout_cannot_split_are_refused(fields, match):
  config = dataclasses.replace(presets.code(), **fields)
  model = ModelConfig.preset(config.model)
  with pytest.raises(ConfigError, match=match):
    assembly.check_eval_episodes(config, model, num_devices=8)
  assembly.check_eval_episodes(presets.code(), model, num_devices=8)  # 256, and 16 x 128


def test_the_sampled_evaluation_draws_groups_of_one_task_as_the_rollout_draws():
  """The code preset's sampled evaluation: 16 samples of each of 128 tasks, in groups of 16, at
  the rollout's temperature (not greedy), on the evaluation's tasks; off where eval_samples=0."""
  config = presets.code()
  model, tok = assembly.load_model(config)
  executables = Executables(model, spec=assembly.stage_spec(config, tok, model))
  engines = assembly.make_engines(config, model, tok, executables)
  sampled = engines.sampled.config
  assert (sampled.num_episodes, sampled.group_size) == (2048, 16)
  assert sampled.sampling == config.rollout.sampling and not sampled.sampling.greedy
  assert engines.sampled.env_config == config.eval_env
  assert engines.evaluation.config.sampling.greedy
  off = dataclasses.replace(config, eval_samples=0)
  assert assembly.make_engines(off, model, tok, executables).sampled is None
