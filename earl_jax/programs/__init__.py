"""The stage programs, their ahead-of-time executables, and XLA's memory analysis of them.

Below the Parallelism Selector: the selector decides which layout each stage runs on; this
package is what runs there. The rollout engine, the trainer and the profiler all take their
compiled programs from one `Executables`, so each stage has a single compile path.

  from earl_jax.programs import Executables, StageSpec, switch
  exe = Executables(model_cfg, spec=StageSpec(sampling=rollout_config.sampling))
  key = exe.key(Stage.EXPERIENCE, ParallelConfig(dp=2, tp=4), bucket=1024, rows=64)
  entry = exe.get(key, budget=budget_bytes)            # refused (InfeasibleError) over budget
  entry.memory.peak                                    # XLA's per-device bytes
  exe.precompile(exe.key(Stage.TRAIN, ParallelConfig(dp=4, tp=2), 2048, 64), tree=train_state)
  state, entry, record = switch(Stage.TRAIN, state, exe, ParallelConfig(dp=4, tp=2), 2048, 64)

Modules: builders (StageSpec, ProgramKey, Program, one builder per stage, make_inputs),
executables (the cache, background precompile, switch), memory (XLA memory analysis, measured
run peaks, the per-device budget). The profile that times these programs per layout is
`earl_jax.profiling`.
"""

from earl_jax.programs import builders, executables, memory
from earl_jax.programs.builders import Program, ProgramKey, StageSpec
from earl_jax.programs.executables import Executable, Executables, SwitchRecord, switch
from earl_jax.programs.memory import InfeasibleError, MemoryUse

__all__ = [
  'Executable',
  'Executables',
  'InfeasibleError',
  'MemoryUse',
  'Program',
  'ProgramKey',
  'StageSpec',
  'SwitchRecord',
  'builders',
  'executables',
  'memory',
  'switch',
]
