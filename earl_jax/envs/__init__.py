"""Batched multi-turn text environments: board games against built-in opponents, and code tasks.

Usage::

  from earl_jax import envs

  env = envs.make_env(envs.EnvConfig(game='connect_four', opponent='random'))
  observations = env.reset(n=8, seed=0)
  result = env.step(['4'] * 8)

  env = envs.make_env(envs.CodeEnvConfig(task='functions', max_turns=3))
  observations = env.reset(n=8, seed=0)
  result = env.step(['    return x*3+1'] * 8)
"""

from earl_jax.envs import (
  base,
  board_env,
  code_env,
  code_tasks,
  connect_four,
  opponents,
  registry,
  repo_repair,
  tic_tac_toe,
)
from earl_jax.envs.base import (
  AGENT,
  ALPHABET,
  EMPTY,
  OPPONENT,
  AnyEnvConfig,
  BoardGame,
  CodeEnvConfig,
  CodeStepInfo,
  EnvConfig,
  StepInfo,
  StepResult,
  TextEnv,
  grid_from_text,
  parse_action,
)
from earl_jax.envs.board_env import BoardGameEnv
from earl_jax.envs.code_env import CodeEnv
from earl_jax.envs.registry import make_env
from earl_jax.envs.repo_repair import RepoRepairEnv

__all__ = [
  'AGENT',
  'ALPHABET',
  'EMPTY',
  'OPPONENT',
  'AnyEnvConfig',
  'BoardGame',
  'BoardGameEnv',
  'CodeEnv',
  'CodeEnvConfig',
  'CodeStepInfo',
  'EnvConfig',
  'RepoRepairEnv',
  'StepInfo',
  'StepResult',
  'TextEnv',
  'base',
  'board_env',
  'code_env',
  'code_tasks',
  'connect_four',
  'grid_from_text',
  'make_env',
  'opponents',
  'parse_action',
  'registry',
  'repo_repair',
  'tic_tac_toe',
]
