"""The environment registry: every environment name to its class, and `make_env` that builds one.

Kept apart from `base` (the API every environment implements), so that the environments import
the API and this module imports the environments: no module imports one that imports it back.

Names: the board games (`EnvConfig.game`) and the code tasks (`CodeEnvConfig.task`) share one
table, `ENV_CLASSES`. A new environment family adds its config (or a task name of an existing
config) and a line here.

  env = registry.make_env(EnvConfig(game='connect_four', opponent='random'))
  env = registry.make_env(CodeEnvConfig(task='functions', max_turns=3))
"""

from earl_jax.envs import (
  base,
  board_env,
  code_env,
  connect_four,
  opponents,
  repo_repair,
  swe_env,
  tic_tac_toe,
)
from earl_jax.errors import ConfigError

GAME_CLASSES: dict[str, type[base.BoardGame]] = {
  'connect_four': connect_four.ConnectFour,
  'tic_tac_toe': tic_tac_toe.TicTacToe,
}

ENV_CLASSES: dict[str, type[base.TextEnv]] = {
  'connect_four': board_env.BoardGameEnv,
  'tic_tac_toe': board_env.BoardGameEnv,
  'functions': code_env.CodeEnv,
  'humaneval': code_env.CodeEnv,
  'repo_repair': repo_repair.RepoRepairEnv,
  'swe': swe_env.SWEEnv,
}


def env_name(config: base.AnyEnvConfig) -> str:
  """The registry name `config` selects: its game or its code task.

  Raises:
    ConfigError: `config` is neither an `EnvConfig` nor a `CodeEnvConfig`.
  """
  if isinstance(config, base.EnvConfig):
    return config.game
  if isinstance(config, base.CodeEnvConfig):
    return config.task
  raise ConfigError(
    f'An environment config must be an EnvConfig or a CodeEnvConfig, got {type(config).__name__}.'
  )


def env_class(name: str) -> type[base.TextEnv]:
  """The class of environment `name`.

  Raises:
    ConfigError: an unknown name, with the known ones.
  """
  if name not in ENV_CLASSES:
    raise ConfigError(f'Unknown environment {name!r}; known environments: {sorted(ENV_CLASSES)}.')
  return ENV_CLASSES[name]


def make_env(config: base.AnyEnvConfig) -> base.TextEnv:
  """Builds the environment `config` describes (a `BoardGameEnv` for the board games)."""
  cls = env_class(env_name(config))
  if cls is board_env.BoardGameEnv:
    game = GAME_CLASSES[config.game]()
    opponent = opponents.make_opponent(config.opponent, game, depth=config.minimax_depth)
    return board_env.BoardGameEnv(config, game, opponent)
  return cls(config)
