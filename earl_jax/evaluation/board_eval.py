"""A board-game policy's greedy games against each built-in opponent.

The policy (a checkpoint of `experiments/train.py`, `code_eval.load_policy`) plays
`episodes` games against each opponent with the RL rollout engine, greedily and from fixed seeds,
on the environment of its run's evaluation (`ExperimentConfig.eval_env`) with only the opponent
changed. Each opponent's record holds the outcome rates, the games lost to an illegal move (a
full column, a taken cell: `illegal_rate`, part of `invalid_rate`), how many distinct moves the
agent played a game (Connect Four: columns; a policy that stacks one column plays 1) and its
moves a game.

  mesh = code_eval.eval_mesh()
  policy = code_eval.load_policy(PolicySource(checkpoint='runs/default'), mesh)
  records = play(config, policy, mesh, opponents=base.OPPONENTS, episodes=512, seed=0)

`full_column_rows` plays scripted games into labelled token rows, for
experiments/board_reading.py (how fast a model learns to read which columns are full).
"""

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jaxtyping import Int32

from earl_jax.envs import base, registry
from earl_jax.errors import UserError
from earl_jax.evaluation.code_eval import Policy
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import tokenizer as tokenizer_lib
from earl_jax.rollout.trajectories import EpisodeStats
from earl_jax.run import metrics


class BoardEvalError(UserError):
  """A board evaluation asked of a run that is not a board game, or with bad settings."""


def check(config: ExperimentConfig, *, opponents: tuple[str, ...], episodes: int, shards: int):
  """Refuses, in one line, what `play` cannot do: a run whose evaluation is not a board game, an
  unknown opponent, or a number of games the `shards` data-parallel ranks do not divide.

  Raises:
    BoardEvalError: as said.
  """
  if not isinstance(config.eval_env, base.EnvConfig):
    raise BoardEvalError(
      f'config={config.name!r} evaluates on {type(config.eval_env).__name__}: expected a board '
      'game (for code tasks: experiments/eval_code.py).'
    )
  unknown = [o for o in opponents if o not in base.OPPONENTS]
  if unknown or not opponents:
    raise BoardEvalError(
      f'opponents={",".join(opponents)!r}: expected some of {",".join(base.OPPONENTS)}.'
    )
  if (
    isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1 or episodes % shards
  ):
    raise BoardEvalError(
      f'episodes={episodes!r}: expected a positive multiple of the {shards} devices.'
    )


def play(
  config: ExperimentConfig,
  policy: Policy,
  mesh: jax.sharding.Mesh,
  *,
  opponents: Sequence[str],
  episodes: int,
  seed: int,
) -> dict[str, dict[str, float]]:
  """`episodes` greedy games of `policy` against each of `opponents` on `config.eval_env`, on
  one set of compiled programs.

  Returns:
    opponent -> the evaluation's record (`metrics.eval_record`: eval/win_rate,
    eval/invalid_rate, eval/distinct_moves_mean, ...) with eval/loss_rate, eval/turns_mean and
    'games'.
  """
  from earl_jax.programs import Executables, StageSpec
  from earl_jax.rollout import engine
  from earl_jax.train.assembly import greedy_rollout

  rollout = greedy_rollout(config, episodes)
  spec = StageSpec.for_rollout(rollout, policy.tokenizer, policy.model.vocab_size)
  records = {}
  with Executables(policy.model, spec=spec, devices=list(mesh.devices.flat)) as programs:
    for opponent in opponents:
      env = dataclasses.replace(config.eval_env, opponent=opponent)
      runner = engine.RolloutEngine(
        policy.model, policy.tokenizer, env, rollout, config.buckets, programs=programs
      )
      records[opponent] = _record(
        EpisodeStats.gather(runner.run(policy.params, mesh, seed=seed, greedy=True))
      )
  return records


def _record(stats: EpisodeStats) -> dict[str, float]:
  record = metrics.eval_record(stats)
  record['eval/loss_rate'] = stats.outcome_rates().get('loss', 0.0)
  record['eval/turns_mean'] = float(np.mean(stats.turns))
  record['games'] = float(len(stats.outcomes))
  return record


def table(records: dict[str, dict[str, float]]) -> str:
  """A Markdown table of `play`'s records, one row per opponent."""
  lines = [
    '| opponent | games | win | draw | loss | invalid | of which illegal | distinct moves | turns |',
    '|---|---:|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for opponent, r in records.items():
    lines.append(
      f'| {opponent} | {r["games"]:.0f} | {r["eval/win_rate"]:.3f} | {r["eval/draw_rate"]:.3f} | '
      f'{r["eval/loss_rate"]:.3f} | {r["eval/invalid_rate"]:.3f} | '
      f'{r.get("eval/illegal_rate", 0.0):.3f} | {r.get("eval/distinct_moves_mean", 0.0):.2f} | '
      f'{r["eval/turns_mean"]:.1f} |'
    )
  return '\n'.join(lines)


def full_column_rows(
  n: int, seed: int, bucket: int, stack: float
) -> tuple[Int32[np.ndarray, 'B T'], Int32[np.ndarray, 'B T']]:
  """Labelled Connect Four rows (experiments/board_reading.py): n games against the random
  opponent, with the default's board observation and the game tokenizer, in which the agent
  plays a column of its own while it is legal with chance `stack`, else a random legal one, and
  meets a full column; each as the rollout's token row, cut at `bucket` tokens (T = bucket).

  Returns:
    (tokens, full): `full` holds, at each agent reply, the bitmask of the columns that are full
    there (bit c: column c + 1), 0 elsewhere.
  """
  tokenizer = tokenizer_lib.load_tokenizer('game')
  env = registry.make_env(base.EnvConfig(game='connect_four', opponent='random'))
  rng = np.random.default_rng(seed)
  tokens = np.zeros((n, bucket), np.int32)
  full = np.zeros((n, bucket), np.int32)
  kept = 0
  while kept < n:
    observations = env.reset(1, int(rng.integers(1 << 30)))
    replies, masks = [], []
    own = int(rng.integers(env.num_actions))
    while True:
      legal = env.legal_mask()[0]
      move = own if legal[own] and rng.random() < stack else int(rng.choice(np.flatnonzero(legal)))
      masks.append(legal)
      replies.append(tokenizer.encode(env.action_text(move)))
      result = env.step([env.action_text(move)])
      if result.dones[0]:
        break
      observations = observations + result.observations[:1]
    if all(m.all() for m in masks):
      continue
    ids, generated = tokenizer_lib.conversation_ids(tokenizer, observations, replies)
    ids, generated = np.asarray(ids[:bucket]), np.asarray(generated[:bucket], bool)
    # One generated digit a reply (its end-of-turn token is template, not generated).
    reply_at = np.flatnonzero(generated)
    tokens[kept, : len(ids)] = ids
    for at, legal in zip(reply_at, masks):
      full[kept, at] = int(np.sum((~legal) << np.arange(legal.size)))
    kept += 1
  return tokens, full
