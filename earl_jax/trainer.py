"""The EARL loop: plan, reshard, roll out, prepare experience, dispatch, advantages, train.

One step (`Trainer.step`), every stage on its own mesh over the same devices (colocated):

  1. plan       the Parallelism Selector picks each stage's ParallelConfig and context bucket
                from the previous step's statistics (rollout) or this step's (experience, train);
  2. reshard    parameters move device to device onto the rollout and experience meshes, and the
                train state (parameters + optimizer moments) when the train mesh changes;
  3. rollout    multi-turn episodes with a KV cache that persists across turns (host env), each
                turn a compiled rollout program of the shared executable cache;
  4. experience old and reference log-probs on the experience layout;
  5. dispatch   the batch moves to the train layout through the Data Dispatcher (its configured
                strategy; `balance` permutes rows by real tokens inside the same move);
  6. advantages group statistics with collectives on the train layout;
  7. train      one PPO-clip update (micro-batched), AOT-compiled per (layout, bucket), state
                donated;
  8. metrics    one line per step, JSONL + TensorBoard; Orbax checkpoints every N steps.

Construction is explicit: the model and tokenizer, the stage programs (`programs.Executables`),
the start-up profile (measured by its own call, `profiler.run`, unless one is passed in), the
selector on top of it, the parameters and the train state, the engines.

  trainer = Trainer(ExperimentConfig(...), workdir='runs/default')
  summary = trainer.run()
"""

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from earl_jax import checkpointing, metrics
from earl_jax import dispatch as dispatch_lib
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import hf_import, qwen2, tokenizer
from earl_jax.programs import Executables, StageSpec
from earl_jax.programs import executables as executables_lib
from earl_jax.programs import memory as memory_lib
from earl_jax.rl import advantages as advantages_lib
from earl_jax.rl import train_step
from earl_jax.rl.batch import Batch
from earl_jax.rollout import engine
from earl_jax.rollout.trajectories import Trajectories
from earl_jax.selector import profiler
from earl_jax.selector import selector as selector_lib
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import STAGES, Stage


class ResumeError(ValueError):
  pass


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
class _Experience:
  """What the experience stage hands on: the batch on its layout, and the host batch it came from."""

  batch: Batch
  host: Batch
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
    self.devices = mesh_lib.canonical_devices()
    self.is_main = jax.process_index() == 0
    self._meshes: dict[ParallelConfig, jax.sharding.Mesh] = {}
    self._advantage_fns: dict[ParallelConfig, Any] = {}
    self.num_groups = config.rollout.num_episodes // config.rollout.group_size

    self.model_cfg, self.tokenizer = self._load_model_config()
    self.spec = StageSpec.for_rollout(
      config.rollout,
      self.tokenizer,
      self.model_cfg.vocab_size,
      micro_batches=config.micro_batches,
      optim=config.optim,
      loss=config.loss,
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
    )
    self.plans: dict[Stage, selector_lib.Decision] = {}
    self.switches: list[dict] = []
    self._init_state()
    self.engine, self.eval_engine = self._make_engines()
    self.dispatcher = dispatch_lib.Dispatcher(config.dispatch)

    self.global_step = 0
    self.prev_stats: selector_lib.StepStats | None = None
    self.history: list[dict] = []
    self.writer = metrics.MetricsWriter(workdir, enabled=self.is_main)
    self.ckpt = None
    if config.checkpoint_every or resume:
      self.ckpt = checkpointing.Checkpointer(
        os.path.join(workdir, 'checkpoints'), max_to_keep=config.keep_checkpoints
      )
    if resume:
      self._resume()

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

  def measure_profile(self) -> profiler.Profile | None:
    """The start-up profile of `config.selector.profile.stages` (None when it names none).

    Compiles and times every candidate program of those stages at every bucket, or loads the
    cached profile when it was made for exactly this setup.
    """
    sel = self.config.selector
    if not sel.profile.stages:
      return None
    pconfig = selector_lib.profile_config(
      sel,
      buckets=self.config.buckets,
      rows=self.config.rollout.num_episodes,
      spec=self.spec,
      budget_bytes=self._budget(),
    )
    return profiler.run(
      self.model_cfg, pconfig, executables=self.executables, cache_path=sel.profile.cache
    )

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
    if parallel not in self._meshes:
      self._meshes[parallel] = mesh_lib.make_mesh(parallel, self.devices)
    return self._meshes[parallel]

  def params_on(self, parallel: ParallelConfig):
    """The train parameters laid out on `parallel`'s mesh: the state's own arrays on the train
    layout, else a device-to-device copy that the caller drops as soon as its stage is done."""
    if parallel == self.train_config:
      return self.state.params
    return self.executables.resharder(
      self.state.params, self.executables.param_shardings(parallel), donate=False
    )

  def _ref_on(self, parallel: ParallelConfig):
    """The reference parameters, moved (donated) to `parallel` when the experience layout changes."""
    if parallel != self.ref_config:
      self.ref_params = self.executables.resharder(
        self.ref_params, self.executables.param_shardings(parallel)
      )
      self.ref_config = parallel
    return self.ref_params

  def _executable(self, decision: selector_lib.Decision, bucket: int):
    """The AOT-compiled program of a stage, refused before running if it exceeds the budget."""
    return self.executables.get(
      decision.stage,
      decision.config,
      bucket,
      decision.rows,
      budget=self.selector.budget_bytes,
      margin=self.config.selector.safety_margin,
    )

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

  def _switch_train(self, decision: selector_lib.Decision, bucket: int):
    """Moves the train state (params + AdamW moments) to the new layout; returns the program."""
    self.state, program, record = executables_lib.switch(
      Stage.TRAIN,
      self.state,
      self.executables,
      decision.config,
      bucket,
      decision.rows,
      source=self.train_config,
      step=self.global_step,
      budget=self.selector.budget_bytes,
      margin=self.config.selector.safety_margin,
    )
    self.train_config = decision.config
    self.switches.append(record.as_dict())
    return program, record.stall_ms

  # ----------------------------------------------------------------------------------------------
  # One step, stage by stage.

  def _plan(self, stage: Stage, stats: selector_lib.StepStats | None) -> selector_lib.Decision:
    decision = self.selector.decide(stage, stats)
    self.plans[stage] = decision
    return decision

  def _roll_out(self, timer: StageTimer) -> tuple[Trajectories, selector_lib.StepStats]:
    """1-3. Rollout plan from the previous step's statistics; the episodes on its layout (the
    cache starts at the planned bucket and grows if an episode outgrows it)."""
    d_roll = self._plan(Stage.ROLLOUT, self.prev_stats)
    params_r = timer('reshard', self.params_on, d_roll.config)
    t0 = time.perf_counter()
    traj = self.engine.run(
      params_r,
      self.mesh(d_roll.config),
      seed=_step_seed(self.config.seed, self.global_step),
      capacity=d_roll.run_bucket,
    )
    timer.add('rollout', time.perf_counter() - t0)
    stats = selector_lib.StepStats(
      episode_lengths=tuple(traj.lengths.tolist()),
      turn_lengths=tuple(t for row in traj.turn_tokens for t in row),
      num_responses=traj.num_episodes,
    )
    return traj, stats

  def _experience(
    self, traj: Trajectories, stats: selector_lib.StepStats, timer: StageTimer
  ) -> _Experience:
    """4. Old (and reference) log-probs, on the layout planned from this step's lengths. The
    trajectories are on the host (the environments are), so they go straight to that layout."""
    cfg = self.config
    d_exp = self._plan(Stage.EXPERIENCE, stats)
    T = max(d_exp.run_bucket, cfg.buckets.bucket_for(int(traj.tokens.shape[1])))
    host = traj.to_batch(bucket=T, rows=cfg.rollout.num_episodes, gamma=cfg.advantages.gamma)
    layout = self._layout(d_exp.config)
    batch = timer('h2d', _put, host, layout)
    params_e = timer('reshard', self.params_on, d_exp.config)
    logprobs = self._executable(d_exp, T)
    old = timer('experience', logprobs, params_e, batch.tokens)
    del params_e
    ref = old
    if self.ref_params is not None:
      ref = timer('experience', logprobs, self._ref_on(d_exp.config), batch.tokens)
    batch = batch.replace(old_logprobs=old, ref_logprobs=ref)
    return _Experience(batch=batch, host=host, layout=layout, bucket=T)

  def _train_program(self, stats: selector_lib.StepStats, T: int, timer: StageTimer):
    """5a. The train plan; the train state switched if the layout changed; the next bucket's
    program precompiled in the background. Returns (decision, program, switch ms)."""
    d_train = self._plan(Stage.TRAIN, stats)
    switch_ms = 0.0
    if d_train.config != self.train_config:
      update, switch_ms = self._switch_train(d_train, T)
      timer.add('reshard', switch_ms / 1e3)
    else:
      update = self._executable(d_train, T)
    for key in self.selector.lookahead(d_train)[1:]:
      self.executables.precompile(*key, tree=self.state)
    return d_train, update, switch_ms

  def _dispatch(self, exp: _Experience, d_train: selector_lib.Decision, timer: StageTimer):
    """5b. The batch from the experience layout to the train layout (optionally balancing real
    tokens across the train ranks inside the same move)."""
    train_layout = self._layout(d_train.config)
    perm = None
    if self.config.balance:
      perm = dispatch_lib.balanced_permutation(
        exp.host.lengths, exp.layout, train_layout, like=exp.host
      )
    return timer(
      'dispatch', self.dispatcher.dispatch, exp.batch, train_layout, src=exp.layout, perm=perm
    )

  def _update(self, batch: Batch, d_train: selector_lib.Decision, update, timer: StageTimer):
    """6-7. Advantages with collectives, then the update(s), on the train mesh."""
    mesh_t = self.mesh(d_train.config)
    with jax.set_mesh(mesh_t):
      batch = timer('advantages', self._advantages(d_train.config), batch)
    for _ in range(self.config.update_epochs):
      self.state, m = timer('train', update, self.state, batch)
    return jax.device_get((m, self.state.skipped))

  def step(self) -> dict:
    """One EARL step (see the module docstring); returns its metrics record."""
    t_step = time.perf_counter()
    timer = StageTimer()
    traj, stats = self._roll_out(timer)
    exp = self._experience(traj, stats, timer)
    d_train, update, switch_ms = self._train_program(stats, exp.bucket, timer)
    batch, report = self._dispatch(exp, d_train, timer)
    m, skipped = self._update(batch, d_train, update, timer)
    self.global_step += 1
    self.prev_stats = stats
    return self._record(traj, exp.bucket, m, skipped, report, switch_ms, timer, t_step)

  def _record(self, traj, T, m, skipped, report, switch_ms, timer, t_step) -> dict:
    elapsed = time.perf_counter() - t_step
    return {
      'win_rate': traj.win_rate(),
      'return_mean': float(np.mean(traj.returns)),
      'invalid_rate': traj.outcome_rates().get('invalid', 0.0),
      **{f'ctx/{k}': v for k, v in traj.context_stats().items()},
      'bucket': T,
      'tokens': int(np.sum(traj.lengths)),
      'generated_tokens': traj.generated_tokens,
      'tokens_per_s': float(np.sum(traj.lengths)) / elapsed,
      'rollout_tokens_per_s': traj.generated_tokens / max(timer.times['rollout'], 1e-9),
      **{f'loss/{k}': float(v) for k, v in m.items()},
      'skipped_steps': int(skipped),
      'dispatch/strategy': report.strategy,
      'dispatch/bytes_moved': float(report.min_bytes or 0),
      'switch_ms': switch_ms,
      **{f'plan/{s}': f'{self.plans[s].config.name}@{self.plans[s].bucket}' for s in STAGES},
      **{f'time/{k}_s': v for k, v in timer.times.items()},
      'time/step_s': elapsed,
    }

  # ----------------------------------------------------------------------------------------------
  # Evaluation, checkpoints, the loop.

  def evaluate(self) -> dict:
    d = self.plans.get(Stage.ROLLOUT) or self.selector.initial_decisions()[Stage.ROLLOUT]
    traj = self.eval_engine.run(
      self.params_on(d.config), self.mesh(d.config), seed=self.config.eval_seed, greedy=True
    )
    rates = traj.outcome_rates()
    return {
      'eval/win_rate': traj.win_rate(),
      'eval/invalid_rate': rates.get('invalid', 0.0),
      'eval/draw_rate': rates.get('draw', 0.0),
      'eval/return_mean': float(np.mean(traj.returns)),
      'eval/episode_len_mean': float(np.mean(traj.lengths)),
    }

  def _meta(self) -> dict:
    return {
      'step': self.global_step,
      'fingerprint': self.config.fingerprint(),
      'config': self.config.to_json(),
      'selector': self.selector.state_dict(),
      'train_config': self.train_config.name,
      'prev_stats': None if self.prev_stats is None else dataclasses.asdict(self.prev_stats),
      'history': self.history,
    }

  def save(self) -> None:
    if self.ckpt is None:
      return
    self.ckpt.save(self.global_step, self.state, self._meta())

  def _resume(self) -> None:
    if self.ckpt is None or self.ckpt.latest_step() is None:
      raise ResumeError(
        f'--resume: no checkpoint in {os.path.join(self.workdir, "checkpoints")}; start without '
        '--resume (or point --workdir at the run to continue).'
      )
    meta = self.ckpt.read_meta()
    if meta.get('fingerprint') != self.config.fingerprint():
      raise ResumeError(
        f'--resume: the checkpoint in {self.workdir} (step {meta.get("step")}) was made by another '
        f'config (fingerprint {meta.get("fingerprint")} != {self.config.fingerprint()}); use the '
        'same preset and overrides, or a new --workdir.'
      )
    parallel = ParallelConfig.parse(meta['train_config'])
    abstract = self.executables.abstract_train_state(parallel)
    del self.state  # the fresh state is replaced, not moved
    self.state, meta = self.ckpt.restore(abstract)
    self.train_config = parallel
    self.global_step = int(meta['step'])
    self.selector.load_state_dict(meta['selector'])
    self.prev_stats = (
      None if meta['prev_stats'] is None else selector_lib.StepStats(**meta['prev_stats'])
    )
    self.history = list(meta['history'])
    # Rows logged after this checkpoint (by a run that then died) are dropped, not repeated.
    self.writer.rewrite(self.history)
    self.log(f'resumed from step {self.global_step} ({self.ckpt.directory})')

  def _log_step(self, record: dict, bar: Any, progress: bool) -> None:
    self.history.append(record)
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
      self.history.append(record)
      self.writer.write(0, record)
      self.log(f'step    0 | eval win {record["eval/win_rate"]:.3f}')
    bar = tqdm(
      total=cfg.steps,
      initial=self.global_step,
      disable=not (progress and self.is_main),
      leave=False,
    )
    while self.global_step < cfg.steps:
      record = self.step()
      last = self.global_step == cfg.steps
      if cfg.eval_every and (self.global_step % cfg.eval_every == 0 or last):
        record.update(self.evaluate())
      record['step'] = self.global_step
      record['wall_s'] = time.perf_counter() - t0
      self._log_step(record, bar, progress)
      if cfg.checkpoint_every and (self.global_step % cfg.checkpoint_every == 0 or last):
        self.save()
    bar.close()
    if self.ckpt is not None:
      self.ckpt.wait()
    self.writer.close()
    self.executables.wait()
    evals = [r['eval/win_rate'] for r in self.history if 'eval/win_rate' in r]
    return {
      'steps': self.global_step,
      'wall_s': time.perf_counter() - t0,
      'eval_win_rate_first': evals[0] if evals else None,
      'eval_win_rate_last': evals[-1] if evals else None,
      'skipped_steps': int(self.state.skipped),
      'decisions': self.selector.log(),
    }


def _step_seed(seed: int, step: int) -> int:
  return (seed * 1_000_003 + step) % (2**31 - 1)


def _put(host: Batch, layout: dispatch_lib.Layout) -> Batch:
  """Host batch -> device arrays on `layout` (each process puts only its own shards)."""
  shardings = layout.shardings()
  return jax.tree.map(
    lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx, x=x: x[idx]),
    host,
    shardings,
  )


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
  times = ' '.join(
    f'{k[5:-2]} {v:.2f}s' for k, v in r.items() if k.startswith('time/') and k != 'time/step_s'
  )
  parts.append(times)
  return ' | '.join(parts)


__all__ = ['ExperimentConfig', 'ResumeError', 'Trainer', 'format_line']
