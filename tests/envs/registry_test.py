"""The registry builds the environment a config names."""

import pytest

from earl_jax.envs import base, board_env, connect_four, registry, tic_tac_toe


@pytest.mark.parametrize(
  ('game', 'module', 'num_actions', 'max_turns'),
  [('connect_four', connect_four, 7, 21), ('tic_tac_toe', tic_tac_toe, 9, 5)],
)
def test_make_env_builds_the_configured_game(game, module, num_actions, max_turns):
  env = registry.make_env(base.EnvConfig(game=game, opponent='minimax', minimax_depth=2))
  assert isinstance(env, board_env.BoardGameEnv)
  assert env.game.name == game
  assert env.opponent.depth == 2
  assert env.num_actions == num_actions
  assert env.max_turns == max_turns
  assert env.num_envs == 0
  assert env.action_text(0) == '1'
  assert env.action_text(num_actions - 1) == str(num_actions)
  with pytest.raises(ValueError, match='out of range'):
    env.action_text(num_actions)
  obs = env.reset(3, seed=0)
  assert env.num_envs == 3
  assert len(obs) == 3
  assert env.boards.shape == (3, module.ROWS, module.COLS)
