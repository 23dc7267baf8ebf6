"""Batched multi-turn text environments: Connect Four and Tic-Tac-Toe against built-in opponents.

Usage::

  from earl_jax import envs

  env = envs.make_env(envs.EnvConfig(game='connect_four', opponent='random'))
  observations = env.reset(n=8, seed=0)
  result = env.step(['4'] * 8)
"""

from earl_jax.envs import base, board_env, connect_four, opponents, registry, tic_tac_toe
from earl_jax.envs.base import (
  AGENT,
  ALPHABET,
  EMPTY,
  OPPONENT,
  BoardGame,
  EnvConfig,
  StepInfo,
  StepResult,
  TextEnv,
  grid_from_text,
  parse_action,
)
from earl_jax.envs.board_env import BoardGameEnv
from earl_jax.envs.registry import make_env

__all__ = [
  'AGENT',
  'ALPHABET',
  'EMPTY',
  'OPPONENT',
  'BoardGame',
  'BoardGameEnv',
  'EnvConfig',
  'StepInfo',
  'StepResult',
  'TextEnv',
  'base',
  'board_env',
  'connect_four',
  'grid_from_text',
  'make_env',
  'opponents',
  'parse_action',
  'registry',
  'tic_tac_toe',
]
