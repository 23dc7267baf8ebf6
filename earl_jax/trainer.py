"""The EARL loop: plan, reshard, roll out, prepare experience, dispatch, advantages, train.

One step, every stage on its own mesh over the same devices (colocated):

  1. plan       the Parallelism Selector picks each stage's ParallelConfig and context bucket
                from the previous step's statistics (rollout) or this step's (experience, train);
  2. reshard    parameters move device to device onto the rollout and experience meshes, and the
                train state (parameters + optimizer moments) when the train mesh changes;
  3. rollout    multi-turn episodes with a KV cache that persists across turns (host env);
  4. experience old and reference log-probs on the experience layout;
  5. dispatch   the batch moves to the train layout, rows balanced by real tokens, with the
                layout-aware shard_map collectives (no controller);
  6. advantages group statistics with collectives on the train layout;
  7. train      one PPO-clip update (micro-batched), jitted per (config, bucket), state donated;
  8. metrics    one line per step, JSONL + TensorBoard; Orbax checkpoints every N steps.

  trainer = Trainer(ExperimentConfig(...), workdir='runs/default')
  summary = trainer.run()
"""

import dataclasses
import hashlib
import json
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
from earl_jax.config import BucketConfig, DType, ModelConfig, ParallelConfig, _check_positive
from earl_jax.envs import base as envs
from earl_jax.models import hf_import, qwen2, tokenizer
from earl_jax.rl import advantages as advantages_lib
from earl_jax.rl import losses, train_step
from earl_jax.rl.trajectory import Batch
from earl_jax.rollout import engine
from earl_jax.selector import executables as executables_lib
from earl_jax.selector import reshard as reshard_lib
from earl_jax.selector import selector as selector_lib
from earl_jax.selector import stages as stages_lib
from earl_jax.sharding import mesh as mesh_lib

STAGES = ('rollout', 'experience', 'train')


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
  """Everything one training run needs; presets live in experiments/configs/train.py.

  Attributes:
    name: a label for logs.
    model: a ModelConfig preset (ignored when model_dir is set).
    model_dir: a HF Qwen2 checkpoint directory (weights + tokenizer), e.g. for GPU runs.
    param_dtype: parameter and compute dtype.
    tokenizer: 'game' (the built-in character tokenizer) or a directory with tokenizer.json.
    env: the training environment.
    eval_env: the evaluation environment (fixed seeds, greedy decoding).
    rollout: episodes per step, group size, sampling.
    advantages, loss, optim: the RL algorithm.
    buckets: the context-length bucket table (cache capacities and train lengths).
    selector: the Parallelism Selector (candidates, statistic, hysteresis, memory budget).
    dispatch: the Data Dispatcher (strategy).
    steps: training steps.
    micro_batches: gradient-accumulation slices of each update.
    update_epochs: optimizer updates per rollout batch (PPO's sample reuse). Every one uses the
      same old log-probs and advantages, so from the second on the ratio departs from 1 and
      `loss.clip_eps` bounds how far the policy moves; the logged loss metrics are the last
      update's.
    balance: permute rows inside the experience -> train dispatch so that every train
      data-parallel rank gets the same number of real (unpadded) tokens. Off by default: the
      train program runs on padded buckets, so balanced real tokens do not change its time yet.
    eval_every / eval_episodes / eval_seed: the fixed-seed evaluation.
    checkpoint_every / keep_checkpoints: Orbax checkpoints (0 disables).
    seed: seeds the environment and the sampler of every step.
    init_seed: seeds the random initialisation (ignored with model_dir).
  """

  name: str = 'default'
  model: str = 'tiny-game'
  model_dir: str | None = None
  param_dtype: DType = 'float32'
  tokenizer: str = 'game'
  env: envs.EnvConfig = dataclasses.field(default_factory=envs.EnvConfig)
  eval_env: envs.EnvConfig = dataclasses.field(default_factory=envs.EnvConfig)
  rollout: engine.RolloutConfig = dataclasses.field(default_factory=engine.RolloutConfig)
  advantages: advantages_lib.AdvantageConfig = dataclasses.field(
    default_factory=advantages_lib.AdvantageConfig
  )
  loss: losses.LossConfig = dataclasses.field(default_factory=losses.LossConfig)
  optim: train_step.OptimConfig = dataclasses.field(default_factory=train_step.OptimConfig)
  buckets: BucketConfig = dataclasses.field(default_factory=BucketConfig)
  selector: selector_lib.SelectorConfig = dataclasses.field(
    default_factory=selector_lib.SelectorConfig
  )
  dispatch: dispatch_lib.DispatchConfig = dataclasses.field(
    default_factory=dispatch_lib.DispatchConfig
  )
  steps: int = 20
  micro_batches: int = 1
  update_epochs: int = 1
  balance: bool = False
  eval_every: int = 10
  eval_episodes: int = 128
  eval_seed: int = 1_000_000
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  seed: int = 0
  init_seed: int = 0

  def __post_init__(self):
    _check_positive(self, 'steps', 'micro_batches', 'update_epochs', 'eval_episodes')
    for field in ('eval_every', 'checkpoint_every', 'seed', 'init_seed', 'eval_seed'):
      if getattr(self, field) < 0:
        raise ValueError(f'ExperimentConfig.{field} must be >= 0, got {getattr(self, field)}.')
    if self.model_dir is None:
      ModelConfig.preset(self.model)  # raises for an unknown preset
    if self.rollout.num_episodes % self.micro_batches:
      raise ValueError(
        f'micro_batches={self.micro_batches} must divide rollout.num_episodes='
        f'{self.rollout.num_episodes}.'
      )
    first_turn = self.rollout.prompt_buckets[0] + self.rollout.sampling.max_new_tokens
    if first_turn > self.buckets.max_length:
      raise ValueError(
        f'The per-turn token limit rollout.sampling.max_new_tokens='
        f'{self.rollout.sampling.max_new_tokens} plus the smallest prompt bucket '
        f'{self.rollout.prompt_buckets[0]} does not fit the largest context bucket '
        f'{self.buckets.max_length}; raise buckets.lengths or lower the limit.'
      )

  def to_json(self) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(self), default=str))

  def fingerprint(self) -> str:
    """Identifies the run for --resume: everything but the step count and evaluation cadence."""
    d = self.to_json()
    for key in ('steps', 'eval_every', 'checkpoint_every', 'keep_checkpoints', 'name'):
      d.pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class ResumeError(ValueError):
  pass


@dataclasses.dataclass
class StageTimer:
  times: dict[str, float] = dataclasses.field(default_factory=dict)

  def __call__(self, name: str, fn: Callable, *args, **kwargs):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
    return out


class Trainer:
  """Runs `ExperimentConfig` in `workdir` (metrics, checkpoints, plots)."""

  def __init__(
    self,
    config: ExperimentConfig,
    *,
    workdir: str,
    resume: bool = False,
    log_fn: Callable[[str], None] | None = None,
  ):
    self.config = config
    self.workdir = workdir
    self.log = log_fn or (lambda line: logging.info('%s', line))
    self.devices = mesh_lib.canonical_devices()
    self._meshes: dict[ParallelConfig, jax.sharding.Mesh] = {}
    self.is_main = jax.process_index() == 0

    # Model and tokenizer.
    if config.model_dir:
      self.model_cfg = hf_import.load_config(
        config.model_dir, param_dtype=config.param_dtype, dtype=config.param_dtype
      )
      self.tokenizer = tokenizer.load_tokenizer(config.model_dir)
    else:
      self.model_cfg = ModelConfig.preset(config.model).replace(
        param_dtype=config.param_dtype, dtype=config.param_dtype
      )
      self.tokenizer = tokenizer.load_tokenizer(config.tokenizer)
    B = config.rollout.num_episodes
    self.num_groups = B // config.rollout.group_size

    # The selector and its executable cache (one AOT-compiled program per stage, layout, bucket).
    spec = stages_lib.StageSpec(
      decode_tokens=config.selector.decode_tokens,
      micro_batches=config.micro_batches,
      optim=config.optim,
      loss=config.loss,
      temperature=config.rollout.sampling.temperature,
      token_ids=engine.reply_token_ids(
        self.tokenizer, config.rollout.reply_tokens, self.model_cfg.vocab_size
      ),
    )
    self.executables = executables_lib.Executables(self.model_cfg, spec=spec)
    self.selector = selector_lib.Selector(
      config.selector,
      buckets=config.buckets,
      rows=B,
      model=self.model_cfg,
      num_devices=len(self.devices),
      executables=self.executables,
      spec=spec,
    )
    self.plans: dict[str, selector_lib.Decision] = {}
    self.switches: list[dict] = []
    start = self.selector.initial_decisions()

    # Parameters and the train state (moments sharded like their parameters) on the train mesh.
    self.train_config = start['train'].config
    train_mesh = self.mesh(self.train_config)
    if config.model_dir:
      self.graphdef, params = hf_import.load_params(config.model_dir, self.model_cfg, train_mesh)
    else:
      self.graphdef, params = qwen2.init_model(self.model_cfg, train_mesh, seed=config.init_seed)
    self.optimizer = train_step.make_optimizer(config.optim)
    # The frozen reference policy lives on the experience layout (the only stage that reads it).
    self.ref_params = None
    self.ref_config = self.train_config
    if config.loss.kl_coef > 0:
      self.ref_params = jax.tree.map(jnp.copy, params)
    self.state = train_step.init_train_state(
      params, self.optimizer, entropy_coef=config.loss.entropy_coef
    )

    self.engine = engine.RolloutEngine(
      self.model_cfg, self.graphdef, self.tokenizer, config.env, config.rollout, config.buckets
    )
    eval_rollout = dataclasses.replace(
      config.rollout,
      num_episodes=config.eval_episodes,
      group_size=1,
      sampling=dataclasses.replace(config.rollout.sampling, greedy=True),
    )
    self.eval_engine = engine.RolloutEngine(
      self.model_cfg, self.graphdef, self.tokenizer, config.eval_env, eval_rollout, config.buckets
    )
    self.dispatcher = dispatch_lib.Dispatcher(config.dispatch)

    self.step = 0
    self.prev_stats: selector_lib.StepStats | None = None
    self.history: list[dict] = []
    self.writer = metrics.MetricsWriter(workdir, enabled=self.is_main)
    self.ckpt = (
      checkpointing.Checkpointer(
        os.path.join(workdir, 'checkpoints'), max_to_keep=config.keep_checkpoints
      )
      if config.checkpoint_every or resume
      else None
    )
    if resume:
      self._resume()

  # ----------------------------------------------------------------------------------------------
  # Meshes, parameters on a mesh, compiled programs.

  def mesh(self, parallel: ParallelConfig) -> jax.sharding.Mesh:
    if parallel not in self._meshes:
      self._meshes[parallel] = mesh_lib.make_mesh(parallel, self.devices)
    return self._meshes[parallel]

  def _param_shardings(self, parallel: ParallelConfig):
    return reshard_lib.param_shardings(self.model_cfg, parallel)

  def params_on(self, parallel: ParallelConfig):
    """The train parameters laid out on `parallel`'s mesh: the state's own arrays on the train
    layout, else a device-to-device copy that the caller drops as soon as its stage is done."""
    if parallel == self.train_config:
      return self.state.params
    return reshard_lib.reshard_tree(
      self.state.params, self._param_shardings(parallel), donate=False
    )

  def _ref_on(self, parallel: ParallelConfig):
    """The reference parameters, moved (donated) to `parallel` when the experience layout changes."""
    if parallel != self.ref_config:
      self.ref_params = reshard_lib.reshard_tree(self.ref_params, self._param_shardings(parallel))
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

  def _switch_train(self, decision: selector_lib.Decision, bucket: int):
    """Moves the train state (params + AdamW moments) to the new layout; returns the program."""
    self.state, program, record = executables_lib.switch(
      'train',
      self.state,
      self.executables,
      decision.config,
      bucket,
      decision.rows,
      source=self.train_config,
      step=self.step,
      budget=self.selector.budget_bytes,
      margin=self.config.selector.safety_margin,
    )
    self.train_config = decision.config
    self.switches.append(record.as_dict())
    return program, record.stall_ms

  # ----------------------------------------------------------------------------------------------
  # One step.

  def _plan(self, stage: str, stats: selector_lib.StepStats | None) -> selector_lib.Decision:
    decision = self.selector.decide(stage, stats)
    self.plans[stage] = decision
    return decision

  def train_step(self) -> dict:
    cfg = self.config
    t_step = time.perf_counter()
    timer = StageTimer()
    record: dict[str, Any] = {}

    # 1-2. Rollout plan from the previous step's statistics; parameters onto the rollout mesh.
    d_roll = self._plan('rollout', self.prev_stats)
    params_r = timer('reshard', self.params_on, d_roll.config)
    mesh_r = self.mesh(d_roll.config)

    # 3. Rollout (the cache starts at the planned bucket and grows if an episode outgrows it).
    t0 = time.perf_counter()
    traj = self.engine.run(
      params_r, mesh_r, seed=_step_seed(cfg.seed, self.step), capacity=d_roll.run_bucket
    )
    timer.times['rollout'] = time.perf_counter() - t0
    ctx = traj.context_stats()
    stats = selector_lib.StepStats(
      episode_lengths=tuple(traj.lengths.tolist()),
      turn_lengths=tuple(t for row in traj.turn_tokens for t in row),
      num_responses=traj.num_episodes,
    )

    del params_r  # the rollout copy of the weights is not needed past the rollout

    # 4. Experience: old (and reference) log-probs, on the layout planned from this step's
    # lengths. The trajectories are on the host (the environments are), so they go straight to
    # the experience layout.
    d_exp = self._plan('experience', stats)
    T = max(d_exp.run_bucket, cfg.buckets.bucket_for(int(traj.tokens.shape[1])))
    host = traj.to_batch(bucket=T, rows=cfg.rollout.num_episodes, gamma=cfg.advantages.gamma)
    exp_layout = self._layout(d_exp.config)
    batch = timer('h2d', _put, host, exp_layout)
    params_e = timer('reshard', self.params_on, d_exp.config)
    logprobs = self._executable(d_exp, T)
    old = timer('experience', logprobs, params_e, batch.tokens)
    del params_e
    ref = old
    if self.ref_params is not None:
      ref = timer('experience', logprobs, self._ref_on(d_exp.config), batch.tokens)
    batch = batch.replace(old_logprobs=old, ref_logprobs=ref)

    # 5. Train plan; switch the train state if the layout changed; dispatch the batch from the
    # experience layout to the train layout (optionally balancing real tokens across ranks).
    d_train = self._plan('train', stats)
    switch_ms = 0.0
    if d_train.config != self.train_config:
      update, switch_ms = self._switch_train(d_train, T)
      timer.times['reshard'] = timer.times.get('reshard', 0.0) + switch_ms / 1e3
    else:
      update = self._executable(d_train, T)
    for key in self.selector.lookahead(d_train)[1:]:  # the next bucket, in the background
      self.executables.precompile(*key, tree=self.state)
    train_layout = self._layout(d_train.config)
    perm = (
      dispatch_lib.balanced_permutation(host.lengths, exp_layout, train_layout, like=host)
      if cfg.balance
      else None
    )
    batch, report = timer(
      'dispatch', self.dispatcher.dispatch, batch, train_layout, src=exp_layout, perm=perm
    )

    # 6-7. Advantages with collectives, then the update, on the train mesh.
    mesh_t = self.mesh(d_train.config)
    with jax.set_mesh(mesh_t):
      batch = timer(
        'advantages', advantages_lib.advantage_fn(mesh_t, self.num_groups, cfg.advantages), batch
      )
    for _ in range(cfg.update_epochs):
      self.state, m = timer('train', update, self.state, batch)
    m, skipped = jax.device_get((m, self.state.skipped))
    self.step += 1
    self.prev_stats = stats

    elapsed = time.perf_counter() - t_step
    record.update(
      {
        'win_rate': traj.win_rate(),
        'return_mean': float(np.mean(traj.returns)),
        'invalid_rate': traj.outcome_rates().get('invalid', 0.0),
        **{f'ctx/{k}': v for k, v in ctx.items()},
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
    )
    return record

  # ----------------------------------------------------------------------------------------------
  # Evaluation, checkpoints, the loop.

  def evaluate(self) -> dict:
    d = self.plans.get('rollout') or self.selector.initial_decisions()['rollout']
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
      'step': self.step,
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
    self.ckpt.save(self.step, self.state, self._meta())

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
    abstract = stages_lib.abstract_train_state(self.model_cfg, parallel, self.config.optim)
    del self.state  # the fresh state is replaced, not moved
    self.state, meta = self.ckpt.restore(abstract)
    self.train_config = parallel
    self.step = int(meta['step'])
    self.selector.load_state_dict(meta['selector'])
    self.prev_stats = (
      None if meta['prev_stats'] is None else selector_lib.StepStats(**meta['prev_stats'])
    )
    self.history = list(meta['history'])
    # Rows logged after this checkpoint (by a run that then died) are dropped, not repeated.
    self.writer.rewrite(self.history)
    self.log(f'resumed from step {self.step} ({self.ckpt.directory})')

  def run(self, progress: bool = True) -> dict:
    """Trains to `config.steps`, evaluating and checkpointing on the way; returns a summary."""
    cfg = self.config
    from tqdm import tqdm  # only the loop needs it

    t0 = time.perf_counter()
    if self.step == 0 and cfg.eval_every:
      record = {'step': 0, **self.evaluate()}
      self.history.append(record)
      self.writer.write(0, record)
      self.log(f'step    0 | eval win {record["eval/win_rate"]:.3f}')
    bar = tqdm(
      total=cfg.steps, initial=self.step, disable=not (progress and self.is_main), leave=False
    )
    while self.step < cfg.steps:
      record = self.train_step()
      if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
        record.update(self.evaluate())
      record['step'] = self.step
      record['wall_s'] = time.perf_counter() - t0
      self.history.append(record)
      self.writer.write(self.step, record)
      line = format_line(record)
      if progress and self.is_main:
        bar.write(line)
      self.log(line)
      bar.update(1)
      if cfg.checkpoint_every and (self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps):
        self.save()
    bar.close()
    if self.ckpt is not None:
      self.ckpt.wait()
    self.writer.close()
    self.executables.wait()
    evals = [r['eval/win_rate'] for r in self.history if 'eval/win_rate' in r]
    return {
      'steps': self.step,
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
