"""One registry and one config slot for both families: names, errors, the experiment config."""

import dataclasses
import json
import re

import pytest

from earl_jax import config_cli
from earl_jax.envs import base, board_env, code_env, registry, repo_repair
from earl_jax.errors import ConfigError
from earl_jax.experiment import ExperimentConfig
from earl_jax.sandbox import SandboxConfig
from earl_jax.testing.typecheck import unchecked


@pytest.mark.parametrize(
  ('config', 'cls'),
  [
    (base.EnvConfig(game='tic_tac_toe'), board_env.BoardGameEnv),
    (base.CodeEnvConfig(task='functions'), code_env.CodeEnv),
    (base.CodeEnvConfig(task='humaneval'), code_env.CodeEnv),
    (base.CodeEnvConfig(task='repo_repair'), repo_repair.RepoRepairEnv),
  ],
)
def test_make_env_builds_the_class_of_each_name(config, cls):
  assert registry.env_class(registry.env_name(config)) is cls
  assert type(registry.make_env(config)) is cls


def test_every_known_name_is_in_the_registry():
  assert set(registry.ENV_CLASSES) == set(base.GAMES) | set(base.CODE_TASKS)


def test_unknown_names_give_one_line_listing_the_known_ones():
  with pytest.raises(ConfigError, match=re.escape("Unknown environment 'chess'; known")) as e:
    registry.env_class('chess')
  assert '\n' not in str(e.value) and "'repo_repair'" in str(e.value)
  assert "'connect_four'" in str(e.value)
  with unchecked(), pytest.raises(ConfigError, match='an EnvConfig or a CodeEnvConfig, got dict'):
    registry.make_env({'game': 'connect_four'})


@pytest.mark.parametrize(
  ('changes', 'message'),
  [
    ({'task': 'mbpp'}, "CodeEnvConfig.task='mbpp' is unknown; known values: ['functions'"),
    ({'split': 'test'}, "CodeEnvConfig.split='test' is unknown"),
    ({'reward': 'half'}, "CodeEnvConfig.reward='half' is unknown"),
    ({'max_turns': 0}, 'CodeEnvConfig.max_turns must be None or an int >= 1'),
    ({'heldout_fraction': 1.0}, 'CodeEnvConfig.heldout_fraction must be in (0, 1), got 1.0'),
    ({'invalid_reward': float('nan')}, 'CodeEnvConfig.invalid_reward must be a finite number'),
    ({'max_reply_chars': 0}, 'CodeEnvConfig.max_reply_chars must be an int >= 1, got 0'),
    ({'sandbox': None}, 'CodeEnvConfig.sandbox must be a SandboxConfig, got None'),
  ],
)
def test_bad_code_configs_are_refused_in_one_line(changes, message):
  with unchecked(), pytest.raises(ConfigError, match=re.escape(message)) as e:
    base.CodeEnvConfig(**changes)
  assert '\n' not in str(e.value)


def test_turns_default_per_task():
  assert base.CodeEnvConfig().turns == 1
  assert base.CodeEnvConfig(task='humaneval').turns == 1
  assert base.CodeEnvConfig(task='repo_repair').turns == 8
  assert base.CodeEnvConfig(max_turns=3).turns == 3


def test_the_experiment_config_takes_either_family():
  code = base.CodeEnvConfig(task='functions', max_turns=3, sandbox=SandboxConfig(workers=2))
  config = ExperimentConfig(env=code, eval_env=code.replace(split='heldout'), tokenizer='code')
  text = json.dumps(config.to_json())
  assert json.loads(text)['env']['task'] == 'functions'
  assert json.loads(text)['env']['sandbox']['workers'] == 2
  assert config.fingerprint() != ExperimentConfig(env=code).fingerprint()
  changed = config_cli.apply_override(config, 'env.max_turns', '4')
  assert changed.env.max_turns == 4 and changed.eval_env == config.eval_env
  changed = config_cli.apply_override(config, 'env.sandbox.test_timeout_s', '0.5')
  assert changed.env.sandbox.test_timeout_s == 0.5
  with pytest.raises(config_cli.ConfigOverrideError, match="has no field 'opponent'"):
    config_cli.apply_override(config, 'env.opponent', 'random')
  with unchecked(), pytest.raises(ConfigError, match=r'ExperimentConfig\.env must be an EnvConfig'):
    dataclasses.replace(config, env='functions')


def test_the_board_game_config_json_has_no_code_fields():
  """The board games' JSON (and so the fingerprint of their runs) is what it was."""
  assert set(ExperimentConfig().to_json()['env']) == {
    f.name for f in dataclasses.fields(base.EnvConfig)
  }
  assert 'sandbox' not in json.dumps(ExperimentConfig().to_json())
