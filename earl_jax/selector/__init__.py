"""The Parallelism Selector: per-stage layout by context bucket and load (EARL §2, Fig. 3).

Before each stage of each step, the selector turns last step's statistics into a layout
(`ParallelConfig`) and a context bucket, from a start-up profile of every candidate layout (or,
for stages left unprofiled, the analytic memory model) and per-device memory feasibility; the
trainer then switches to it with a cached, ahead-of-time compiled executable and a
device-to-device reshard of the weights (and of the optimizer state for train).

Public API, and how the trainer uses it:

  from earl_jax.selector import (Executables, Selector, SelectorConfig, StageSpec, StepStats,
                                 reshard, switch)

  # Start-up. The selector profiles `profile_stages` (default: rollout decode, as the paper) on
  # every candidate layout, bucket and load, or reuses `profile_cache` when it matches this
  # hardware / model / candidate set; the other stages are ranked by the analytic model.
  exe = Executables(model_cfg, spec=StageSpec(decode_tokens=8))
  sel = Selector(SelectorConfig(statistic='mean', budget_mib=None, profile_cache='runs/p.json'),
                 model=model_cfg, buckets=table, rows=num_episodes, executables=exe)
  first = sel.initial_decisions()            # {'rollout': Decision, 'experience': ..., 'train': ...}

  # Every step, before every stage ('rollout', 'experience', 'train'):
  d = sel.decide('rollout', StepStats(episode_lengths=prev_lengths, turn_lengths=prev_turns,
                                      num_responses=n, free_memory_bytes=free))  # None at step 0
  d.config, d.bucket, d.run_bucket, d.reason
  # Either move the weights yourself (device to device, source donated) ...
  params = reshard.reshard_tree(params, reshard.param_shardings(model_cfg, d.config))
  # ... or take the cached executable and the move in one call, timed (reshard/compile/stall ms):
  params, program, record = switch('rollout', params, exe, d.config, d.run_bucket, d.rows,
                                   source=prev_config, budget=sel.budget_bytes)
  for key in sel.lookahead(d):          # next bucket's executable + weight move, in background
    exe.precompile(*key, tree=params)
  # train: switch('train', train_state, exe, ...) moves parameters and AdamW moments together.
  sel.state_dict() / sel.load_state_dict(...)    # hysteresis state for checkpoints
  sel.log()                                      # every decision with its reason

`decide` raises `ValueError` for a context longer than the largest bucket or a load above the
profiled ones, and `InfeasibleError` (naming the smallest layout's need) when nothing fits.
`memory.estimate(...)` is the analytic model for shapes too large to compile here.
"""

from earl_jax.selector import (
  candidates,
  executables,
  memory,
  profiler,
  reshard,
  selector,
  stages,
)
from earl_jax.selector.candidates import STAGES, stage_candidates
from earl_jax.selector.executables import Executable, Executables, SwitchRecord, switch
from earl_jax.selector.memory import InfeasibleError, MemoryUse
from earl_jax.selector.profiler import Cell, Profile, ProfileConfig
from earl_jax.selector.reshard import reshard_tree
from earl_jax.selector.selector import Decision, Selector, SelectorConfig, StepStats
from earl_jax.selector.stages import Program, ProgramKey, StageSpec

__all__ = [
  'STAGES',
  'Cell',
  'Decision',
  'Executable',
  'Executables',
  'InfeasibleError',
  'MemoryUse',
  'Profile',
  'ProfileConfig',
  'Program',
  'ProgramKey',
  'Selector',
  'SelectorConfig',
  'StageSpec',
  'StepStats',
  'SwitchRecord',
  'candidates',
  'executables',
  'memory',
  'profiler',
  'reshard',
  'reshard_tree',
  'selector',
  'stage_candidates',
  'stages',
  'switch',
]
