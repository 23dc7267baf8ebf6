"""The environment registry: game names to their classes, and `make_env` that builds one.

Kept apart from `base` (the API every environment implements), so that the games import the
API and this module imports the games: no module imports one that imports it back.

  env = registry.make_env(EnvConfig(game='connect_four', opponent='random'))
"""

from earl_jax.envs import base, board_env, connect_four, opponents, tic_tac_toe

GAME_CLASSES: dict[str, type[base.BoardGame]] = {
  'connect_four': connect_four.ConnectFour,
  'tic_tac_toe': tic_tac_toe.TicTacToe,
}


def make_env(config: base.EnvConfig) -> base.TextEnv:
  """Builds the environment `config` describes (a `BoardGameEnv` for the board games)."""
  game = GAME_CLASSES[config.game]()
  opponent = opponents.make_opponent(config.opponent, game, depth=config.minimax_depth)
  return board_env.BoardGameEnv(config, game, opponent)
