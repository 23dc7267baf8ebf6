"""The Parallelism Selector: per-stage layout by context bucket and load (EARL §2, Fig. 3).

Before each stage of each step, the selector turns last step's statistics into a layout
(`ParallelConfig`) and a context bucket, from a start-up profile of every candidate layout (or,
for stages left unprofiled, the analytic memory model) and per-device memory feasibility. It
decides only: the programs it ranks, their executables and the moves between layouts are
`earl_jax.programs` (below it), which the trainer runs.

  from earl_jax.programs import Executables, StageSpec, switch
  from earl_jax.selector import Selector, SelectorConfig, StepStats, profile_config, profiler

  # Start-up, in two explicit calls: measure the profile (or reuse its cache), then decide on it.
  exe = Executables(model_cfg, spec=spec)
  pconfig = profile_config(sel_cfg, buckets=table, rows=num_episodes, spec=spec,
                           budget_bytes=budget)
  profile = profiler.run(model_cfg, pconfig, executables=exe, cache_path=sel_cfg.profile.cache)
  sel = Selector(sel_cfg, model=model_cfg, buckets=table, rows=num_episodes, profile=profile,
                 spec=spec)
  first = sel.initial_decisions()            # {Stage.ROLLOUT: Decision, ...}

  # Every step, before every stage:
  d = sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=prev_lengths, num_responses=n,
                                          free_memory_bytes=free))     # None at step 0
  d.config, d.bucket, d.run_bucket, d.reason
  params, program, record = switch(Stage.ROLLOUT, params, exe, d.config, d.run_bucket, d.rows,
                                   source=prev_config, budget=sel.budget_bytes)
  for key in sel.lookahead(d):          # next bucket's executable + weight move, in background
    exe.precompile(*key, tree=params)
  sel.state_dict() / sel.load_state_dict(...)    # hysteresis state for checkpoints
  sel.log()                                      # every decision with its reason

`decide` raises `ValueError` for a context longer than the largest bucket or a load above the
profiled ones, and `InfeasibleError` (naming the smallest layout's need) when nothing fits.
`analytic.estimate(...)` is the memory model for shapes too large to compile here.
"""

from earl_jax.selector import analytic, candidates, profiler, selector
from earl_jax.selector.candidates import stage_candidates
from earl_jax.selector.profiler import Cell, MeasureConfig, Profile, ProfileConfig
from earl_jax.selector.selector import (
  Decision,
  ProfileSettings,
  Selector,
  SelectorConfig,
  StepStats,
  profile_config,
)

__all__ = [
  'Cell',
  'Decision',
  'MeasureConfig',
  'Profile',
  'ProfileConfig',
  'ProfileSettings',
  'Selector',
  'SelectorConfig',
  'StepStats',
  'analytic',
  'candidates',
  'profile_config',
  'profiler',
  'selector',
  'stage_candidates',
]
