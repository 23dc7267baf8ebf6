"""ExperimentConfig: validation before anything is built, JSON form, the --resume fingerprint."""

import dataclasses
import itertools
import json

import pytest

from earl_jax.config import BucketConfig
from earl_jax.envs import code_env
from earl_jax.envs.base import CodeEnvConfig, EnvConfig
from earl_jax.errors import ConfigError
from earl_jax.experiment import ExperimentConfig, config_diff
from earl_jax.rl.losses import LossConfig
from earl_jax.testing.configs import smoke_experiment


def test_fingerprint_ignores_the_schedule_but_not_the_run():
  base = smoke_experiment()
  same = dataclasses.replace(base, steps=99, eval_every=7, checkpoint_every=5, name='other')
  assert same.fingerprint() == base.fingerprint()
  assert dataclasses.replace(base, seed=1).fingerprint() != base.fingerprint()
  assert (
    dataclasses.replace(base, buckets=BucketConfig(lengths=(64, 256))).fingerprint()
    != base.fingerprint()
  )
  # The JSON form is plain data (stages and other enums as their names).
  text = json.dumps(base.to_json())
  assert '"stages": []' in text and json.loads(text)['rollout']['num_episodes'] == 8


def _replace(config, path, value):
  """`config` with the dotted field `path` set to `value`."""
  head, _, rest = path.partition('.')
  inner = _replace(getattr(config, head), rest, value) if rest else value
  return dataclasses.replace(config, **{head: inner})


@pytest.mark.parametrize(
  ('path', 'value'),
  [
    ('steps', 99),
    ('eval_every', 7),
    ('checkpoint_every', 5),
    ('keep_checkpoints', 1),
    ('max_skipped_in_a_row', 0),
    ('name', 'other'),
    ('eval_episodes', 16),
    ('eval_seed', 7),
    ('eval_sample_tasks', 8),
    ('selector.profile.cache', '/tmp/profile.json'),
  ],
)
def test_what_a_resume_may_change(path, value):
  """The schedule, the evaluation's size and seeds and the profile cache's path do not change
  the trained parameters from a checkpoint on: neither the fingerprint nor the diff sees them."""
  base = smoke_experiment()
  changed = _replace(base, path, value)
  assert changed.fingerprint() == base.fingerprint()
  assert config_diff(base.to_json(), changed.to_json()) == []


def test_what_refuses_a_resume_is_named_field_by_field():
  base = smoke_experiment()
  lr = _replace(base, 'optim.learning_rate', 0.001)
  assert lr.fingerprint() != base.fingerprint()
  assert config_diff(base.to_json(), lr.to_json()) == ['optim.learning_rate: 0.003 -> 0.001']
  # Lists whole, strings quoted, fields absent from an older config's JSON as such.
  other = _replace(
    _replace(lr, 'buckets', BucketConfig(lengths=(64, 256))), 'eval_env.parse', 'lenient'
  )
  saved = base.to_json()
  del saved['overlong_filter']
  assert config_diff(saved, other.to_json()) == [
    'buckets.lengths: [64, 128] -> [64, 256]',
    "eval_env.parse: 'strict' -> 'lenient'",
    'optim.learning_rate: 0.003 -> 0.001',
    'overlong_filter: (absent) -> False',
  ]
  assert config_diff(saved, other.to_json(), limit=2)[2:] == ['and 2 more']
  # A field added to the code since the checkpoint, at its default, keeps what the code did.
  defaults = ExperimentConfig().to_json()
  assert config_diff(saved, lr.to_json(), defaults=defaults) == [
    'optim.learning_rate: 0.003 -> 0.001'
  ]
  filtered = _replace(lr, 'overlong_filter', True).to_json()
  assert config_diff(saved, filtered, defaults=defaults)[1] == 'overlong_filter: (absent) -> True'
  # The initialisation's seed counts only where the restored run reads it: for the reference
  # policy of a KL term (made from the initial parameters), never with a model_dir.
  assert base.loss.kl_coef > 0 and base.model_dir is None
  assert config_diff(base.to_json(), _replace(base, 'init_seed', 3).to_json()) == [
    'init_seed: 0 -> 3'
  ]
  no_kl = _replace(base, 'loss.kl_coef', 0.0)
  assert _replace(no_kl, 'init_seed', 3).fingerprint() == no_kl.fingerprint()
  assert config_diff(no_kl.to_json(), _replace(no_kl, 'init_seed', 3).to_json()) == []
  # Loaded parameters (a warm start, a HF checkpoint) make it unread too.
  warm = _replace(base, 'init_from', 'runs/sft')
  assert config_diff(warm.to_json(), _replace(warm, 'init_seed', 3).to_json()) == []
  # Between a config that reads it and one that does not, only the field that differs is named.
  assert config_diff(base.to_json(), _replace(no_kl, 'init_seed', 3).to_json()) == [
    'loss.kl_coef: 0.01 -> 0.0'
  ]


@pytest.mark.parametrize(
  ('changes', 'match'),
  [
    ({'steps': 0}, 'ExperimentConfig.steps must be a positive int, got 0'),
    ({'seed': -1}, r'ExperimentConfig.seed=-1: expected an int in \[0, 2147483646\]'),
    ({'micro_batches': 3}, 'micro_batches=3 must divide rollout.num_episodes=8'),
    ({'model': 'huge'}, "Unknown model preset 'huge'"),
    ({'buckets': BucketConfig(lengths=(8,))}, 'does not fit the largest context bucket 8'),
    (
      {'overlong_buffer': 128},
      r'overlong_buffer=128: expected an int in \[0, 128\) \(tokens below the context cap',
    ),
    ({'overlong_penalty': -1.0}, 'ExperimentConfig.overlong_penalty must be >= 0, got -1.0'),
    ({'eval_samples': 1}, r'eval_samples=1: expected 0 \(off\) or an int >= 2'),
    (
      {'eval_samples': 4},
      'eval_samples=4 estimates the pass@k of code tasks; eval_env is EnvConfig',
    ),
    ({'eval_sample_tasks': 0}, 'ExperimentConfig.eval_sample_tasks must be a positive int, got 0'),
    ({'series_schedule': ((0, 2),)}, r'series_schedule=\(\(0, 2\),\): expected .*series_games=1'),
    ({'series_schedule': ((1, 1),)}, 'steps rising from 0'),
    ({'series_schedule': ((0, 1), (0, 1))}, 'steps rising from 0'),
    ({'series_schedule': ((0, 0),)}, r'\(\(step, games\), \.\.\.\) with ints'),
  ],
)
def test_bad_values_are_refused_where_they_are_written(changes, match):
  with pytest.raises(ValueError, match=match):
    smoke_experiment(**changes)


def test_the_series_schedule_sets_the_games_of_each_step():
  env = smoke_experiment().env.replace(series_games=8)
  config = smoke_experiment(env=env, series_schedule=((0, 1), (3, 4), (5, 8)))
  assert [config.games_at(s) for s in range(7)] == [1, 1, 1, 4, 4, 8, 8]
  assert smoke_experiment().games_at(5) is None
  code = CodeEnvConfig()
  with pytest.raises(ConfigError, match='schedules the games of a board game match'):
    ExperimentConfig(env=code, eval_env=code.replace(split='heldout'), series_schedule=((0, 1),))


def test_the_rules_term_is_refused_on_a_task_without_moves():
  code = CodeEnvConfig()
  with pytest.raises(
    ConfigError, match=r'legal_move_coef=1.0 labels the legal moves .* CodeEnvConfig'
  ):
    ExperimentConfig(
      env=code, eval_env=code.replace(split='heldout'), loss=LossConfig(legal_move_coef=1.0)
    )
  for env in (EnvConfig(think_depth=2), EnvConfig(parse='lenient')):
    with pytest.raises(ConfigError, match="reads each reply's first token as its move"):
      smoke_experiment(env=env, loss=LossConfig(legal_move_coef=1.0))
  with pytest.raises(ConfigError, match=r'legal_move_coef must be >= 0, got -1\.0'):
    LossConfig(legal_move_coef=-1.0)


def test_the_default_is_a_valid_config():
  assert ExperimentConfig().rollout.num_episodes == 64


@pytest.mark.parametrize(
  ('rollout', 'match'),
  [
    ({'reply_tokens': ('A', 'B')}, r"rollout.reply_tokens=\('A', 'B'\): .*character 'A'"),
    ({'reply_tokens': ('12',)}, "entry '12' encodes to 2 tokens"),
    ({'prompt_buckets': (4,)}, r'the largest, 4, is shorter than the longest turn prompt of env'),
  ],
)
def test_what_needs_the_tokenizer_is_checked_before_a_run_starts(rollout, match):
  from earl_jax.models.tokenizer import load_tokenizer

  base = smoke_experiment()
  config = smoke_experiment(rollout=dataclasses.replace(base.rollout, **rollout))
  with pytest.raises(ValueError, match=match):
    config.check_tokenizer(load_tokenizer('game'), 64)
  base.check_tokenizer(load_tokenizer('game'), 64)  # the smoke preset itself passes


def test_a_match_s_longest_turn_must_fit_the_prompt_buckets():
  """A match's later turns show a finished board and the next one: the largest prompt bucket
  must hold that too, not only the first turn, or the run would stop mid-rollout."""
  from earl_jax.models.tokenizer import load_tokenizer

  base = smoke_experiment()
  env = base.env.replace(series_games=3, show_legal=True)
  with pytest.raises(
    ConfigError,
    match=r'the largest, 32, is shorter than the longest turn prompt of env \(51 tokens',
  ):
    smoke_experiment(env=env).check_tokenizer(load_tokenizer('game'), 64)
  roomy = dataclasses.replace(base.rollout, prompt_buckets=(16, 64))
  smoke_experiment(env=env, rollout=roomy).check_tokenizer(load_tokenizer('game'), 64)


def test_no_heldout_task_reaches_a_training_rollout_under_any_split_override():
  """Every pairing of split settings the config accepts trains and evaluates disjoint
  'functions' tasks (the task ids the two environments play); the others are refused in one line
  naming both environments' settings, the issue's case (train at 0.2, evaluate at 0.4) among
  them."""
  accepted = refused = 0
  grid = itertools.product(('train', 'heldout'), (0, 1), (0.2, 0.4), repeat=2)
  for split, seed, fraction, eval_split, eval_seed, eval_fraction in grid:
    env = CodeEnvConfig(split=split, split_seed=seed, heldout_fraction=fraction)
    eval_env = env.replace(split=eval_split, split_seed=eval_seed, heldout_fraction=eval_fraction)
    error = _config_error(env=env, eval_env=eval_env, tokenizer='code')
    if error is not None:
      assert error.startswith(f'env (split={split!r}') and 'eval_env (split=' in error
      assert '\n' not in error
      refused += 1
      continue
    accepted += 1
    played = [
      {
        t.task_id
        for t in code_env.load_tasks('functions', c.split, c.split_seed, c.heldout_fraction)
      }
      for c in (env, eval_env)
    ]
    assert played[0] and played[1] and not played[0] & played[1], (env, eval_env)
  assert (accepted, refused) == (6, 58)
  code = CodeEnvConfig(heldout_fraction=0.2)
  with pytest.raises(ConfigError, match=r'heldout_fraction=0.2.*heldout_fraction=0.4.*can share'):
    ExperimentConfig(env=code, eval_env=code.replace(split='heldout', heldout_fraction=0.4))


def _config_error(**fields) -> str | None:
  """The ConfigError an ExperimentConfig of `fields` raises (None: it is accepted)."""
  try:
    ExperimentConfig(**fields)
  except ConfigError as e:
    return str(e)
  return None
