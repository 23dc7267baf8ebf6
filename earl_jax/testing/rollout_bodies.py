"""Rollout bodies that tests run in one process or in several (see testing.multiprocess)."""

import jax
import jax.numpy as jnp


def refill_rollout(episodes: int, slots: int, layout: str, seed: int) -> dict:
  """`episodes` tic-tac-toe episodes on `slots` refilled slots over every device of the run.

  The policy is the tiny game model from a fixed init, its LM head pointed at the digits (so
  games last several turns and end at different times). Returns this process's episodes (by
  row of the whole batch) and the schedule's statistics.
  """
  from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
  from earl_jax.envs import base as envs
  from earl_jax.models import qwen2, tokenizer
  from earl_jax.programs import Executables, StageSpec
  from earl_jax.rollout import engine, sampler

  cfg = ModelConfig.preset('tiny-game').replace(tie_word_embeddings=False)
  tok = tokenizer.GameTokenizer()
  rollout = engine.RolloutConfig(
    num_episodes=episodes,
    num_slots=slots,
    sampling=sampler.SamplingConfig(temperature=1.3, max_new_tokens=1),
  )
  with Executables(cfg, spec=StageSpec.for_rollout(rollout, tok, cfg.vocab_size)) as exe:
    mesh = exe.mesh(ParallelConfig.parse(layout))
    _, params = qwen2.init_model(cfg, mesh, seed=0)
    digits = jnp.asarray([tok.encode(str(d))[0] for d in range(1, 10)])
    embed, head = params['embed_tokens'][...], params['lm_head'][...]
    embed, head = jax.jit(
      lambda e, h: (e.at[:, 0].add(4.0), h.at[0, digits].add(8.0)),
      out_shardings=(embed.sharding, head.sharding),
    )(embed, head)
    params['embed_tokens'][...] = embed
    params['lm_head'][...] = head
    eng = engine.RolloutEngine(
      cfg,
      tok,
      envs.EnvConfig(game='tic_tac_toe'),
      rollout,
      BucketConfig(lengths=(128, 256)),
      programs=exe,
    )
    traj = eng.run(params, mesh, seed=seed)
  return {
    'process': jax.process_index(),
    'row_ids': traj.row_ids.tolist(),
    'lengths': traj.lengths.tolist(),
    'tokens': [row[:n].tolist() for row, n in zip(traj.tokens, traj.lengths)],
    'logprobs': [row[:n].tolist() for row, n in zip(traj.logprobs, traj.lengths)],
    'outcomes': traj.outcomes,
    'stats': traj.rollout_stats,
  }
