"""The Parallelism Selector: per-stage layout by context bucket and load (EARL §2, Fig. 3).

Before each stage of each step, the selector turns last step's statistics into a layout
(`ParallelConfig`) and a context bucket, from a profile of every candidate layout (or, for
stages left unprofiled, the analytic memory model) and per-device memory feasibility. It
decides only, and never imports `earl_jax.programs`: the profile is measured by
`earl_jax.programs.profiling` (which compiles and times the programs), and the programs, their
executables and the moves between layouts are run by the trainer.

  from earl_jax.programs import Executables, StageSpec, profiling, switch
  from earl_jax.selector import Selector, SelectorConfig, StepStats

  # Start-up, in two explicit calls: measure the profile (or reuse its cache), then decide on it.
  exe = Executables(model_cfg, spec=spec)
  pconfig = profiling.profile_config(sel_cfg, buckets=table, rows=num_episodes, spec=spec,
                                     budget_bytes=budget)
  profile = profiling.run(model_cfg, pconfig, executables=exe, cache_path=sel_cfg.profile.cache)
  sel = Selector(sel_cfg, model=model_cfg, buckets=table, rows=num_episodes, profile=profile,
                 spec=spec)
  first = sel.initial_decisions()            # {Stage.ROLLOUT: Decision, ...}

  # Every step, before every stage:
  stats = StepStats(episode_lengths=prev_lengths, num_responses=n, free_memory_bytes=free)
  cells = sel.wanted(Stage.ROLLOUT, stats)   # a lazy profile: cells worth measuring (between
  sel.use_profile(measured)                  # steps); until then the decision uses the prior
  d, state = sel.propose(Stage.ROLLOUT, stats)       # the rule, pure (None stats at step 0)
  params, program, record = switch(Stage.ROLLOUT, params, exe, d.config, d.run_bucket, d.rows,
                                   source=prev_config, budget=sel.budget_bytes)
  sel.commit(d, state)        # or, when XLA refused the program: sel.mark_infeasible(d, why)
  for key in sel.lookahead(d):          # next bucket's executable + weight move, in background
    exe.precompile(*key, tree=params)
  sel.state_dict() / sel.load_state_dict(...)    # hysteresis state for checkpoints
  sel.log()                                      # every decision with its reason

`propose` / `decide` raise `ValueError` for a context longer than the largest bucket or a load
above the profiled ones, and `InfeasibleError` (naming the smallest layout's need) when nothing
fits. `analytic.estimate(...)` is the memory model for shapes too large to compile here, and
`analytic.call_seconds(...)` the time model; `prior.complete(...)` gives every cell a figure
before it is measured.
"""

from earl_jax.selector import analytic, candidates, prior, profile, selector
from earl_jax.selector.candidates import stage_candidates
from earl_jax.selector.profile import Cell, MeasureConfig, Profile
from earl_jax.selector.selector import (
  Decision,
  ProfileSettings,
  Selector,
  SelectorConfig,
  StageState,
  StepStats,
)

__all__ = [
  'Cell',
  'Decision',
  'MeasureConfig',
  'Profile',
  'ProfileSettings',
  'Selector',
  'SelectorConfig',
  'StageState',
  'StepStats',
  'analytic',
  'candidates',
  'prior',
  'profile',
  'selector',
  'stage_candidates',
]
