"""The EARL loop: plan, reshard, roll out, prepare experience, dispatch, advantages, train.

One step (`Trainer.step`), every stage on its own mesh over the same devices (colocated):

  1. plan       the Parallelism Selector picks each stage's ParallelConfig and context bucket
                from the previous step's statistics (rollout) or this step's (experience, train);
                a layout whose program XLA refuses is marked and the next one taken
                (`placement.decide_compiled`);
  2. reshard    parameters move device to device onto the rollout and experience meshes, and the
                train state (parameters + optimizer moments) when the train mesh changes
                (`placement.StagePlacement`);
  3. rollout    multi-turn episodes with a KV cache that persists across turns, each turn a
                compiled rollout program of the shared executable cache; every process steps the
                environments of the rows its devices hold, and the batch is built on the
                rollout layout from every process's own rows;
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
programs (`programs.Executables`), the profile (measured by `programs.profiling`, unless one is
passed in), the selector on it, the parameters and train state on the first train layout, the
engines.

  trainer = Trainer(ExperimentConfig(...), workdir='runs/default')
  summary = trainer.run()
"""

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from earl_jax import dispatch as dispatch_lib
from earl_jax import metrics
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.errors import UserError
from earl_jax.experiment import ExperimentConfig
from earl_jax.metrics import format_line, move_summary
from earl_jax.models import hf_import, tokenizer
from earl_jax.placement import StagePlacement, decide_compiled
from earl_jax.programs import Executables, StageSpec, profiling
from earl_jax.programs import memory as memory_lib
from earl_jax.rl import advantages as advantages_lib
from earl_jax.rl import packing
from earl_jax.rl.batch import Batch
from earl_jax.rollout import engine
from earl_jax.rollout.trajectories import EpisodeStats, Trajectories
from earl_jax.rundir import ResumeError, ResumePoint, RunDir, WorkdirError, check_writable
from earl_jax.selector import selector as selector_lib
from earl_jax.selector.profile import Profile
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage


class NonFiniteError(UserError):
  """`max_skipped_in_a_row` steps in a row had a loss, gradient or update that was not finite."""


@dataclasses.dataclass
class StageTimer:
  """Seconds per stage of one step, in the order they ran, and the seconds spent measuring the
  profile (logged as 'profile' after the stages)."""

  times: dict[str, float] = dataclasses.field(default_factory=dict)
  profile_s: float = 0.0

  def __call__(self, name: str, fn: Callable, *args, **kwargs):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    self.add(name, time.perf_counter() - t0)
    return out

  def add(self, name: str, seconds: float) -> None:
    self.times[name] = self.times.get(name, 0.0) + seconds


@dataclasses.dataclass
class _Rollout:
  """What the rollout stage hands on: this process's episodes and the whole batch's statistics."""

  traj: Trajectories
  episodes: EpisodeStats
  stats: selector_lib.StepStats
  decision: selector_lib.Decision


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
  ):
    """Args:
    config: the run.
    workdir: where metrics, checkpoints and plots go.
    resume: continue from the latest checkpoint in `workdir`.
    log_fn: receives every log line (default: absl logging).
    profile: a measured start-up profile to decide on (default: `measure_profile()`, which
      reuses `config.selector.profile.cache` when it matches).
    """
    self.config = config
    self.workdir = workdir
    self.log = log_fn or (lambda line: logging.info('%s', line))
    # The model, the tokenizer and what needs them, then the workdir and the checkpoint to
    # resume, are checked before anything is written or compiled.
    self.model_cfg, self.tokenizer = self._load_model_config()
    config.check_tokenizer(self.tokenizer, self.model_cfg.vocab_size)
    self.run_dir, resume_point = RunDir.open(workdir, config, resume=resume, log=self.log)
    self.devices = mesh_lib.canonical_devices()
    self.is_main = jax.process_index() == 0
    self._advantage_fns: dict[ParallelConfig, Any] = {}
    self.profile_s = 0.0  # spent measuring profile cells during the run
    self.num_groups = config.rollout.num_episodes // config.rollout.group_size

    self.spec = StageSpec.for_rollout(
      config.rollout,
      self.tokenizer,
      self.model_cfg.vocab_size,
      micro_batches=config.micro_batches,
      optim=config.optim,
      loss=config.loss,
      packed=config.pack,
    )
    # One AOT-compiled program per (stage, layout, bucket, rows), shared by everything below.
    self.executables = Executables(self.model_cfg, spec=self.spec)
    # Measures the profiled stages (and what a lazy profile lacks), preferring the cells of the
    # checkpoint a resume continues from.
    self.profiler = self._profiler(None if resume_point is None else resume_point.profile)
    # The measured profile the selector ranks its profiled stages by (None: analytic only).
    self.profile = profile if profile is not None else self.measure_profile()
    self.selector = self._make_selector()
    self.switches: list[dict] = []
    self.placement = StagePlacement.initialize(
      config, self.model_cfg, self.executables, self._initial_decisions()[Stage.TRAIN].config
    )
    self.engine, self.eval_engine = self._make_engines()
    self.dispatcher = dispatch_lib.Dispatcher(config.dispatch)

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

  def _load_model_config(self) -> tuple[ModelConfig, tokenizer.Tokenizer]:
    """The model's shapes and the tokenizer: from a HF directory, or a preset."""
    cfg = self.config
    if cfg.model_dir:
      model = hf_import.load_config(
        cfg.model_dir, param_dtype=cfg.param_dtype, dtype=cfg.param_dtype
      )
      return model, tokenizer.load_tokenizer(cfg.model_dir)
    model = ModelConfig.preset(cfg.model).replace(
      param_dtype=cfg.param_dtype, dtype=cfg.param_dtype
    )
    return model, tokenizer.load_tokenizer(cfg.tokenizer)

  def _profiler(self, base: Profile | None) -> profiling.RunProfiler | None:
    """How this run measures its profiled stages (None: it profiles none)."""
    if not self.config.selector.profile.stages:
      return None
    return profiling.RunProfiler.for_selector(
      self.config.selector,
      model=self.model_cfg,
      buckets=self.config.buckets,
      rows=self.config.rollout.num_episodes,
      spec=self.spec,
      executables=self.executables,
      base=base,
    )

  def _make_selector(self) -> selector_lib.Selector:
    """The selector on the measured profile (its stages) and the analytic model (the others)."""
    return selector_lib.Selector(
      self.config.selector,
      buckets=self.config.buckets,
      rows=self.config.rollout.num_episodes,
      model=self.model_cfg,
      num_devices=len(self.devices),
      profile=self.profile,
      spec=self.spec,
      switch_cost=self._switch_cost,  # consulted from the second decision on
    )

  def measure_profile(self) -> Profile | None:
    """The start-up profile of `config.selector.profile.stages` (None when it names none).

    Compiles and times every candidate program of those stages at every bucket (with
    `profile.lazy`: none; each bucket is measured when a decision first needs it), or loads
    what the cache holds when it was made for exactly this setup.
    """
    if self.profiler is None:
      return None
    return self.profiler.start(measure=not self.config.selector.profile.lazy)

  def _measure_missing(self, stage: Stage, stats: selector_lib.StepStats | None) -> float:
    """Measures the buckets a lazy profile lacks for the coming decision of `stage`; returns
    the seconds spent."""
    if self.profiler is None or not self.config.selector.profile.lazy:
      return 0.0
    profile, seconds = self.profiler.measure_missing(self.selector, stage, stats)
    self.profile = profile or self.profile
    return seconds

  def _initial_decisions(self) -> dict[Stage, selector_lib.Decision]:
    """The first decision of every stage (no statistics yet), recording nothing."""
    for stage in self.selector.stages:
      self.profile_s += self._measure_missing(stage, None)
    return self.selector.initial_decisions()

  def _switch_cost(self, stage: Stage, src: ParallelConfig, dst: ParallelConfig, bucket, rows):
    """What moving `stage` from `src` to `dst` would stall a step, in ms (the profiled compile
    time unless compiled, and for train the state's move): the selector's switch gate."""
    del src
    cell = None if self.profile is None else self.profile.cells.get((stage, bucket, rows, dst.name))
    compile_ms = cell.compile_ms if cell is not None and cell.compile_ms else 0.0
    return self.placement.switch_cost_ms(stage, dst, bucket, rows, compile_ms=compile_ms)

  def _make_engines(self) -> tuple[engine.RolloutEngine, engine.RolloutEngine]:
    """The training engine, and the evaluation engine (fixed seeds, greedy, its own episodes)."""
    cfg = self.config
    train = engine.RolloutEngine(
      self.model_cfg,
      self.tokenizer,
      cfg.env,
      cfg.rollout,
      cfg.buckets,
      programs=self.executables,
    )
    eval_rollout = dataclasses.replace(
      cfg.rollout,
      num_episodes=cfg.eval_episodes,
      group_size=1,
      sampling=dataclasses.replace(cfg.rollout.sampling, greedy=True),
    )
    evaluation = engine.RolloutEngine(
      self.model_cfg,
      self.tokenizer,
      cfg.eval_env,
      eval_rollout,
      cfg.buckets,
      programs=self.executables,
    )
    return train, evaluation

  def _resume(self, point: ResumePoint) -> list[dict]:
    """Restores the checkpoint `point` names (or an older one that reads); returns the metrics
    rows up to it, for the writer to rewrite."""
    self.placement.drop_state()  # the fresh state is replaced, not moved
    restored = self.run_dir.restore(point, self.executables.abstract_train_state)
    self.placement.restore(restored.state, restored.train_config)
    self.global_step = restored.step
    self.selector.load_state_dict(restored.selector_state)
    self.prev_stats = (
      None if restored.prev_stats is None else selector_lib.StepStats(**restored.prev_stats)
    )
    self.history = [metrics.summary_fields(r) for r in restored.rows]
    return restored.rows

  # ----------------------------------------------------------------------------------------------
  # Compiled programs and decisions.

  def _executable(self, decision: selector_lib.Decision, bucket: int, rows: int | None = None):
    """The AOT-compiled program of a stage, refused before running if it exceeds the budget."""
    return self.executables.get(
      decision.stage,
      decision.config,
      bucket,
      rows or decision.rows,
      budget=self.selector.budget_bytes,
      margin=self.config.selector.safety_margin,
    )

  def _decide(self, stage: Stage, stats, build: Callable, timer: StageTimer):
    """The stage's decision and what `build` makes of it, after measuring what a lazy profile
    lacks for it (counted in `timer.profile_s`); see `placement.decide_compiled`."""
    timer.profile_s += self._measure_missing(stage, stats)
    return decide_compiled(self.selector, stage, stats, build, log=self.log)

  def _advantages(self, parallel: ParallelConfig):
    """`advantages.with_advantages` jitted for the train mesh of `parallel` (one per layout)."""
    if parallel not in self._advantage_fns:
      self._advantage_fns[parallel] = advantages_lib.advantage_fn(
        self.placement.mesh(parallel), self.num_groups, self.config.advantages
      )
    return self._advantage_fns[parallel]

  def _row_multiple(self) -> int:
    """Packed rows split over the batch shards of every experience and train candidate (so any
    layout the selector picks, or falls back to, takes them) and over the micro-batches."""
    shards = [
      c.batch_shards
      for stage in (Stage.EXPERIENCE, Stage.TRAIN)
      for c in self.selector.profile(stage).candidates(stage)
    ]
    return math.lcm(self.config.micro_batches, *shards)

  # ----------------------------------------------------------------------------------------------
  # One step, stage by stage.

  def _roll_out(self, timer: StageTimer) -> _Rollout:
    """1-3. Rollout plan from the previous step's statistics; the episodes on its layout (the
    cache starts at the planned bucket and grows if an episode outgrows it); the statistics of
    the whole batch, merged over the processes."""
    cfg = self.config
    decision, _ = self._decide(
      Stage.ROLLOUT,
      self.prev_stats,
      # The engine's program: its rows are the rollout's slots.
      lambda d: self._executable(d, d.run_bucket, cfg.rollout.slots),
      timer,
    )
    params = timer('reshard', self.placement.params_on, decision.config)
    t0 = time.perf_counter()
    traj = self.engine.run(
      params,
      self.placement.mesh(decision.config),
      seed=_step_seed(cfg.seed, self.global_step),
      capacity=decision.run_bucket,
    )
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
    )
    return _Rollout(traj=traj, episodes=episodes, stats=stats, decision=decision)

  def _move(self, name: str, batch: Batch, src, dst, timer: StageTimer, moves: dict, perm=None):
    """One stage-to-stage move through the Data Dispatcher, timed and accounted."""
    t0 = time.perf_counter()
    out, report = self.dispatcher.dispatch(batch, dst, src=src, perm=perm)
    out = jax.block_until_ready(out)
    seconds = time.perf_counter() - t0
    timer.add('dispatch', seconds)
    moves[name] = {
      'strategy': report.strategy,
      'bytes': int(report.min_bytes or 0),
      # What the layout-aware rounds put on the wire, padding included (their capacities).
      'wire_bytes': int(
        sum(report.scheduled_sent) if report.scheduled_sent is not None else report.min_bytes or 0
      ),
      'ms': 1e3 * seconds,
      # This process's outputs written into recycled buffers (DispatchConfig.recycle_buffers).
      'recycled_bytes': int(report.recycled_bytes),
    }
    return out

  def _experience(self, rollout: _Rollout, timer: StageTimer, moves: dict):
    """4-5. The batch, built on the rollout layout from every process's own episodes, moves to
    the experience layout (planned from this step's lengths); with packing, the advantages are
    computed there and every rank packs its episodes; old (and reference) log-probs."""
    cfg = self.config
    roll_layout = self.placement.layout(rollout.decision.config)
    decision, (logprobs, perm, packed) = self._decide(
      Stage.EXPERIENCE,
      rollout.stats,
      lambda d: self._experience_program(d, rollout, roll_layout),
      timer,
    )
    bucket = decision.run_bucket  # it holds the longest episode (x the headroom): every row fits
    batch = timer(
      'put',
      rollout.traj.to_device_batch,
      bucket=bucket,
      shardings=roll_layout.shardings(),
      gamma=cfg.advantages.gamma,
      exclude=('overflow',) if cfg.overlong_filter else (),
    )
    layout = self.placement.layout(decision.config)
    batch = self._move('rollout_experience', batch, roll_layout, layout, timer, moves, perm)
    args = (batch.tokens,)
    if packed is not None:
      mesh = self.placement.mesh(decision.config)
      with jax.set_mesh(mesh):
        batch = timer('advantages', self._advantages(decision.config), batch)
      batch = timer('pack', packing.pack, batch, packed, mesh)
      args = (batch.tokens, batch.segment_ids, batch.positions)
    params = timer('reshard', self.placement.params_on, decision.config)
    old = timer('experience', logprobs, params, *args)
    del params
    ref = old
    if self.placement.has_reference:
      ref = timer('experience', logprobs, self.placement.ref_on(decision.config), *args)
    batch = batch.replace(old_logprobs=old, ref_logprobs=ref)
    return _Experience(batch=batch, layout=layout, bucket=bucket, decision=decision), packed

  def _experience_program(self, decision, rollout: _Rollout, roll_layout: dispatch_lib.Layout):
    """The experience program of `decision`, and (with packing) the balancing permutation and
    the packing of its ranks, all fixed before the batch moves."""
    perm = packed = None
    if self.config.pack:
      lengths = rollout.episodes.lengths
      if self.config.balance:  # real tokens balanced over the ranks that pack them
        like = jax.eval_shape(
          functools.partial(Batch.zeros, len(lengths), decision.run_bucket, xp=jnp)
        )
        perm = dispatch_lib.balanced_permutation(
          lengths, roll_layout, self.placement.layout(decision.config), like=like
        )
        lengths = lengths[perm]
      packed = packing.plan(
        lengths,
        ranks=decision.config.batch_shards,
        bucket=decision.run_bucket,
        row_multiple=self._row_multiple(),
      )
    rows = None if packed is None else packed.rows
    return self._executable(decision, decision.run_bucket, rows), perm, packed

  def _train_program(self, stats, bucket: int, rows: int | None, timer: StageTimer):
    """6a. The train plan; the train state switched if the layout changed; the neighbouring
    buckets' programs precompiled in the background. Returns (decision, program, switch ms)."""

    def build(decision):
      if decision.config == self.placement.train_config:
        return self._executable(decision, decision.run_bucket, rows), None
      return self.placement.switch_train(
        decision,
        bucket,
        rows,
        step=self.global_step,
        budget=self.selector.budget_bytes,
        margin=self.config.selector.safety_margin,
      )

    decision, (update, switch) = self._decide(Stage.TRAIN, stats, build, timer)
    switch_ms = 0.0
    if switch is not None:
      self.switches.append(switch.as_dict())
      switch_ms = switch.stall_ms
      timer.add('reshard', switch_ms / 1e3)
    for stage, config, neighbour, _ in self.selector.lookahead(decision)[1:]:
      self.executables.precompile(
        stage, config, neighbour, rows or decision.rows, tree=self.placement.state
      )
    return decision, update, switch_ms

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
    exp, packed = self._experience(rollout, timer, moves)
    rows = None if packed is None else packed.rows
    train_decision, update, switch_ms = self._train_program(rollout.stats, exp.bucket, rows, timer)
    batch = self._to_train(exp, rollout, train_decision, timer, moves)
    train_metrics, skipped = self._update(batch, train_decision, update, timer)
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
      times=timer.times,
      step_s=time.perf_counter() - t_step,
      rss_bytes=memory_lib.host_rss_bytes(),
      programs=len(self.executables),
      rollout=rollout.traj.rollout_stats,
    )
    if packed is not None:
      record.update({'pack/rows': packed.rows, 'pack/fill': packed.fill})
    return record

  # ----------------------------------------------------------------------------------------------
  # Evaluation, checkpoints, the loop.

  def evaluate(self) -> dict:
    """Greedy games from fixed seeds on the rollout layout, every process playing its rows."""
    parallel = self.selector.current(Stage.ROLLOUT)
    if parallel is None:  # before the first step
      parallel = self._initial_decisions()[Stage.ROLLOUT].config
    traj = self.eval_engine.run(
      self.placement.params_on(parallel),
      self.placement.mesh(parallel),
      seed=self.config.eval_seed,
      greedy=True,
    )
    episodes = EpisodeStats.gather(traj)
    rates = episodes.outcome_rates()
    return {
      'eval/win_rate': episodes.win_rate(),
      'eval/invalid_rate': rates.get('invalid', 0.0),
      'eval/draw_rate': rates.get('draw', 0.0),
      'eval/return_mean': float(np.mean(episodes.returns)),
      'eval/episode_len_mean': float(np.mean(episodes.lengths)),
    }

  def save(self) -> None:
    """Checkpoints the train state with what a resume needs to decide as this run would: the
    selector's state, the train layout, the statistics the next rollout decision reads, and the
    profile the selector decides on (so that a resume does, whatever the cache file holds)."""
    if self.run_dir.checkpointer is None:
      return
    stages = self.config.selector.profile.stages
    self.run_dir.save(
      self.global_step,
      self.placement.state,
      selector_state=self.selector.state_dict(),
      train_config=self.placement.train_config,
      prev_stats=None if self.prev_stats is None else dataclasses.asdict(self.prev_stats),
      profile=self.selector.profile(stages[0]).to_json() if stages else None,
    )

  def _log_step(self, record: dict, bar: Any, progress: bool) -> None:
    self.history.append(metrics.summary_fields(record))
    self.writer.write(self.global_step, record)
    line = format_line(record)
    if progress and self.is_main:
      bar.write(line)
    self.log(line)
    bar.update(1)

  def run(self, progress: bool = True) -> dict:
    """Trains to `config.steps`, evaluating and checkpointing on the way; returns a summary."""
    cfg = self.config
    from tqdm import tqdm  # only the loop needs it

    t0 = time.perf_counter()
    if self.global_step == 0 and cfg.eval_every:
      record = {'step': 0, **self.evaluate()}
      self.history.append(metrics.summary_fields(record))
      self.writer.write(0, record)
      self.log(f'step    0 | eval win {record["eval/win_rate"]:.3f}')
    bar = tqdm(
      total=cfg.steps,
      initial=self.global_step,
      disable=not (progress and self.is_main),
      leave=False,
    )
    skipped, in_a_row = int(self.placement.state.skipped), 0
    while self.global_step < cfg.steps:
      record = self.step()
      in_a_row = in_a_row + 1 if record['skipped_steps'] > skipped else 0
      skipped = record['skipped_steps']
      last = self.global_step == cfg.steps
      if cfg.eval_every and (self.global_step % cfg.eval_every == 0 or last):
        record.update(self.evaluate())
      record['step'] = self.global_step
      record['wall_s'] = time.perf_counter() - t0
      self._log_step(record, bar, progress)
      if cfg.checkpoint_every and (self.global_step % cfg.checkpoint_every == 0 or last):
        self.save()
      if cfg.max_skipped_in_a_row and in_a_row >= cfg.max_skipped_in_a_row:
        bar.close()
        self._finish()
        raise NonFiniteError(
          f'steps {self.global_step - in_a_row + 1}-{self.global_step}: {in_a_row} steps in a '
          'row were skipped because the loss, the gradients or the update were not finite '
          f'(max_skipped_in_a_row={cfg.max_skipped_in_a_row}); the parameters are those of the '
          'last kept step; expected finite updates: lower optim.learning_rate or check the data.'
        )
    bar.close()
    self._finish()
    return self._summary(time.perf_counter() - t0)

  def _summary(self, wall_s: float) -> dict:
    evals = [r['eval/win_rate'] for r in self.history if 'eval/win_rate' in r]
    return {
      'steps': self.global_step,
      'wall_s': wall_s,
      'eval_win_rate_first': evals[0] if evals else None,
      'eval_win_rate_last': evals[-1] if evals else None,
      'skipped_steps': int(self.placement.state.skipped),
      'profile_s': self.profile_s,
      'moves': move_summary(self.history),
      'switches': self.switches,
      'decisions': self.selector.log(),
    }

  def _finish(self) -> None:
    """Waits for the checkpoint being written and the background compiles; closes the logs."""
    self.run_dir.wait()
    self.writer.close()
    self.executables.wait()


def _step_seed(seed: int, step: int) -> int:
  return (seed * 1_000_003 + step) % (2**31 - 1)


__all__ = [
  'ExperimentConfig',
  'NonFiniteError',
  'ResumeError',
  'Trainer',
  'WorkdirError',
  'check_writable',
  'format_line',
  'move_summary',
]
