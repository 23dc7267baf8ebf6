"""The EARL loop: plan, reshard, roll out, prepare experience, dispatch, advantages, train.

One step (`Trainer.step`), every stage on its own mesh over the same devices (colocated):

  1. plan       the Parallelism Selector picks each stage's ParallelConfig and context bucket
                from the previous step's statistics (rollout) or this step's (experience, train);
                a layout whose program XLA refuses is marked and the next one taken;
  2. reshard    parameters move device to device onto the rollout and experience meshes, and the
                train state (parameters + optimizer moments) when the train mesh changes;
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
                step, JSONL + TensorBoard; Orbax checkpoints (every process) every N steps.

The same program runs on every process of a multi-controller run (`jax.distributed`): every
decision is taken from statistics that every process holds alike.

Construction is explicit: the model and tokenizer, the stage programs (`programs.Executables`),
the start-up profile (measured by its own call, `profiler.run`, unless one is passed in), the
selector on top of it, the parameters and the train state, the engines.

  trainer = Trainer(ExperimentConfig(...), workdir='runs/default')
  summary = trainer.run()
"""

import dataclasses
import functools
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from earl_jax import checkpointing, distributed, metrics
from earl_jax import dispatch as dispatch_lib
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.errors import UserError
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import hf_import, qwen2, tokenizer
from earl_jax.programs import Executables, StageSpec
from earl_jax.programs import executables as executables_lib
from earl_jax.programs import memory as memory_lib
from earl_jax.rl import advantages as advantages_lib
from earl_jax.rl import packing, train_step
from earl_jax.rl.batch import Batch
from earl_jax.rollout import engine
from earl_jax.rollout.trajectories import EpisodeStats, Trajectories
from earl_jax.selector import profiler
from earl_jax.selector import selector as selector_lib
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import STAGES, Stage


class ResumeError(UserError):
  """`--resume` without a checkpoint, or with another config's."""


class WorkdirError(UserError):
  """A workdir that cannot be written, or that holds another run."""


class NonFiniteError(UserError):
  """`max_skipped_in_a_row` steps in a row had a loss, gradient or update that was not finite."""


@dataclasses.dataclass
class StageTimer:
  times: dict[str, float] = dataclasses.field(default_factory=dict)

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
  """What the experience stage hands on: the batch on its layout and its bucket."""

  batch: Batch
  layout: dispatch_lib.Layout
  bucket: int


class Trainer:
  """Runs `ExperimentConfig` in `workdir` (metrics, checkpoints, plots)."""

  def __init__(
    self,
    config: ExperimentConfig,
    *,
    workdir: str,
    resume: bool = False,
    log_fn: Callable[[str], None] | None = None,
    profile: profiler.Profile | None = None,
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
    # The workdir and the checkpoint to resume are checked before anything compiles.
    self._resume_steps: list[int] = []
    self._checkpoint_profile: profiler.Profile | None = None  # the profile a resume restores
    self.ckpt = self._open_workdir(resume)
    self.devices = mesh_lib.canonical_devices()
    self.is_main = jax.process_index() == 0
    self._advantage_fns: dict[ParallelConfig, Any] = {}
    self._reshard_ms_per_byte: float | None = None  # measured device-to-device moves
    self.profile_s = 0.0  # spent measuring profile cells during the run
    self.num_groups = config.rollout.num_episodes // config.rollout.group_size

    self.model_cfg, self.tokenizer = self._load_model_config()
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
    self.selector = selector_lib.Selector(
      config.selector,
      buckets=config.buckets,
      rows=config.rollout.num_episodes,
      model=self.model_cfg,
      num_devices=len(self.devices),
      profile=profile if profile is not None else self.measure_profile(),
      spec=self.spec,
      measure=self._measure_bucket if config.selector.profile.lazy else None,
      switch_cost=self._switch_cost,
    )
    self.plans: dict[Stage, selector_lib.Decision] = {}
    self.switches: list[dict] = []
    self._init_state()
    self.engine, self.eval_engine = self._make_engines()
    self.dispatcher = dispatch_lib.Dispatcher(config.dispatch)

    self.global_step = 0
    self.prev_stats: selector_lib.StepStats | None = None
    self.history: list[dict] = []
    if resume:
      self._resume()
    # After a resume, TensorBoard hides what a run that died logged after the checkpoint.
    self.writer = metrics.MetricsWriter(
      workdir, enabled=self.is_main, purge_step=self.global_step + 1 if resume else None
    )
    if resume:
      self.writer.rewrite(self._resumed_rows)
      del self._resumed_rows

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

  def _profile_config(self) -> profiler.ProfileConfig:
    return selector_lib.profile_config(
      self.config.selector,
      buckets=self.config.buckets,
      rows=self.config.rollout.num_episodes,
      spec=self.spec,
      budget_bytes=self._budget(),
    )

  def measure_profile(self) -> profiler.Profile | None:
    """The start-up profile of `config.selector.profile.stages` (None when it names none).

    Compiles and times every candidate program of those stages at every bucket (with
    `profile.lazy`: none; each bucket is measured when a decision first needs it), or loads
    what the cache holds when it was made for exactly this setup.
    """
    sel = self.config.selector
    if not sel.profile.stages:
      return None
    return profiler.run(
      self.model_cfg,
      self._profile_config(),
      executables=self.executables,
      cache_path=sel.profile.cache,
      measure=not sel.profile.lazy,
      base=self._checkpoint_profile,
    )

  def _measure_bucket(self, stage: Stage, bucket: int) -> profiler.Profile:
    """The profile with `bucket` measured for every profiled stage (cached on disk)."""
    del stage  # every profiled stage is measured at once
    t0 = time.perf_counter()
    out = profiler.run(
      self.model_cfg,
      self._profile_config(),
      executables=self.executables,
      cache_path=self.config.selector.profile.cache,
      buckets=(bucket,),
      base=self._checkpoint_profile,
    )
    self.profile_s += time.perf_counter() - t0
    return out

  def _switch_cost(self, stage: Stage, src: ParallelConfig, dst: ParallelConfig, bucket, rows):
    """What moving `stage` from `src` to `dst` would stall a step, in ms: the compile of the
    program when it is not compiled or compiling yet (its profiled compile time), and for train
    the move of the train state (its bytes at the measured device-to-device rate)."""
    del src
    cost = 0.0
    key = self.executables.key(stage, dst, bucket, rows)
    if not self.executables.requested(key):
      profile = self.selector.profile(stage)
      cell = profile.cells.get((stage, bucket, rows, dst.name))
      cost += cell.compile_ms if cell is not None and cell.compile_ms else 0.0
    if stage == Stage.TRAIN and self._reshard_ms_per_byte is not None:
      cost += self._reshard_ms_per_byte * _tree_bytes(self.state)
    return cost

  def _budget(self) -> int | None:
    """The per-device budget: the device's own limit, or the emulated one (None: unlimited)."""
    return memory_lib.resolve_budget(self.config.selector.budget_bytes)

  def _init_state(self) -> None:
    """Parameters and the train state (moments sharded like their parameters) on the train mesh."""
    cfg = self.config
    self.train_config = self.selector.initial_decisions()[Stage.TRAIN].config
    train_mesh = self.mesh(self.train_config)
    if cfg.model_dir:
      self.graphdef, params = hf_import.load_params(cfg.model_dir, self.model_cfg, train_mesh)
    else:
      self.graphdef, params = qwen2.init_model(self.model_cfg, train_mesh, seed=cfg.init_seed)
    self.optimizer = train_step.make_optimizer(cfg.optim)
    # The frozen reference policy lives on the experience layout (the only stage that reads it).
    self.ref_params = None
    self.ref_config = self.train_config
    if cfg.loss.kl_coef > 0:
      self.ref_params = jax.tree.map(jnp.copy, params)
    self.state = train_step.init_train_state(
      params, self.optimizer, entropy_coef=cfg.loss.entropy_coef
    )

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

  # ----------------------------------------------------------------------------------------------
  # Meshes, parameters on a mesh, compiled programs.

  def mesh(self, parallel: ParallelConfig) -> jax.sharding.Mesh:
    return self.executables.mesh(parallel)

  def params_on(self, parallel: ParallelConfig):
    """The train parameters laid out on `parallel`'s mesh: the state's own arrays on the train
    layout, else a device-to-device copy that the caller drops as soon as its stage is done."""
    if parallel == self.train_config:
      return self.state.params
    t0 = time.perf_counter()
    out = jax.block_until_ready(
      self.executables.resharder(
        self.state.params, self.executables.param_shardings(parallel), donate=False
      )
    )
    self._note_reshard(out, time.perf_counter() - t0)
    return out

  def _note_reshard(self, tree: Any, seconds: float) -> None:
    """Keeps the device-to-device move rate (ms per byte) the switch-cost gate estimates from."""
    # Process 0's timing, on every process: the switch gate reads it, and every process must
    # take the same decision (local timings differ).
    rate = distributed.broadcast_json(1e3 * seconds / max(_tree_bytes(tree), 1))
    old = self._reshard_ms_per_byte
    self._reshard_ms_per_byte = rate if old is None else 0.5 * (old + rate)

  def _ref_on(self, parallel: ParallelConfig):
    """The reference parameters, moved (donated) to `parallel` when the experience layout changes."""
    if parallel != self.ref_config:
      self.ref_params = self.executables.resharder(
        self.ref_params, self.executables.param_shardings(parallel)
      )
      self.ref_config = parallel
    return self.ref_params

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

  def _decide(self, stage: Stage, stats: selector_lib.StepStats | None, rows: int | None = None):
    """The stage's decision and its program at the run bucket (for `rows`, default the load).

    A program that XLA's memory analysis refuses at compile time marks its layout infeasible
    there; the decision is taken again, with the next candidate (logged with the reason).
    """
    while True:
      decision = self._plan(stage, stats)
      try:
        if stage == Stage.TRAIN and decision.config != self.train_config:
          return decision, None  # the switch compiles it (and is refused the same way)
        return decision, self._executable(decision, decision.run_bucket, rows)
      except memory_lib.InfeasibleError as e:
        self.selector.mark_infeasible(decision, str(e))
        self.log(f'refused at compile time, deciding again: {e}')

  def _layout(self, parallel: ParallelConfig) -> dispatch_lib.Layout:
    """The batch layout every stage program is compiled for (`Batch.shardings`)."""
    mesh = self.mesh(parallel)
    return dispatch_lib.Layout(
      mesh=mesh, specs=jax.tree.map(lambda s: s.spec, Batch.shardings(mesh))
    )

  def _advantages(self, parallel: ParallelConfig):
    """`advantages.with_advantages` jitted for the train mesh of `parallel` (one per layout)."""
    if parallel not in self._advantage_fns:
      self._advantage_fns[parallel] = advantages_lib.advantage_fn(
        self.mesh(parallel), self.num_groups, self.config.advantages
      )
    return self._advantage_fns[parallel]

  def _switch_train(self, decision: selector_lib.Decision, bucket: int, rows: int | None = None):
    """Moves the train state (params + AdamW moments) to the new layout; returns the program."""
    state, program, record = executables_lib.switch(
      Stage.TRAIN,
      self.state,
      self.executables,
      decision.config,
      bucket,
      rows or decision.rows,
      source=self.train_config,
      step=self.global_step,
      budget=self.selector.budget_bytes,
      margin=self.config.selector.safety_margin,
    )
    self.state = state
    self._note_reshard(state, record.reshard_ms / 1e3)
    self.train_config = decision.config
    self.switches.append(record.as_dict())
    return program, record.stall_ms

  # ----------------------------------------------------------------------------------------------
  # One step, stage by stage.

  def _plan(self, stage: Stage, stats: selector_lib.StepStats | None) -> selector_lib.Decision:
    decision = self.selector.decide(stage, stats)
    self.plans[stage] = decision
    return decision

  def _roll_out(self, timer: StageTimer) -> _Rollout:
    """1-3. Rollout plan from the previous step's statistics; the episodes on its layout (the
    cache starts at the planned bucket and grows if an episode outgrows it); the statistics of
    the whole batch, merged over the processes."""
    cfg = self.config
    d_roll, _ = self._decide(Stage.ROLLOUT, self.prev_stats)
    params_r = timer('reshard', self.params_on, d_roll.config)
    t0 = time.perf_counter()
    traj = self.engine.run(
      params_r,
      self.mesh(d_roll.config),
      seed=_step_seed(cfg.seed, self.global_step),
      capacity=d_roll.run_bucket,
    )
    timer.add('rollout', time.perf_counter() - t0)
    episodes = EpisodeStats.gather(traj)
    T = cfg.buckets.bucket_for(int(episodes.lengths.max()))
    B = cfg.rollout.num_episodes
    stats = selector_lib.StepStats(
      episode_lengths=tuple(episodes.lengths.tolist()),
      num_responses=B,
      free_memory_bytes=memory_lib.free_memory(self.devices),
      stage_tokens={
        Stage.ROLLOUT: episodes.generated_tokens,
        Stage.EXPERIENCE: B * T * (2 if self.ref_params is not None else 1),
        Stage.TRAIN: B * T * cfg.update_epochs,
      },
    )
    return _Rollout(traj=traj, episodes=episodes, stats=stats, decision=d_roll)

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

  def _row_multiple(self) -> int:
    """Packed rows split over the batch shards of every experience and train candidate (so any
    layout the selector picks, or falls back to, takes them) and over the micro-batches."""
    shards = [
      c.batch_shards
      for stage in (Stage.EXPERIENCE, Stage.TRAIN)
      for c in self.selector.profile(stage).candidates(stage)
    ]
    return math.lcm(self.config.micro_batches, *shards)

  def _experience(self, rollout: _Rollout, timer: StageTimer, moves: dict):
    """4-5. The batch, built on the rollout layout from every process's own episodes, moves to
    the experience layout (planned from this step's lengths); with packing, the advantages are
    computed there and every rank packs its episodes; old (and reference) log-probs."""
    cfg = self.config
    roll_layout = self._layout(rollout.decision.config)
    d_exp, logprobs, perm, packed = self._experience_plan(rollout, roll_layout)
    T = d_exp.run_bucket  # it holds the longest episode (times the headroom): every row fits
    batch = timer(
      'put',
      rollout.traj.to_device_batch,
      bucket=T,
      shardings=roll_layout.shardings(),
      gamma=cfg.advantages.gamma,
      exclude=('overflow',) if cfg.overlong_filter else (),
    )
    layout = self._layout(d_exp.config)
    batch = self._move('rollout_experience', batch, roll_layout, layout, timer, moves, perm)
    args = (batch.tokens,)
    if packed is not None:
      mesh_e = self.mesh(d_exp.config)
      with jax.set_mesh(mesh_e):
        batch = timer('advantages', self._advantages(d_exp.config), batch)
      batch = timer('pack', packing.pack, batch, packed, mesh_e)
      args = (batch.tokens, batch.segment_ids, batch.positions)
    params_e = timer('reshard', self.params_on, d_exp.config)
    old = timer('experience', logprobs, params_e, *args)
    del params_e
    ref = old
    if self.ref_params is not None:
      ref = timer('experience', logprobs, self._ref_on(d_exp.config), *args)
    batch = batch.replace(old_logprobs=old, ref_logprobs=ref)
    return _Experience(batch=batch, layout=layout, bucket=T), packed

  def _experience_plan(self, rollout: _Rollout, roll_layout: dispatch_lib.Layout):
    """The experience layout, its program, and (with packing) the balancing permutation and the
    packing of its ranks, all fixed before the batch moves. A program refused at compile time
    marks its layout, and the stage is planned again."""
    cfg = self.config
    while True:
      d_exp = self._plan(Stage.EXPERIENCE, rollout.stats)
      perm = packed = None
      if cfg.pack:
        lengths = rollout.episodes.lengths
        if cfg.balance:  # real tokens balanced over the ranks that pack them
          like = jax.eval_shape(
            functools.partial(Batch.zeros, len(lengths), d_exp.run_bucket, xp=jnp)
          )
          perm = dispatch_lib.balanced_permutation(
            lengths, roll_layout, self._layout(d_exp.config), like=like
          )
          lengths = lengths[perm]
        packed = packing.plan(
          lengths,
          ranks=d_exp.config.batch_shards,
          bucket=d_exp.run_bucket,
          row_multiple=self._row_multiple(),
        )
      try:
        program = self._executable(d_exp, d_exp.run_bucket, None if packed is None else packed.rows)
        return d_exp, program, perm, packed
      except memory_lib.InfeasibleError as e:
        self.selector.mark_infeasible(d_exp, str(e))
        self.log(f'refused at compile time, deciding again: {e}')

  def _train_program(self, stats: selector_lib.StepStats, T: int, rows: int | None, timer):
    """6a. The train plan; the train state switched if the layout changed; the neighbouring
    buckets' programs precompiled in the background. Returns (decision, program, switch ms)."""
    while True:
      d_train, update = self._decide(Stage.TRAIN, stats, rows)
      switch_ms = 0.0
      if update is not None:
        break
      try:
        update, switch_ms = self._switch_train(d_train, T, rows)
        timer.add('reshard', switch_ms / 1e3)
        break
      except memory_lib.InfeasibleError as e:
        self.selector.mark_infeasible(d_train, str(e))
        self.log(f'refused at compile time, deciding again: {e}')
    for stage, config, bucket, _ in self.selector.lookahead(d_train)[1:]:
      self.executables.precompile(stage, config, bucket, rows or d_train.rows, tree=self.state)
    return d_train, update, switch_ms

  def _to_train(self, exp: _Experience, rollout: _Rollout, d_train, timer, moves) -> Batch:
    """6b. The batch from the experience layout to the train layout (unpacked: optionally
    balancing real tokens across the train ranks inside the same move)."""
    train_layout = self._layout(d_train.config)
    perm = None
    if self.config.balance and not self.config.pack:
      perm = dispatch_lib.balanced_permutation(
        rollout.episodes.lengths, exp.layout, train_layout, like=mesh_lib.abstract_arrays(exp.batch)
      )
    return self._move('experience_train', exp.batch, exp.layout, train_layout, timer, moves, perm)

  def _update(self, batch: Batch, d_train: selector_lib.Decision, update, timer: StageTimer):
    """7-8. Advantages with collectives (unless computed before packing), then the update(s),
    on the train mesh."""
    if not self.config.pack:
      mesh_t = self.mesh(d_train.config)
      with jax.set_mesh(mesh_t):
        batch = timer('advantages', self._advantages(d_train.config), batch)
    for _ in range(self.config.update_epochs):
      self.state, m = timer('train', update, self.state, batch)
    out = jax.device_get((m, self.state.skipped))  # replicated scalars: every process has them
    # The batch is spent: recycling dispatches (CPU) land the next step's moves in its buffers.
    self.dispatcher.release(batch)
    return out

  def step(self) -> dict:
    """One EARL step (see the module docstring); returns its metrics record."""
    t_step = time.perf_counter()
    timer = StageTimer()
    moves: dict[str, dict] = {}
    profile_s = self.profile_s
    rollout = self._roll_out(timer)
    exp, packed = self._experience(rollout, timer, moves)
    rows = None if packed is None else packed.rows
    d_train, update, switch_ms = self._train_program(rollout.stats, exp.bucket, rows, timer)
    batch = self._to_train(exp, rollout, d_train, timer, moves)
    m, skipped = self._update(batch, d_train, update, timer)
    self.global_step += 1
    self.prev_stats = rollout.stats
    if self.profile_s > profile_s:
      timer.add('profile', self.profile_s - profile_s)
    memory_lib.release_host_memory()  # the step's freed buffers and programs go back to the OS
    record = self._record(rollout, exp.bucket, m, skipped, moves, switch_ms, timer, t_step)
    if packed is not None:
      record.update({'pack/rows': packed.rows, 'pack/fill': packed.fill})
    return record

  def _record(self, rollout, T, m, skipped, moves, switch_ms, timer, t_step) -> dict:
    elapsed = time.perf_counter() - t_step
    ep = rollout.episodes
    return {
      'win_rate': ep.win_rate(),
      'return_mean': float(np.mean(ep.returns)),
      'invalid_rate': ep.outcome_rates().get('invalid', 0.0),
      # Episodes that would have outgrown the largest bucket (the context cap): truncated there.
      'overflow_rate': ep.outcome_rates().get('overflow', 0.0),
      **{f'ctx/{k}': v for k, v in ep.context_stats().items()},
      'bucket': T,
      'tokens': ep.tokens,
      'generated_tokens': ep.generated_tokens,
      'tokens_per_s': ep.tokens / elapsed,
      'rollout_tokens_per_s': ep.generated_tokens / max(timer.times['rollout'], 1e-9),
      **{f'loss/{k}': float(v) for k, v in m.items()},
      'skipped_steps': int(skipped),
      **{f'dispatch/{name}/{k}': v for name, move in moves.items() for k, v in move.items()},
      'dispatch/bytes_moved': float(sum(move['bytes'] for move in moves.values())),
      'dispatch/kernels': self.dispatcher.traces,  # layout-aware kernels compiled so far
      'switch_ms': switch_ms,
      **{f'plan/{s}': f'{self.plans[s].config.name}@{self.plans[s].bucket}' for s in STAGES},
      **{f'time/{k}_s': v for k, v in timer.times.items()},
      'time/step_s': elapsed,
      'host/rss_mib': (memory_lib.host_rss_bytes() or 0) / (1 << 20),
      'host/programs': len(self.executables),
    }

  # ----------------------------------------------------------------------------------------------
  # Evaluation, checkpoints, the loop.

  def evaluate(self) -> dict:
    """Greedy games from fixed seeds on the rollout layout, every process playing its rows."""
    d = self.plans.get(Stage.ROLLOUT) or self.selector.initial_decisions()[Stage.ROLLOUT]
    traj = self.eval_engine.run(
      self.params_on(d.config), self.mesh(d.config), seed=self.config.eval_seed, greedy=True
    )
    ep = EpisodeStats.gather(traj)
    rates = ep.outcome_rates()
    return {
      'eval/win_rate': ep.win_rate(),
      'eval/invalid_rate': rates.get('invalid', 0.0),
      'eval/draw_rate': rates.get('draw', 0.0),
      'eval/return_mean': float(np.mean(ep.returns)),
      'eval/episode_len_mean': float(np.mean(ep.lengths)),
    }

  def _meta(self) -> dict:
    return {
      'step': self.global_step,
      'fingerprint': self.config.fingerprint(),
      'config': self.config.to_json(),
      'selector': self.selector.state_dict(),
      'train_config': self.train_config.name,
      'prev_stats': None if self.prev_stats is None else dataclasses.asdict(self.prev_stats),
      'profile': self._measured_profile(),
    }

  def _measured_profile(self) -> dict | None:
    """The profile the selector decides on (JSON), kept in every checkpoint: a resume decides
    on the same measurements, whatever the cache file holds."""
    stages = self.config.selector.profile.stages
    return self.selector.profile(stages[0]).to_json() if stages else None

  def save(self) -> None:
    if self.ckpt is None:
      return
    self.ckpt.save(self.global_step, self.state, self._meta())

  def _open_workdir(self, resume: bool) -> checkpointing.Checkpointer | None:
    """Checks that the workdir can be written and holds no other run (or, with `resume`, a
    checkpoint of this config); returns the checkpointer (None when nothing is saved)."""
    check_writable(self.workdir)
    ckpt_dir = os.path.join(self.workdir, 'checkpoints')
    if not resume:
      used = [n for n in ('metrics.jsonl', 'checkpoints') if _nonempty(self.workdir, n)]
      if used:
        raise WorkdirError(
          f'--workdir {self.workdir} holds a run ({" and ".join(used)}): expected an unused '
          'folder; pass --resume to continue it, --move_aside to keep it aside and start '
          'afresh, or another --workdir.'
        )
    if not (self.config.checkpoint_every or resume):
      return None
    ckpt = checkpointing.Checkpointer(ckpt_dir, max_to_keep=self.config.keep_checkpoints)
    if resume:
      if ckpt.latest_step() is None:
        raise ResumeError(
          f'--resume: no checkpoint in {ckpt_dir}: expected a run to continue; start without '
          '--resume (or point --workdir at the run to continue).'
        )
      steps = sorted(ckpt.all_steps(), reverse=True)
      step, meta = next(ckpt.readable_metas(steps, on_skip=self._skip_checkpoint), (None, None))
      if meta is None:
        raise ResumeError(
          f'--resume: no readable checkpoint in {ckpt_dir} (steps {steps}): expected one that '
          'restores; start without --resume in a new --workdir.'
        )
      if meta.get('fingerprint') != self.config.fingerprint():
        raise ResumeError(
          f'--resume: the checkpoint in {self.workdir} (step {meta.get("step")}) was made by '
          f'another config (fingerprint {meta.get("fingerprint")} != '
          f'{self.config.fingerprint()}): expected the same preset and overrides, or a new '
          '--workdir.'
        )
      if meta.get('profile'):
        self._checkpoint_profile = profiler.Profile.from_json(meta['profile'])
      self._resume_steps = [s for s in steps if s <= step]
    return ckpt

  def _skip_checkpoint(self, step: int, reason: str) -> None:
    line = f'checkpoint step {step} in {self.workdir} is unreadable ({reason}): skipped'
    logging.warning('%s', line)
    self.log(line)

  def _resume(self) -> None:
    """Restores the newest checkpoint that reads and verifies (older ones if it does not)."""
    assert self.ckpt is not None  # checked by _open_workdir
    del self.state  # the fresh state is replaced, not moved
    abstract = lambda meta: self.executables.abstract_train_state(  # noqa: E731
      ParallelConfig.parse(meta['train_config'])
    )
    step, self.state, meta = self.ckpt.restore_newest_readable(
      abstract, on_skip=self._skip_checkpoint, steps=self._resume_steps
    )
    newer = [s for s in self.ckpt.all_steps() if s > step]
    if newer:  # kept aside, so that this run can save those steps again
      self.ckpt.set_aside(newer, suffix='unreadable')
      logging.warning('resuming from step %d, the newest readable checkpoint', step)
    self.train_config = ParallelConfig.parse(meta['train_config'])
    self.global_step = int(meta['step'])
    self.selector.load_state_dict(meta['selector'])
    self.prev_stats = (
      None if meta['prev_stats'] is None else selector_lib.StepStats(**meta['prev_stats'])
    )
    # The metrics history stays on disk: the rows up to the checkpoint are kept, and what a run
    # that died logged after it is dropped (the file is rewritten once the writer is open).
    path = os.path.join(self.workdir, 'metrics.jsonl')
    rows = metrics.read_jsonl(path) if os.path.exists(path) else []
    self._resumed_rows = [r for r in rows if r.get('step', 0) <= self.global_step]
    self.history = [_summary_fields(r) for r in self._resumed_rows]
    self.log(f'resumed from step {self.global_step} ({self.ckpt.directory})')

  def _log_step(self, record: dict, bar: Any, progress: bool) -> None:
    self.history.append(_summary_fields(record))
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
      self.history.append(_summary_fields(record))
      self.writer.write(0, record)
      self.log(f'step    0 | eval win {record["eval/win_rate"]:.3f}')
    bar = tqdm(
      total=cfg.steps,
      initial=self.global_step,
      disable=not (progress and self.is_main),
      leave=False,
    )
    skipped, in_a_row = int(self.state.skipped), 0
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
    evals = [r['eval/win_rate'] for r in self.history if 'eval/win_rate' in r]
    return {
      'steps': self.global_step,
      'wall_s': time.perf_counter() - t0,
      'eval_win_rate_first': evals[0] if evals else None,
      'eval_win_rate_last': evals[-1] if evals else None,
      'skipped_steps': int(self.state.skipped),
      'profile_s': self.profile_s,
      'moves': move_summary(self.history),
      'switches': self.switches,
      'decisions': self.selector.log(),
    }

  def _finish(self) -> None:
    """Waits for the checkpoint being written and the background compiles; closes the logs."""
    if self.ckpt is not None:
      self.ckpt.wait()
    self.writer.close()
    self.executables.wait()


def check_writable(workdir: str) -> None:
  """Raises WorkdirError unless this process can create files in `workdir` (made if missing)."""
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise WorkdirError(f'--workdir {workdir}: {existing} is a file: expected a folder.')
  try:
    fd, probe = tempfile.mkstemp(dir=existing, prefix='.earl_write_check_')
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise WorkdirError(
      f'--workdir {workdir} is not writable ({e.strerror} in {existing}): expected a folder '
      'this process can write.'
    ) from None


def _nonempty(workdir: str, name: str) -> bool:
  path = os.path.join(workdir, name)
  if os.path.isdir(path):
    return bool(os.listdir(path))
  return os.path.isfile(path) and os.path.getsize(path) > 0


def _summary_fields(record: dict) -> dict:
  """What the run's summary reads from a step's record (the full record is on disk)."""
  return {
    k: v
    for k, v in record.items()
    if k in ('step', 'eval/win_rate') or k.startswith(('plan/', 'dispatch/'))
  }


def move_summary(history: list[dict]) -> dict[str, Any]:
  """Per stage move, over the train steps of `history`: how many steps ran it, on how many
  the stages' layouts differed and bytes really moved, the bytes (moved, put on the wire by the
  layout-aware rounds with their padding, and this process's outputs landed in recycled
  buffers) and milliseconds in all."""
  out: dict[str, Any] = {}
  steps = [r for r in history if 'plan/train' in r]
  pairs = {
    'rollout_experience': ('rollout', 'experience'),
    'experience_train': ('experience', 'train'),
  }
  for name, (a, b) in pairs.items():
    rows = [r for r in steps if f'dispatch/{name}/bytes' in r]
    layout = lambda r, s: r[f'plan/{s}'].split('@')[0]  # noqa: E731
    out[name] = {
      'steps': len(rows),
      'layouts_differ': sum(layout(r, a) != layout(r, b) for r in rows),
      'bytes_moved_steps': sum(r[f'dispatch/{name}/bytes'] > 0 for r in rows),
      'bytes': int(sum(r[f'dispatch/{name}/bytes'] for r in rows)),
      'wire_bytes': int(sum(r.get(f'dispatch/{name}/wire_bytes', 0) for r in rows)),
      'recycled_bytes': int(sum(r.get(f'dispatch/{name}/recycled_bytes', 0) for r in rows)),
      'ms': float(sum(r[f'dispatch/{name}/ms'] for r in rows)),
      'strategies': sorted({r[f'dispatch/{name}/strategy'] for r in rows}),
    }
  return out


def _step_seed(seed: int, step: int) -> int:
  return (seed * 1_000_003 + step) % (2**31 - 1)


def _tree_bytes(tree: Any) -> int:
  """Bytes of every array of `tree` (globally, counting each element once)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _size(n: float) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if n >= scale:
      return f'{n / scale:.1f}{unit}'
  return f'{n:.0f}B'


def format_line(r: dict) -> str:
  """The one-line summary of a step."""
  parts = [
    f'step {r["step"]:4d}',
    f'win {r.get("win_rate", float("nan")):.3f}',
    f'ret {r.get("return_mean", float("nan")):+.3f}',
  ]
  if 'eval/win_rate' in r:
    parts.append(f'eval {r["eval/win_rate"]:.3f}')
  parts.append(
    f'ctx turn {r.get("ctx/turn_len_mean", 0):.0f} ep {r.get("ctx/episode_len_mean", 0):.0f}'
    f'/{r.get("ctx/episode_len_max", 0):.0f}'
  )
  parts.append(f'{r.get("tokens_per_s", 0):,.0f} tok/s')
  parts.append('plan ' + ' '.join(f'{s[0]}={r.get(f"plan/{s}", "?")}' for s in STAGES))
  moves = []
  for name, short in (('rollout_experience', 'r>e'), ('experience_train', 'e>t')):
    if f'dispatch/{name}/bytes' in r:
      moves.append(f'{short} {_size(r[f"dispatch/{name}/bytes"])} {r[f"dispatch/{name}/ms"]:.0f}ms')
  if moves:
    parts.append('moved ' + ' '.join(moves))
  times = ' '.join(
    f'{k[5:-2]} {v:.2f}s' for k, v in r.items() if k.startswith('time/') and k != 'time/step_s'
  )
  parts.append(times)
  return ' | '.join(parts)


__all__ = ['ExperimentConfig', 'ResumeError', 'Trainer', 'format_line', 'move_summary']
