"""The supervised warm start of code RL: next-token training on the tasks' reference solutions
(the examples and batches of `sft.examples`), on the run layer the RL job runs on.

  config = SFTConfig(steps=300)
  run = SFTRun(config, workdir='runs/sft')    # checks everything before anything compiles
  summary = run.run()                         # Orbax checkpoints in runs/sft/checkpoints
  # then RL from it: ExperimentConfig(..., init_from='runs/sft/checkpoints')

The layout is the selector's decision for the train stage (its analytic model, as the RL job's
first train decision without a profile) from the training examples' lengths, on a mesh of
`sharding.mesh`; it holds for the whole run. Each bucket's train and held-out programs
(`sft.steps`) are compiled ahead of time on first use, with explicit shardings and the train
state donated, through the executable cache of the RL job's stage programs
(`programs.Executables`, objective 'sft').
Checkpoints hold the RL job's `TrainState` (AdamW moments of `optim`), with the model's shape in
their meta, so that `placement.load_warm_start` can check and restore them onto any layout.

Dimension letters as in `earl_jax.config`.
"""

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from absl import logging

from earl_jax import buckets as buckets_lib
from earl_jax.config import (
  BucketConfig,
  DType,
  ModelConfig,
  check_positive,
  check_seed,
  check_steps,
)
from earl_jax.envs import base as envs
from earl_jax.errors import ConfigError
from earl_jax.experiment import config_diff
from earl_jax.models import hf_import, qwen2
from earl_jax.models import tokenizer as tokenizer_lib
from earl_jax.programs import Executable, Executables, StageSpec
from earl_jax.rl import train_step
from earl_jax.run import loop, metrics
from earl_jax.run.rundir import RunDir
from earl_jax.selector import selector as selector_lib
from earl_jax.selector.selector import ProfileSettings, SelectorConfig
from earl_jax.sft.examples import (
  Examples,
  batch_indices,
  build_examples,
  example_buckets,
  pad_batch,
  put_batch,
)
from earl_jax.sft.steps import SFTBatch
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage

# The tasks whose episodes `CodeEnv` plays (and whose tasks have reference completions).
SFT_TASKS = ('functions', 'humaneval')
# What a resume may change: how long, how often it evaluates, logs and saves, when it gives up,
# and its name.
_CADENCE = ('name', 'steps', 'log_every', 'eval_every', 'pass_episodes', 'checkpoint_every')
_CADENCE += ('keep_checkpoints', 'max_skipped_in_a_row')


# -- config ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """One supervised warm start; presets live in experiments/configs/sft.py.

  Attributes:
    name: a label, and the folder of the default workdir (runs/<name>).
    model: a ModelConfig preset (ignored when model_dir is set); the RL run that starts from the
      warm start must use the same.
    model_dir: a HF Qwen2 checkpoint directory (weights + tokenizer) to fine-tune instead.
    param_dtype: parameter and compute dtype.
    tokenizer: 'code' (the character tokenizer of the code tasks) or a directory with
      tokenizer.json (ignored when model_dir is set: the model's own).
    env: the training tasks: a 'functions' or 'humaneval' CodeEnvConfig (its split).
    repair_examples: repair examples per 'functions' task (`repair_turns`; 0: none): its first
      turn answered by a near miss (`near_misses`: another task's reference, then the reference
      with one constant changed), the feedback the environment shows for it (`env`'s feedback
      settings), and the reference; the loss is on the last reply alone. The RL job's repair
      turns then start in distribution; several near misses of one task also teach the first
      turn which constant goes where (docs/results/main-job.md, "Four near misses per
      warm-start task").
    eval_env: the held-out tasks (the 'heldout' split by default): the held-out loss, and the
      greedy first-turn pass rate with `pass_episodes`.
    buckets: the sequence-length buckets a batch is padded to (the largest holds every example);
      a train batch holds the examples of one bucket.
    batch_size: B, rows per step (a multiple of the chosen layout's batch shards); a batch holds
      up to B examples, the rest padding rows.
    optim: AdamW, its schedule and clipping (the RL job's `OptimConfig`).
    selector: the selector that decides the train layout (analytic only: no profile stages).
    steps: optimizer steps.
    log_every: print a line every this many steps (0: never).
    eval_every: held-out loss every this many steps, and at the start and the end (0: never).
    pass_episodes: greedy episodes of `eval_env` played at each evaluation through the RL
      rollout engine and the sandbox, for the pass rate (0: none).
    max_new_tokens: the reply limit of those episodes.
    checkpoint_every: save an Orbax checkpoint every this many steps and at the end (0: never).
    keep_checkpoints: the newest checkpoints kept.
    max_skipped_in_a_row: the run stops with an error after this many consecutive steps were
      skipped for a non-finite loss, gradient or update (0: never).
    seed: seeds the order of the examples (and of the pass-rate episodes).
    init_seed: seeds the random initialisation (ignored with model_dir).
  """

  name: str = 'sft'
  model: str = 'tiny'
  model_dir: str | None = None
  param_dtype: DType = 'float32'
  tokenizer: str = 'code'
  env: envs.CodeEnvConfig = dataclasses.field(default_factory=envs.CodeEnvConfig)
  repair_examples: int = 0
  eval_env: envs.CodeEnvConfig = dataclasses.field(
    default_factory=lambda: envs.CodeEnvConfig(split='heldout')
  )
  buckets: BucketConfig = dataclasses.field(
    default_factory=lambda: BucketConfig(lengths=(128, 192, 256))
  )
  batch_size: int = 32
  optim: train_step.OptimConfig = dataclasses.field(default_factory=train_step.OptimConfig)
  selector: SelectorConfig = dataclasses.field(
    default_factory=lambda: SelectorConfig(profile=ProfileSettings(stages=()))
  )
  steps: int = 200
  log_every: int = 10
  eval_every: int = 50
  pass_episodes: int = 0
  max_new_tokens: int = 64
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  max_skipped_in_a_row: int = 10
  seed: int = 0
  init_seed: int = 0

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name.strip() or '/' in self.name:
      raise ConfigError(f'SFTConfig.name={self.name!r}: expected a non-empty folder name.')
    check_positive(self, 'batch_size', 'keep_checkpoints', 'max_new_tokens')
    check_steps(self)
    if self.optim.kl_target:
      raise ConfigError(
        f'SFTConfig.optim.kl_target={self.optim.kl_target}: the KL-adaptive rate follows an RL '
        "update's move from its sampler, which supervised steps do not have; expected 0."
      )
    for field in (
      'log_every',
      'eval_every',
      'pass_episodes',
      'checkpoint_every',
      'max_skipped_in_a_row',
    ):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f'SFTConfig.{field} must be an int >= 0, got {value!r}.')
    check_seed(self, 'seed', 'init_seed')
    for field in ('env', 'eval_env'):
      env = getattr(self, field)
      if not isinstance(env, envs.CodeEnvConfig) or env.task not in SFT_TASKS:
        raise ConfigError(
          f'SFTConfig.{field}={env!r}: expected a CodeEnvConfig of a task in {list(SFT_TASKS)} '
          '(tasks with reference solutions).'
        )
    repair = self.repair_examples
    if (
      not isinstance(repair, int)
      or isinstance(repair, bool)
      or repair < 0
      or (repair and self.env.task != 'functions')
    ):
      raise ConfigError(
        f'SFTConfig.repair_examples={repair!r} with env.task={self.env.task!r}: expected an '
        "int >= 0, above 0 only for 'functions' (its near misses are edits of its references)."
      )
    if self.model_dir is None:
      ModelConfig.preset(self.model)  # raises for an unknown preset
    if self.selector.profile.stages:
      raise ConfigError(
        f'SFTConfig.selector.profile.stages={tuple(map(str, self.selector.profile.stages))}: '
        'expected () (the warm start decides its train layout from the analytic model).'
      )

  def to_json(self) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(self), default=str))

  def resume_diff(self, saved: dict) -> list[str]:
    """The fields of a checkpoint's config (`to_json`) whose change refuses a resume from it:
    all but the cadence (`_CADENCE`); a field added since it was saved is read at its default."""
    defaults = SFTConfig().to_json()
    return config_diff(saved, self.to_json(), defaults=defaults, ignored=_CADENCE)

  def fingerprint(self) -> str:
    """Identifies the run for --resume: everything but the cadence (`_CADENCE`)."""
    d = {k: v for k, v in self.to_json().items() if k not in _CADENCE}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def load_model(config: SFTConfig) -> tuple[ModelConfig, tokenizer_lib.Tokenizer]:
  """The model's shapes and the tokenizer: a HF directory's, or a preset and `config.tokenizer`.

  Raises:
    ConfigError: the tokenizer's ids do not fit the model's vocabulary.
  """
  dtype = config.param_dtype
  if config.model_dir:
    model = hf_import.load_config(config.model_dir, param_dtype=dtype, dtype=dtype)
    tokenizer = tokenizer_lib.load_tokenizer(config.model_dir)
  else:
    model = ModelConfig.preset(config.model).replace(param_dtype=dtype, dtype=dtype)
    tokenizer = tokenizer_lib.load_tokenizer(config.tokenizer)
  if tokenizer.vocab_size > model.vocab_size:
    raise ConfigError(
      f'SFTConfig: {tokenizer!r} has {tokenizer.vocab_size} ids, more than the '
      f'{model.vocab_size} of model {model.name!r}: expected a model whose vocabulary holds them.'
    )
  return model, tokenizer


# -- programs --------------------------------------------------------------------------------------


def decide_layout(
  config: SFTConfig, model: ModelConfig, lengths: Sequence[int]
) -> selector_lib.Decision:
  """The selector's train-stage decision for B = `batch_size` rows of examples of `lengths`."""
  selector = selector_lib.Selector(
    config.selector,
    buckets=config.buckets,
    rows=config.batch_size,
    model=model,
    spec=StageSpec(optim=config.optim),
  )
  stats = selector_lib.StepStats(episode_lengths=lengths, num_responses=config.batch_size)
  return selector.decide(Stage.TRAIN, stats)


# -- the run ---------------------------------------------------------------------------------------


class SFTRun:
  """Runs `SFTConfig` in `workdir`: metrics.jsonl (+ TensorBoard), checkpoints/, one line per
  `log_every` steps (see the module docstring), on the run layer the RL job runs on
  (`run.rundir`, `run.loop`): the workdir's lock, `move_aside`, resume, the stop on SIGTERM or
  Ctrl-C at a saved step, and the stop after `max_skipped_in_a_row` non-finite steps."""

  def __init__(
    self,
    config: SFTConfig,
    *,
    workdir: str,
    resume: bool = False,
    log_fn: Callable[[str], None] | None = None,
    move_aside: bool = False,
  ):
    """Checks the model, the examples, the layout and the workdir before anything compiles.

    Args:
      config: the run.
      workdir: where metrics and checkpoints go.
      resume: continue from the latest checkpoint in `workdir`.
      log_fn: receives every log line (default: absl logging).
      move_aside: a workdir that holds a run is renamed to `<workdir>.<time>` (once the config
        has passed its checks) and the run starts afresh.

    Raises:
      ConfigError: an example longer than the largest bucket, a layout that does not fit.
      WorkdirError: a workdir that cannot be written, is locked by a live run, or holds a run
        (without `resume` or `move_aside`).
      ResumeError: `resume` without a readable checkpoint of this config.
    """
    self.config, self.workdir = config, workdir
    self.log = log_fn or (lambda line: logging.info('%s', line))
    self.model_cfg, self.tokenizer = load_model(config)
    self.train_set = build_examples(config.env, self.tokenizer, repair=config.repair_examples)
    self.heldout_set = build_examples(config.eval_env, self.tokenizer)
    for name, examples in (('env', self.train_set), ('eval_env', self.heldout_set)):
      _check_fits(config, name, examples)
    self.train_buckets = example_buckets(self.train_set, config.buckets)
    self.is_main = jax.process_index() == 0
    self.decision = decide_layout(config, self.model_cfg, self.train_set.lengths.tolist())
    if config.pass_episodes:
      mesh_lib.check_batch_fits(self.decision.config, config.pass_episodes, what='pass_episodes')
    self.run_dir, resume_point = RunDir.open(
      workdir, config, resume=resume, log=self.log, set_aside_used=move_aside
    )
    with self.run_dir.released_on_error():  # a run that fails while being built frees it
      # The train and held-out programs, one per bucket, from the executable cache the RL job's
      # stage programs come from (objective 'sft'); the layout holds for the whole run.
      self.executables = Executables(self.model_cfg, spec=StageSpec(optim=config.optim))
      self.layout = self.decision.config
      self.mesh = self.executables.mesh(self.layout)
      self.batch_shardings = SFTBatch.shardings(self.mesh)
      self._pass_engine = None
      self.global_step = 0
      self.history: list[dict] = []
      if resume_point is None:
        self.state = self._initial_state()
        rows = None
      else:
        restored = self.run_dir.restore(
          resume_point, lambda meta: self.executables.abstract_train_state(self.layout)
        )
        self.state, self.global_step = restored.state, restored.step
        rows = restored.rows
        self.history = list(rows)
      self.writer = metrics.MetricsWriter(
        workdir, enabled=self.is_main, purge_step=self.global_step + 1 if resume else None
      )
      if rows is not None:
        self.writer.rewrite(rows)

  def _initial_state(self) -> train_step.TrainState:
    """Parameters (a HF checkpoint's, or from `init_seed`) and fresh AdamW moments."""
    if self.config.model_dir:
      _, params = hf_import.load_params(self.config.model_dir, self.model_cfg, self.mesh)
    else:
      _, params = qwen2.init_model(self.model_cfg, self.mesh, seed=self.config.init_seed)
    return train_step.init_train_state(params, train_step.make_optimizer(self.config.optim))

  def _program(self, stage: Stage, bucket: int) -> Executable:
    """The warm start's program of `stage` (train: the update; experience: the held-out loss)
    for B = `batch_size` rows of `bucket` tokens, compiled on first use."""
    key = self.executables.key(stage, self.layout, bucket, self.config.batch_size, objective='sft')
    return self.executables.get(key)

  # -- steps and evaluation ------------------------------------------------------------------------

  def step(self) -> dict:
    """One update on the next batch; its record (loss, tokens, tokens/s)."""
    cfg = self.config
    t0 = time.perf_counter()
    indices = batch_indices(self.train_buckets, self.global_step, cfg.batch_size, cfg.seed)
    host = pad_batch(self.train_set, indices, cfg.batch_size, cfg.buckets)
    batch = put_batch(host, self.batch_shardings)
    self.state, out = self._program(Stage.TRAIN, batch.bucket)(self.state, batch)
    out = {k: float(v) for k, v in jax.device_get(out).items()}
    seconds = time.perf_counter() - t0
    tokens = int(self.train_set.lengths[indices].sum())
    self.global_step += 1
    return {
      'loss': out['loss'],
      'grad_norm': out['grad_norm'],
      'skipped': int(out['finite'] == 0.0),
      'bucket': batch.bucket,
      'tokens': tokens,
      'loss_tokens': out['loss_tokens'],
      'tokens_per_s': tokens / seconds,
      'step_s': seconds,
    }

  def heldout_loss(self) -> dict:
    """The mean NLL per reply token of every held-out example (fixed order, B rows a call)."""
    rows, n = self.config.batch_size, len(self.heldout_set)
    nll = count = 0.0
    for start in range(0, n, rows):
      host = pad_batch(
        self.heldout_set, range(start, min(start + rows, n)), rows, self.config.buckets
      )
      batch = put_batch(host, self.batch_shardings)
      out = self._program(Stage.EXPERIENCE, batch.bucket)(self.state.params, batch)
      out = jax.device_get(out)
      nll, count = nll + float(out['nll_sum']), count + float(out['tokens'])
    return {'heldout/loss': nll / max(count, 1.0), 'heldout/tokens': count}

  def pass_rate(self) -> dict:
    """Greedy episodes of `eval_env` played by the RL rollout engine (the sandbox judges them):
    the share that pass every hidden test, and the mean reward."""
    from earl_jax.rollout.trajectories import EpisodeStats

    engine = self._pass_engine or self._make_pass_engine()
    self._pass_engine = engine
    traj = engine.run(self.state.params, self.mesh, seed=self.config.seed, greedy=True)
    stats = EpisodeStats.gather(traj)
    return {
      'heldout/pass_rate': float(np.mean([o == 'win' for o in stats.outcomes])),
      'heldout/reward': float(np.mean(stats.returns)),
    }

  def _make_pass_engine(self):
    from earl_jax.rollout import engine, sampler

    cfg, examples = self.config, self.heldout_set
    # A first turn's prompt: an example without its reply (the masked tokens).
    prompt = max(len(m) - int(m.sum()) for m in examples.loss_mask)
    P = buckets_lib.round_up(prompt, 32)
    rollout = engine.RolloutConfig(
      num_episodes=cfg.pass_episodes,
      sampling=sampler.SamplingConfig(greedy=True, max_new_tokens=cfg.max_new_tokens),
      prompt_buckets=(P,),
    )
    spec = StageSpec.for_rollout(rollout, self.tokenizer, self.model_cfg.vocab_size)
    programs = Executables(self.model_cfg, spec=spec)
    cache = BucketConfig(lengths=(buckets_lib.round_up(P + cfg.max_new_tokens, 64),))
    return engine.RolloutEngine(
      self.model_cfg, self.tokenizer, cfg.eval_env, rollout, cache, programs=programs
    )

  def evaluate(self) -> dict:
    out = self.heldout_loss()
    if self.config.pass_episodes:
      out.update(self.pass_rate())
    return out

  def save(self) -> None:
    """Checkpoints the train state (every process) with the model's shape in its meta (what
    `placement.load_warm_start` checks)."""
    meta = {
      'kind': 'sft',
      'model': dataclasses.asdict(self.model_cfg),
      'optim': dataclasses.asdict(self.config.optim),
      'train_config': self.decision.config.name,
    }
    self.run_dir.save(self.global_step, self.state, meta)

  # -- the run (`run.loop`) ------------------------------------------------------------------------

  def run(self, progress: bool = True) -> dict:
    """Trains to `config.steps`, evaluating, logging and checkpointing on the way (`loop.run`);
    returns a summary.

    Raises:
      preemption.Stopped: SIGTERM or SIGINT asked the run to stop; it stopped at the end of a
        step, every process at the same one, and saved it.
      NonFiniteError: too many non-finite steps in a row.
    """
    wall_s = loop.run(self, progress=progress)
    return self.summary(wall_s)

  def skipped_steps(self) -> int:
    return int(self.state.skipped)

  def keep(self, record: dict) -> str:
    """Keeps the record; its line (with the latest held-out figures)."""
    line = format_line(record, self.history)
    self.history.append(record)
    return line

  def close(self) -> None:
    """Closes the logs (the run directory waits for the checkpoint being written)."""
    self.writer.close()

  def summary(self, wall_s: float) -> dict:
    heldout = [r['heldout/loss'] for r in self.history if 'heldout/loss' in r]
    passes = [r['heldout/pass_rate'] for r in self.history if 'heldout/pass_rate' in r]
    speeds = [r['tokens_per_s'] for r in self.history if 'tokens_per_s' in r]
    saved = self.config.checkpoint_every and self.global_step > 0
    return {
      'steps': self.global_step,
      'wall_s': wall_s,
      'train_config': self.decision.config.name,
      'heldout_loss_first': heldout[0] if heldout else None,
      'heldout_loss_last': heldout[-1] if heldout else None,
      'pass_rate_first': passes[0] if passes else None,
      'pass_rate_last': passes[-1] if passes else None,
      'tokens_per_s': float(np.median(speeds)) if speeds else None,
      'skipped_steps': int(self.state.skipped),
      'compiles': self.executables.compiles,
      'checkpoints': os.path.join(self.workdir, 'checkpoints') if saved else None,
    }


def format_line(record: dict, history: Sequence[dict] = ()) -> str:
  """One step's line: train loss, the latest held-out loss (and pass rate), tokens/s, time."""
  parts = [f'step {record["step"]:4d}']
  if 'loss' in record:
    parts.append(f'loss {record["loss"]:.3f}')
  latest = next((r for r in reversed([*history, record]) if 'heldout/loss' in r), None)
  if latest is not None:
    parts.append(f'heldout {latest["heldout/loss"]:.3f}')
    if 'heldout/pass_rate' in latest:
      parts.append(f'pass {latest["heldout/pass_rate"]:.3f}')
  if 'tokens_per_s' in record:
    parts.append(f'{record["tokens_per_s"]:,.0f} tok/s')
  if 'wall_s' in record:
    parts.append(f'{record["wall_s"]:.0f} s')
  return ' | '.join(parts)


def _check_fits(config: SFTConfig, field: str, examples: Examples) -> None:
  if not len(examples):
    raise ConfigError(f'SFTConfig.{field}: no tasks: expected a split with at least one task.')
  longest = int(examples.lengths.argmax())
  if examples.lengths[longest] > config.buckets.max_length:
    raise ConfigError(
      f'SFTConfig.buckets.lengths={config.buckets.lengths}: the largest is shorter than the '
      f'example of {examples.task_ids[longest]} in {field} ({examples.lengths[longest]} tokens): '
      f'expected a largest bucket >= {int(examples.lengths.max())}.'
    )
