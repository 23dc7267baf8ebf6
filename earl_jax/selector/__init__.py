"""The Parallelism Selector: per-stage layout by context bucket and load (EARL §2, Fig. 3).

Before each stage of each step, the selector turns last step's statistics into a layout
(`ParallelConfig`) and a context bucket, from the profile of every candidate layout (measured
cells, and the cost model's figures with their uncertainty where a cell is not measured yet) or,
for stages left unprofiled, the analytic memory model, and per-device memory feasibility. It
decides only, and never compiles or measures: the profile (its table, cost model, measurement
and the scheduling of measurements) lives in `earl_jax.profiling`, and the programs, their
executables and the moves between layouts are run by the trainer.

  from earl_jax.programs import Executables, switch
  from earl_jax.profiling import profiler
  from earl_jax.selector import Selector, SelectorConfig, StepStats

  # Start-up, in two explicit calls: measure the profile (or reuse its cache), then decide on it.
  exe = Executables(model_cfg, spec=spec)
  grid = profiler.grid_for(sel_cfg, buckets=table, rows=num_episodes, spec=spec,
                           budget_bytes=budget)
  profile = profiler.run(model_cfg, grid, executables=exe, cache_path=sel_cfg.profile.cache)
  sel = Selector(sel_cfg, model=model_cfg, buckets=table, rows=num_episodes, profile=profile,
                 spec=spec)
  first = sel.initial_decisions()            # {Stage.ROLLOUT: Decision, ...}

  # Every step, before every stage:
  stats = StepStats(episode_lengths=prev_lengths, num_responses=n, free_memory_bytes=free)
  cells = sel.wanted(Stage.ROLLOUT, stats)   # a lazy profile: cells worth measuring (between
  sel.use_profile(measured)                  # steps); until then the decision uses the model
  d, state = sel.propose(Stage.ROLLOUT, stats)       # the rule, pure (None stats at step 0)
  params, program, record = switch(Stage.ROLLOUT, params, exe, d.config, d.run_bucket, d.rows,
                                   source=prev_config, budget=sel.budget_bytes)
  sel.commit(d, state)        # or, when XLA refused the program: sel.mark_infeasible(d, why)
  for key in sel.lookahead(d):          # next bucket's executable + weight move, in background
    exe.precompile(exe.key(*key), tree=params)
  sel.state_dict() / sel.load_state_dict(...)    # hysteresis state for checkpoints
  sel.log()                                      # every decision with its reason

`propose` / `decide` raise `ValueError` for a context longer than the largest bucket or a load
above the profiled ones, and `InfeasibleError` (naming the smallest layout's need) when nothing
fits.
"""

from earl_jax.profiling.table import Cell, MeasureConfig, Profile
from earl_jax.selector import candidates, selector
from earl_jax.selector.candidates import stage_candidates
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
  'candidates',
  'selector',
  'stage_candidates',
]
