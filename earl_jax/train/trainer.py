"""The EARL loop: plan, reshard, roll out, prepare experience, dispatch, advantages, train.

One step (`Trainer.step`), every stage on its own mesh over the same devices (colocated):

  1. plan       the Parallelism Selector picks each stage's ParallelConfig and context bucket
                from the previous step's statistics (rollout) or this step's (experience, train);
                a layout whose program XLA refuses is marked and the next one taken; the
                program of each decision (`planning.StagePlanner`);
  2. reshard    parameters move device to device onto the rollout and experience meshes, and the
                train state (parameters + optimizer moments) when the train mesh changes
                (`placement.StagePlacement`);
  3. rollout    multi-turn episodes with a KV cache that persists across turns, each turn a
                compiled rollout program of the shared executable cache; every process steps the
                environments of the rows its devices hold, and the batch is built on the
                rollout layout from every process's own rows (with dynamic sampling, groups
                that all returned the same are replaced from further rounds of the step);
  4. dispatch   rollout layout -> experience layout, through the Data Dispatcher, on devices;
  5. experience old and reference log-probs on the experience layout;
  6. dispatch   experience layout -> train layout (`balance` permutes rows by real tokens
                inside the same move);
  7. advantages group statistics with collectives on the train layout;
  8. train      one PPO-clip update (micro-batched), AOT-compiled per (layout, bucket), state
                donated;
  9. metrics    per-episode statistics merged over processes; process 0 writes one line per
                step, JSONL + TensorBoard (`metrics.step_record`, `metrics.format_line`); Orbax
                checkpoints (every process) every N steps (`rundir.RunDir`).

The same program runs on every process of a multi-controller run (`jax.distributed`): every
decision is taken from statistics that every process holds alike.

Construction is explicit, each part built from what the one before returned: the model and
tokenizer (and the config's checks that need them), the run directory (checked, and the
checkpoint a resume continues from; the workdir is written only once all is built), the stage
programs, the profile (measured by `profiling.profiler` on the schedule of `profiling.schedule`,
unless one is passed in) and the selector on it (`assembly`), the parameters and train state on
the first train layout (`placement`), the engines.

  trainer = Trainer(ExperimentConfig(...), workdir='runs/default')
  summary = trainer.run()
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from earl_jax import dispatch as dispatch_lib
from earl_jax.config import ParallelConfig
from earl_jax.experiment import ExperimentConfig
from earl_jax.profiling.table import Profile
from earl_jax.programs import Executables
from earl_jax.programs import memory as memory_lib
from earl_jax.rl import advantages as advantages_lib
from earl_jax.rl import packing
from earl_jax.rl.batch import Batch
from earl_jax.rollout import dynamic_sampling, trajectories
from earl_jax.rollout.trajectories import EpisodeStats, Trajectories
from earl_jax.run import loop, metrics
from earl_jax.run.loop import NonFiniteError
from earl_jax.run.metrics import StageTimer, format_line, move_summary
from earl_jax.run.rundir import ResumeError, ResumePoint, RunDir, WorkdirError
from earl_jax.selector import selector as selector_lib
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage
from earl_jax.train import assembly
from earl_jax.train import placement as placement_lib
from earl_jax.train.placement import StagePlacement
from earl_jax.train.planning import StagePlanner


@dataclasses.dataclass
class _Rollout:
  """What the rollout stage hands on: this process's episodes and the whole batch's statistics."""

  traj: Trajectories
  episodes: EpisodeStats
  stats: selector_lib.StepStats
  decision: selector_lib.Decision
  sampling: dict[str, float]  # dynamic sampling's `sampling/...` metrics ({}: off)


@dataclasses.dataclass
class _Experience:
  """What the experience stage hands on: the batch on its layout, its bucket and decision."""

  batch: Batch
  layout: dispatch_lib.Layout
  bucket: int
  decision: selector_lib.Decision


class Trainer:
  """Runs `ExperimentConfig` in `workdir` (metrics, checkpoints, plots)."""

  def __init__(
    self,
    config: ExperimentConfig,
    *,
    workdir: str,
    resume: bool = False,
    log_fn: Callable[[str], None] | None = None,
    profile: Profile | None = None,
    move_aside: bool = False,
  ):
    """Args:
    config: the run.
    workdir: where metrics, checkpoints and plots go.
    resume: continue from the latest checkpoint in `workdir`.
    log_fn: receives every log line (default: absl logging).
    move_aside: a workdir that holds a run is renamed to `<workdir>.<time>` (once the model,
      the tokenizer and the config have passed their checks) and the run starts afresh.
    profile: a measured start-up profile to decide on (default: measured by
      `assembly.start_profile`, which reuses `config.selector.profile.cache` when it
      matches).
    """
    self.config = config
    self.workdir = workdir
    self.log = log_fn or (lambda line: logging.info('%s', line))
    # The model, the tokenizer and what needs them, then the workdir and the checkpoint to
    # resume, are checked before anything is written or compiled.
    self.model_cfg, self.tokenizer = assembly.load_model(config)
    config.check_tokenizer(self.tokenizer, self.model_cfg.vocab_size)
    placement_lib.check_warm_start(config.init_from, self.model_cfg)  # metadata only
    assembly.check_eval_episodes(config, self.model_cfg, len(mesh_lib.canonical_devices()))
    self.run_dir, resume_point = RunDir.open(
      workdir, config, resume=resume, log=self.log, set_aside_used=move_aside
    )
    with self.run_dir.released_on_error():  # a run that fails while being built frees it
      self.devices = mesh_lib.canonical_devices()
      self.is_main = jax.process_index() == 0
      self._advantage_fns: dict[ParallelConfig, Any] = {}
      self.profile_s = 0.0  # spent measuring profile cells during the run
      self.num_groups = config.rollout.num_episodes // config.rollout.group_size

      self.spec = assembly.stage_spec(config, self.tokenizer, self.model_cfg)
      # One AOT-compiled program per (stage, layout, bucket, rows), shared by everything below.
      self.executables = Executables(self.model_cfg, spec=self.spec)
      # The measured profile the selector ranks its profiled stages by (and what a lazy profile
      # lacks, measured as decisions need it), preferring the cells of the checkpoint a resume
      # continues from.
      self.scheduler = assembly.start_profile(
        config,
        model=self.model_cfg,
        spec=self.spec,
        executables=self.executables,
        base=None if resume_point is None else _saved_profile(resume_point.meta),
        given=profile,
      )
      self.selector = assembly.make_selector(
        config,
        self.model_cfg,
        self.spec,
        self.scheduler.profile,
        len(self.devices),
        self._switch_cost,
      )
      self.switches: list[dict] = []
      self.placement = StagePlacement.initialize(
        config, self.model_cfg, self.executables, self._initial_decisions()[Stage.TRAIN].config
      )
      self.engines = assembly.make_engines(config, self.model_cfg, self.tokenizer, self.executables)
      self.planner = StagePlanner(
        config, self.selector, self.scheduler, self.executables, self.placement, log=self.log
      )
      self.dispatcher = dispatch_lib.Dispatcher(config.dispatch)
      self.curriculum = assembly.make_curriculum(config)  # None: the seed's shuffle of tasks

      self.global_step = 0
      self.prev_stats: selector_lib.StepStats | None = None
      self.history: list[dict] = []
      resumed_rows = None if resume_point is None else self._resume(resume_point)
      # After a resume, TensorBoard hides what a run that died logged after the checkpoint.
      self.writer = metrics.MetricsWriter(
        workdir, enabled=self.is_main, purge_step=self.global_step + 1 if resume else None
      )
      if resumed_rows is not None:
        self.writer.rewrite(resumed_rows)

  @property
  def state(self):
    """The train state (parameters and optimizer moments), on the train layout."""
    return self.placement.state

  # ----------------------------------------------------------------------------------------------
  # Construction.

  def _initial_decisions(self) -> dict[Stage, selector_lib.Decision]:
    """The first decision of every stage (no statistics yet), recording nothing."""
    for stage in self.selector.stages:
      self.profile_s += self.scheduler.before_decision(self.selector, stage, None)
    return self.selector.initial_decisions()

  def _switch_cost(self, stage: Stage, src: ParallelConfig, dst: ParallelConfig, bucket, rows):
    """What moving `stage` from `src` to `dst` would stall a step, in ms (the profiled compile
    time unless compiled, and for train the state's move): the selector's switch gate."""
    del src
    compile_ms = self.scheduler.compile_ms(stage, bucket, rows, dst.name)
    return self.placement.switch_cost_ms(stage, dst, bucket, rows, compile_ms=compile_ms)

  def _resume(self, point: ResumePoint) -> list[dict]:
    """Restores the checkpoint `point` names (or an older one that reads); returns the metrics
    rows up to it, for the writer to rewrite."""
    self.placement.drop_state()  # the fresh state is replaced, not moved
    restored = self.run_dir.restore(
      point,
      lambda meta: self.executables.abstract_train_state(
        ParallelConfig.parse(meta['train_config'])
      ),
    )
    meta = restored.meta
    self.placement.restore(restored.state, ParallelConfig.parse(meta['train_config']))
    self.global_step = restored.step
    self.selector.load_state_dict(meta['selector'])
    if self.curriculum is not None and meta.get('curriculum') is not None:
      self.curriculum.load_state_dict(meta['curriculum'])
    prev_stats = meta['prev_stats']
    self.prev_stats = None if prev_stats is None else selector_lib.StepStats(**prev_stats)
    self.history = [metrics.summary_fields(r) for r in restored.rows]
    return restored.rows

  def _advantages(self, parallel: ParallelConfig):
    """`advantages.with_advantages` jitted for the train mesh of `parallel` (one per layout)."""
    if parallel not in self._advantage_fns:
      self._advantage_fns[parallel] = advantages_lib.advantage_fn(
        self.placement.mesh(parallel), self.num_groups, self.config.advantages
      )
    return self._advantage_fns[parallel]

  # ----------------------------------------------------------------------------------------------
  # One step, stage by stage.

  def _roll_out(self, timer: StageTimer) -> _Rollout:
    """1-3. Rollout plan from the previous step's statistics; the episodes on its layout (the
    cache starts at the planned bucket and grows if an episode outgrows it); the statistics of
    the whole batch, merged over the processes."""
    cfg = self.config
    plan = self.planner.rollout(self.prev_stats)
    timer.profile_s += plan.profile_s
    decision = plan.decision
    params = timer('reshard', self.placement.params_on, decision.config)
    mesh = self.placement.mesh(decision.config)
    step_seed = _step_seed(cfg.seed, self.global_step)
    weights = None if self.curriculum is None else self.curriculum.weights()

    def play(k: int) -> Trajectories:  # the step's episodes, round k (dynamic sampling)
      seed = dynamic_sampling.round_seed(step_seed, k)
      return self.engines.train.run(
        params,
        mesh,
        seed=seed,
        capacity=decision.run_bucket,
        task_weights=weights,
        games=cfg.games_at(self.global_step),
      )

    t0 = time.perf_counter()
    sampling = {}
    if cfg.dynamic_sampling_rounds:
      filled = dynamic_sampling.fill(
        play,
        rounds=cfg.dynamic_sampling_rounds,
        group_size=cfg.rollout.group_size,
        shaping=self._overlong,
      )
      traj, episodes, sampling = filled.traj, filled.episodes, filled.record()
      timer.add('rollout', time.perf_counter() - t0 - filled.extra_s)
      timer.add('resample', filled.extra_s)
    else:
      traj = play(0)
      timer.add('rollout', time.perf_counter() - t0)
      episodes = EpisodeStats.gather(traj)
    bucket = cfg.buckets.bucket_for(int(episodes.lengths.max()))
    num_rows = cfg.rollout.num_episodes
    stats = selector_lib.StepStats(
      episode_lengths=tuple(episodes.lengths.tolist()),
      num_responses=num_rows,
      free_memory_bytes=memory_lib.free_memory(self.devices),
      stage_tokens={
        Stage.ROLLOUT: episodes.generated_tokens,
        Stage.EXPERIENCE: num_rows * bucket * (2 if self.placement.has_reference else 1),
        Stage.TRAIN: num_rows * bucket * cfg.update_epochs,
      },
      stage_rows=assembly.rollout_rows(cfg),
    )
    return _Rollout(traj=traj, episodes=episodes, stats=stats, decision=decision, sampling=sampling)

  def _overlong(self, lengths) -> np.ndarray | None:
    """Per episode, its overlong penalty (`ExperimentConfig.overlong_buffer`; None: off)."""
    cfg = self.config
    if not cfg.overlong_buffer:
      return None
    return trajectories.overlong_penalties(
      lengths,
      cap=cfg.buckets.max_length,
      buffer=cfg.overlong_buffer,
      penalty=cfg.overlong_penalty,
    )

  def _move(self, name: str, batch: Batch, src, dst, timer: StageTimer, moves: dict, perm=None):
    """One stage-to-stage move through the Data Dispatcher, timed and accounted."""
    t0 = time.perf_counter()
    out, report = self.dispatcher.dispatch(batch, dst, src=src, perm=perm)
    out = jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    timer.add('dispatch', seconds)
    moves[name] = metrics.move_record(report, seconds)
    return out

  def _experience(self, rollout: _Rollout, timer: StageTimer, moves: dict):
    """4-5. The batch, built on the rollout layout from every process's own episodes, moves to
    the experience layout (planned from this step's lengths); with packing, the advantages are
    computed there and every rank packs its episodes; old (and reference) log-probs."""
    cfg = self.config
    roll_layout = self.placement.layout(rollout.decision.config)
    plan = self.planner.experience(rollout.stats, rollout.episodes.lengths, roll_layout)
    timer.profile_s += plan.profile_s
    decision, logprobs, packed = plan.decision, plan.program, plan.packed
    bucket = decision.run_bucket  # it holds the longest episode (x the headroom): every row fits
    batch = timer(
      'put',
      rollout.traj.to_device_batch,
      bucket=bucket,
      shardings=roll_layout.shardings(),
      gamma=cfg.advantages.gamma,
      move_credit=cfg.advantages.move_credit,
      exclude=('overflow',) if cfg.overlong_filter else (),
      bonus=self._overlong(rollout.traj.lengths),
    )
    layout = self.placement.layout(decision.config)
    batch = self._move('rollout_experience', batch, roll_layout, layout, timer, moves, plan.perm)
    args = (batch.tokens,)
    if packed is not None:
      mesh = self.placement.mesh(decision.config)
      with jax.set_mesh(mesh):
        batch = timer('advantages', self._advantages(decision.config), batch)
      batch = timer('pack', packing.pack, batch, packed, mesh)
      args = (batch.tokens, batch.segment_ids, batch.positions)
    params = timer('reshard', self.placement.params_on, decision.config)
    with self.scheduler.observing(logprobs):  # the run's own calls measure its layout
      old = timer('experience', logprobs, params, *args)
    del params
    ref = old
    if self.placement.has_reference:
      ref_params = self.placement.ref_on(decision.config)
      with self.scheduler.observing(logprobs):
        ref = timer('experience', logprobs, ref_params, *args)
    batch = batch.replace(old_logprobs=old, ref_logprobs=ref)
    return _Experience(batch=batch, layout=layout, bucket=bucket, decision=decision), packed

  def _train_program(self, stats, bucket: int, rows: int | None, timer: StageTimer):
    """6a. The train plan (the train state switched if the layout changed). Returns (decision,
    program, switch ms, the programs to precompile after the update)."""
    plan = self.planner.train(stats, bucket, rows, step=self.global_step)
    timer.profile_s += plan.profile_s
    switch_ms = 0.0
    if plan.switch is not None:
      self.switches.append(plan.switch.as_dict())
      switch_ms = plan.switch.stall_ms
      timer.add('reshard', switch_ms / 1e3)
    return plan.decision, plan.program, switch_ms, plan.lookahead

  def _to_train(self, exp: _Experience, rollout: _Rollout, train_decision, timer, moves) -> Batch:
    """6b. The batch from the experience layout to the train layout (unpacked: optionally
    balancing real tokens across the train ranks inside the same move)."""
    train_layout = self.placement.layout(train_decision.config)
    perm = None
    if self.config.balance and not self.config.pack:
      perm = dispatch_lib.balanced_permutation(
        rollout.episodes.lengths, exp.layout, train_layout, like=mesh_lib.abstract_arrays(exp.batch)
      )
    return self._move('experience_train', exp.batch, exp.layout, train_layout, timer, moves, perm)

  def _update(self, batch: Batch, train_decision, update, timer: StageTimer):
    """7-8. Advantages with collectives (unless computed before packing), then the update(s),
    on the train mesh. Returns (the last update's metrics, the skipped steps so far)."""
    if not self.config.pack:
      with jax.set_mesh(self.placement.mesh(train_decision.config)):
        batch = timer('advantages', self._advantages(train_decision.config), batch)
    for _ in range(self.config.update_epochs):
      with self.scheduler.observing(update):
        state, train_metrics = timer('train', update, self.placement.state, batch)
      self.placement.replace_state(state)
    # Replicated scalars: every process has them.
    out = jax.device_get((train_metrics, self.placement.state.skipped))
    # The batch is spent: recycling dispatches (CPU) land the next step's moves in its buffers.
    self.dispatcher.release(batch)
    return out

  def step(self) -> dict:
    """One EARL step (see the module docstring); returns its metrics record."""
    t_step = time.perf_counter()
    timer = StageTimer()
    moves: dict[str, dict] = {}
    rollout = self._roll_out(timer)
    if self.curriculum is not None:  # the next step's draw knows this one's episodes
      episodes = rollout.episodes
      self.curriculum.update(
        episodes.env_stats['task_id'].astype(int), np.array(episodes.outcomes) == 'win'
      )
    exp, packed = self._experience(rollout, timer, moves)
    rows = None if packed is None else packed.rows
    train_decision, update, switch_ms, lookahead = self._train_program(
      rollout.stats, exp.bucket, rows, timer
    )
    batch = self._to_train(exp, rollout, train_decision, timer, moves)
    train_metrics, skipped = self._update(batch, train_decision, update, timer)
    self.planner.precompile(lookahead)
    self.global_step += 1
    self.prev_stats = rollout.stats
    if timer.profile_s > 0:
      timer.add('profile', timer.profile_s)
      self.profile_s += timer.profile_s
    memory_lib.release_host_memory()  # the step's freed buffers and programs go back to the OS
    decisions = {
      Stage.ROLLOUT: rollout.decision,
      Stage.EXPERIENCE: exp.decision,
      Stage.TRAIN: train_decision,
    }
    record = metrics.step_record(
      episodes=rollout.episodes,
      bucket=exp.bucket,
      train_metrics=train_metrics,
      skipped_steps=int(skipped),
      moves=moves,
      kernels=self.dispatcher.traces,  # layout-aware kernels compiled so far
      switch_ms=switch_ms,
      plans={s: f'{d.config.name}@{d.bucket}' for s, d in decisions.items()},
      figures={str(s): metrics.plan_figures(d) for s, d in decisions.items()},
      times=timer.times,
      step_s=time.perf_counter() - t_step,
      rss_bytes=memory_lib.host_rss_bytes(),
      programs=len(self.executables),
      rollout=rollout.traj.rollout_stats,
      processes=jax.process_count(),
    )
    record.update(rollout.sampling)
    if self.curriculum is not None:
      record.update(self.curriculum.record())
    if packed is not None:
      record.update({'pack/rows': packed.rows, 'pack/fill': packed.fill})
    penalties = self._overlong(rollout.episodes.lengths)  # every process's episodes
    if penalties is not None:
      record.update(
        {
          'overlong/penalty_mean': float(np.mean(penalties)),
          'overlong/rate': float(np.mean(penalties < 0)),
        }
      )
    return record

  # ----------------------------------------------------------------------------------------------
  # Evaluation, checkpoints, the loop.

  def evaluate(self) -> dict:
    """Greedy games (or tasks) from fixed seeds on the rollout layout, every process playing
    its rows; with `eval_samples`, also that many samples of each of the first
    `eval_sample_tasks` tasks, for the sampled pass@1 and pass@k (`metrics.pass_at_k_record`)."""
    parallel = self.selector.current(Stage.ROLLOUT)
    if parallel is None:  # before the first step
      parallel = self._initial_decisions()[Stage.ROLLOUT].config
    params, mesh = self.placement.params_on(parallel), self.placement.mesh(parallel)
    seed = self.config.eval_seed
    traj = self.engines.evaluation.run(params, mesh, seed=seed, greedy=True)
    record = metrics.eval_record(EpisodeStats.gather(traj))
    if self.engines.sampled is not None:
      t0 = time.perf_counter()
      sampled = EpisodeStats.gather(self.engines.sampled.run(params, mesh, seed=seed))
      record.update(metrics.pass_at_k_record(sampled, k=self.config.eval_samples))
      record['eval/sampled_s'] = time.perf_counter() - t0
    return record

  def save(self) -> None:
    """Checkpoints the train state with what a resume needs to decide as this run would: the
    selector's state, the train layout, the statistics the next rollout decision reads, the
    profile the selector decides on (so that a resume does, whatever the cache file holds),
    and the curriculum's counts (the next step's draw)."""
    if self.run_dir.checkpointer is None:
      return
    stages = self.config.selector.profile.stages
    meta = {
      'selector': self.selector.state_dict(),
      'train_config': self.placement.train_config.name,
      'prev_stats': None if self.prev_stats is None else dataclasses.asdict(self.prev_stats),
      'profile': self.selector.profile(stages[0]).to_json() if stages else None,
      'curriculum': None if self.curriculum is None else self.curriculum.state_dict(),
    }
    self.run_dir.save(self.global_step, self.placement.state, meta)

  # ----------------------------------------------------------------------------------------------
  # The run (`run.loop`: the cadence, the stops and the non-finite guard every job shares).

  def run(self, progress: bool = True) -> dict:
    """Trains to `config.steps`, evaluating and checkpointing on the way (`loop.run`); returns a
    summary.

    Raises:
      preemption.Stopped: SIGTERM or SIGINT asked the run to stop; it stopped at the end of a
        step, every process at the same one, and saved it.
      NonFiniteError: too many non-finite steps in a row.
    """
    wall_s = loop.run(self, progress=progress)
    return self._summary(wall_s)

  def skipped_steps(self) -> int:
    return int(self.placement.state.skipped)

  def keep(self, record: dict) -> str:
    """Keeps the record's summary fields; its line (step 0's: the initial evaluation's)."""
    self.history.append(metrics.summary_fields(record))
    return metrics.eval_line(record) if record['step'] == 0 else format_line(record)

  def close(self) -> None:
    """Closes the logs and waits for the background compiles."""
    try:
      self.writer.close()
    finally:
      self.executables.wait()

  def _summary(self, wall_s: float) -> dict:
    evals = [r for r in self.history if 'eval/win_rate' in r]
    return {
      'steps': self.global_step,
      'wall_s': wall_s,
      'eval_win_rate_first': evals[0]['eval/win_rate'] if evals else None,
      'eval_win_rate_last': evals[-1]['eval/win_rate'] if evals else None,
      # Every evaluation metric (a code task's pass rates, ...) of the first and last evaluation.
      'eval_first': _eval_fields(evals[0]) if evals else None,
      'eval_last': _eval_fields(evals[-1]) if evals else None,
      'skipped_steps': int(self.placement.state.skipped),
      'profile_s': self.profile_s,
      'profile_share': self.profile_s / wall_s if wall_s > 0 else 0.0,
      'moves': move_summary(self.history),
      'switches': self.switches,
      'decisions_measured': _measured_counts(self.selector.history),
      'decisions': self.selector.log(),
      # The measured cells the decisions were taken on (`experiments/selector_regret.py` fits
      # the cost model to them and checks it against an offline profile).
      'profile': self._measured_profile(),
    }

  def _measured_profile(self) -> dict | None:
    stages = self.config.selector.profile.stages
    return self.selector.profile(stages[0]).measured_only().to_json() if stages else None


def _saved_profile(meta: dict) -> Profile | None:
  """The profile a checkpoint's decisions were taken on (None: none was kept)."""
  return Profile.from_json(meta['profile']) if meta.get('profile') else None


def _eval_fields(record: dict) -> dict:
  return {k[5:]: v for k, v in record.items() if k.startswith('eval/')} | {'step': record['step']}


def _step_seed(seed: int, step: int) -> int:
  return (seed * 1_000_003 + step) % (2**31 - 1)


def _measured_counts(decisions: list[selector_lib.Decision]) -> dict[str, dict[str, int]]:
  """Per stage: its decisions, how many ranked by measured figures, and how many switched."""
  out: dict[str, dict[str, int]] = {}
  for d in decisions:
    if 'REFUSED' in d.reason:
      continue
    counts = out.setdefault(str(d.stage), {'decisions': 0, 'measured': 0, 'switches': 0})
    counts['decisions'] += 1
    counts['measured'] += int(d.measured)
    counts['switches'] += int(d.switched)
  return out


__all__ = ['NonFiniteError', 'ResumeError', 'Trainer', 'WorkdirError']
