"""The run layer every job stands on (the RL `Trainer`, the supervised `SFTRun`).

rundir        the workdir: its lock, checks, resume point, checkpoints, `--move_aside`
workdir_lock  one live run per workdir (a lock file naming its owner, taken over once it is gone)
preemption    SIGTERM / Ctrl-C: stop at the end of a step, every process at the same one
loop          the steps with their cadence (evaluate, log, save), stops and non-finite guard
checkpointing Orbax checkpoints with checksums, storage checks and the unreadable set aside
metrics       the step records, their lines, metrics.jsonl and TensorBoard
plotting      the PNG plots a run ends with
"""
