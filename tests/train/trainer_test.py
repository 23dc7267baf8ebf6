"""The EARL loop end to end: every stage runs, resume is exact, bad input is refused early."""

import dataclasses
import functools
import os
import shutil
import struct

import jax
import numpy as np
import pytest

from earl_jax.config import BucketConfig, ParallelConfig
from earl_jax.rl.losses import LossConfig
from earl_jax.run import metrics
from earl_jax.sharding.mesh import ShardingError
from earl_jax.stage import STAGES, Stage
from earl_jax.testing import fixture_path, mp_bodies, multiprocess
from earl_jax.testing.configs import smoke_experiment, staged_profile
from earl_jax.testing.typecheck import unchecked
from earl_jax.train import trainer


def test_smoke_run_uses_selector_and_dispatcher(tmp_path):
  lines = []
  t = trainer.Trainer(smoke_experiment(), workdir=str(tmp_path), log_fn=lines.append)
  summary = t.run(progress=False)
  assert summary['steps'] == 3
  rows = metrics.read_jsonl(os.path.join(tmp_path, 'metrics.jsonl'))
  assert [r['step'] for r in rows] == [0, 1, 2, 3]
  train = rows[1:]
  for r in train:
    for stage in STAGES:
      assert r[f'plan/{stage}'].split('@')[0] in ('dp8.tp1', 'dp4.tp2')
    assert r['tokens'] > 0 and r['bucket'] in (64, 128)
    assert r['time/rollout_s'] > 0 and r['time/train_s'] > 0 and r['time/experience_s'] > 0
    assert np.isfinite(r['loss/loss'])
  assert 'eval/win_rate' in rows[0] and 'eval/win_rate' in rows[2] and 'eval/win_rate' in rows[3]
  # Every decision is logged with its reason; the selector covered all three stages.
  decided = {d['stage'] for d in summary['decisions']}
  assert decided == set(STAGES) and all(d['reason'] for d in summary['decisions'])
  assert len(lines) == 4 and lines[1].startswith('step    1 | win')
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '3']
  assert os.path.exists(tmp_path / 'tb')


def test_reply_tokens_constrain_every_stage(tmp_path):
  """The experience and train forwards use the rollout's restricted policy: the recorded sampling
  log-probs match them (an unrestricted forward would be off by log P(digits), several nats)."""
  base = smoke_experiment()
  config = smoke_experiment(
    steps=2,
    eval_every=0,
    checkpoint_every=0,
    rollout=dataclasses.replace(base.rollout, reply_tokens=tuple('123456789')),
    loss=LossConfig(kl_coef=0.01, entropy_coef=0.01),
  )
  t = trainer.Trainer(config, workdir=str(tmp_path), log_fn=lambda _: None)
  t.run(progress=False)
  rows = metrics.read_jsonl(os.path.join(tmp_path, 'metrics.jsonl'))
  assert len(rows) == 2
  for r in rows:
    assert r['loss/sampler_logprob_gap'] < 1e-4
    assert 0 < r['loss/entropy'] <= np.log(9) + 1e-5


# The smoke's loss with an entropy bonus: every update has a gradient, even where every return
# of the batch is equal (and the policy gradient zero), whatever the seed's games.
_LOSS_WITH_A_GRADIENT = dataclasses.replace(smoke_experiment().loss, entropy_coef=0.01)


def test_update_epochs_reuse_each_batch(tmp_path):
  """update_epochs=3: three optimizer updates per step, the later ones off-policy (ratio != 1)."""
  config = smoke_experiment(
    steps=2, eval_every=0, checkpoint_every=0, update_epochs=3, loss=_LOSS_WITH_A_GRADIENT
  )
  t = trainer.Trainer(config, workdir=str(tmp_path), log_fn=lambda _: None)
  t.run(progress=False)
  assert int(t.state.step) == 6
  rows = metrics.read_jsonl(os.path.join(tmp_path, 'metrics.jsonl'))
  # The logged metrics are the last update's: its log-probs differ from the old ones.
  assert all(r['loss/approx_kl_old'] > 0 for r in rows)
  with pytest.raises(ValueError, match='update_epochs must be a positive int, got 0'):
    smoke_experiment(update_epochs=0)


def _tic_tac_toe_step(workdir, cap: int, **changes) -> dict:
  """The metrics row of one smoke step of Tic-Tac-Toe whose context is capped at `cap` tokens
  (the one bucket; replies are one digit), with `changes` to the config."""
  base = smoke_experiment()
  config = smoke_experiment(
    steps=1,
    eval_every=0,
    checkpoint_every=0,
    buckets=BucketConfig(lengths=(cap,)),
    rollout=dataclasses.replace(base.rollout, reply_tokens=tuple('123456789')),
    **changes,
  )
  trainer.Trainer(config, workdir=str(workdir), log_fn=lambda _: None).run(progress=False)
  (row,) = metrics.read_jsonl(os.path.join(str(workdir), 'metrics.jsonl'))
  return row


def test_overlong_filter_keeps_truncated_episodes_out_of_the_update(tmp_path):
  """A 32-token cap truncates some Tic-Tac-Toe episodes at their third turn. With the same seed
  both runs roll out the same episodes; the filtered update leaves out the truncated ones, so its
  loss terms differ (they are the same when the flag is not passed through)."""
  rows = {f: _tic_tac_toe_step(tmp_path / str(f), 32, overlong_filter=f) for f in (False, True)}
  assert 0 < rows[True]['overflow_rate'] == rows[False]['overflow_rate'] < 1
  assert rows[True]['tokens'] == rows[False]['tokens']
  for key in ('loss/entropy_proxy', 'loss/grad_norm'):
    assert rows[True][key] != pytest.approx(rows[False][key], rel=1e-3), key
  assert 'overlong/rate' not in rows[False]


def test_overlong_shaping_penalises_episodes_near_the_cap(tmp_path):
  """A 64-token cap with a 56-token buffer: every episode past 8 tokens gets a penalty that
  grows with its length (logged); the logged return stays the environment's, and the update
  differs (a penalty the same for every episode would cancel against the baseline)."""
  rows = {b: _tic_tac_toe_step(tmp_path / str(b), 64, overlong_buffer=b) for b in (0, 56)}
  assert 'overlong/rate' not in rows[0]
  assert rows[56]['overlong/rate'] == 1.0 and -1 < rows[56]['overlong/penalty_mean'] < 0
  assert rows[0]['ctx/episode_len_mean'] < rows[0]['ctx/episode_len_max']  # lengths differ
  assert rows[56]['return_mean'] == rows[0]['return_mean']
  assert rows[56]['loss/grad_norm'] != pytest.approx(rows[0]['loss/grad_norm'], rel=1e-3)


def _params(t):
  return [np.asarray(x) for x in jax.tree.leaves(t.state.params)]


def test_resume_equals_an_uninterrupted_run(tmp_path):
  config = smoke_experiment(steps=4, checkpoint_every=2, eval_every=2)
  full = trainer.Trainer(config, workdir=str(tmp_path / 'full'), log_fn=lambda _: None)
  full.run(progress=False)

  part = trainer.Trainer(
    dataclasses.replace(config, steps=3), workdir=str(tmp_path / 'part'), log_fn=lambda _: None
  )
  part.run(progress=False)
  # As if killed after logging step 3 but before its checkpoint was written.
  shutil.rmtree(tmp_path / 'part' / 'checkpoints' / '3')
  resumed = trainer.Trainer(
    config, workdir=str(tmp_path / 'part'), resume=True, log_fn=lambda _: None
  )
  assert resumed.global_step == 2
  resumed.run(progress=False)

  for a, b in zip(_params(full), _params(resumed)):
    np.testing.assert_array_equal(a, b)
  keep = ('win_rate', 'return_mean', 'loss/loss', 'eval/win_rate', 'ctx/episode_len_mean')
  rows_full = metrics.read_jsonl(str(tmp_path / 'full' / 'metrics.jsonl'))
  rows_part = metrics.read_jsonl(str(tmp_path / 'part' / 'metrics.jsonl'))
  assert [{k: r.get(k) for k in keep} for r in rows_full] == [
    {k: r.get(k) for k in keep} for r in rows_part
  ]
  # TensorBoard shows every step once: the resumed run's events purge what came after step 2.
  assert _tensorboard_steps(tmp_path / 'part' / 'tb', 'win_rate') == [1, 2, 3, 4]
  assert _tensorboard_steps(tmp_path / 'full' / 'tb', 'win_rate') == [1, 2, 3, 4]


def _tensorboard_steps(tb_dir, tag: str) -> list[int]:
  """The steps TensorBoard shows for `tag`: event files in name order, and a session START at
  step s hiding the earlier files' events from step s on (TensorBoard's purge rule)."""
  from tensorboardX.proto import event_pb2

  steps: list[int] = []
  for name in sorted(os.listdir(tb_dir)):
    data = (tb_dir / name).read_bytes()
    i = 0
    while i < len(data):  # TFRecords: length (8), its crc (4), the event, its crc (4)
      (n,) = struct.unpack('<Q', data[i : i + 8])
      event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
      i += 12 + n + 4
      if event.HasField('session_log') and event.session_log.status == 1:  # START
        steps = [s for s in steps if s < event.step]
      steps += [event.step for v in event.summary.value if v.tag == tag]
  return steps


def test_resume_errors(tmp_path):
  config = smoke_experiment(steps=2, checkpoint_every=2, eval_every=0)
  with pytest.raises(trainer.ResumeError, match='no checkpoint in'):
    trainer.Trainer(config, workdir=str(tmp_path), resume=True)
  trainer.Trainer(config, workdir=str(tmp_path), log_fn=lambda _: None).run(progress=False)
  other = dataclasses.replace(config, loss=LossConfig(kl_coef=0.5))
  with pytest.raises(trainer.ResumeError, match='was made by another config'):
    trainer.Trainer(other, workdir=str(tmp_path), resume=True)
  assert trainer.Trainer(config, workdir=str(tmp_path), resume=True).global_step == 2


def test_a_resume_decides_on_the_checkpoint_profile(tmp_path):
  """The measured profile travels in the checkpoint: a resume whose cache file is gone (another
  working directory) decides on the same measurements instead of measuring again."""
  from earl_jax.profiling.table import MeasureConfig
  from earl_jax.selector.selector import ProfileSettings

  cache = tmp_path / 'profile.json'
  base = smoke_experiment()
  # Without the prior, the lazy profile measures before the decisions that need it, so the
  # cells are measured whatever the machine's speed (with it, they are timed between steps
  # once their background compiles are done, which a slow machine may not reach in 2 steps).
  profile = ProfileSettings(
    stages=('rollout',),
    cache=str(cache),
    lazy=True,
    prior=False,
    measure=MeasureConfig(repeats=3, rounds=1),
  )
  config = smoke_experiment(
    steps=2,
    eval_every=0,
    checkpoint_every=1,
    selector=dataclasses.replace(base.selector, profile=profile),
  )
  run = str(tmp_path / 'run')
  first = trainer.Trainer(config, workdir=run, log_fn=lambda _: None)
  first.run(progress=False)
  saved = first.selector.profile(Stage.ROLLOUT).to_json()['cells']
  assert saved and all(c['times_ms'] for c in saved) and first.profile_s > 0
  cache.unlink()
  resumed = trainer.Trainer(config, workdir=run, resume=True, log_fn=lambda _: None)
  assert resumed.selector.profile(Stage.ROLLOUT).to_json()['cells'] == saved
  assert resumed.profile_s == 0


def test_a_run_stops_after_too_many_skipped_steps(tmp_path):
  """A rate that blows the parameters up to 1e37 (finite, so kept) makes every later loss
  non-finite: those steps are skipped and counted, and the run stops after two in a row."""
  base = smoke_experiment()
  config = smoke_experiment(
    steps=8,
    eval_every=0,
    checkpoint_every=0,
    max_skipped_in_a_row=2,
    optim=dataclasses.replace(base.optim, learning_rate=1e37),
    loss=_LOSS_WITH_A_GRADIENT,
  )
  t = trainer.Trainer(config, workdir=str(tmp_path), log_fn=lambda _: None)
  with pytest.raises(trainer.NonFiniteError, match=r'steps 2-3: 2 steps in a row were skipped'):
    t.run(progress=False)
  rows = metrics.read_jsonl(os.path.join(tmp_path, 'metrics.jsonl'))
  assert [r['skipped_steps'] for r in rows] == [0, 1, 2]
  assert all(np.all(np.isfinite(x)) for x in _params(t))


def test_a_used_workdir_is_refused_before_compiling(tmp_path):
  config = smoke_experiment(steps=1, eval_every=0)
  (tmp_path / 'metrics.jsonl').write_text('{"step": 1}\n')
  with pytest.raises(trainer.WorkdirError, match='holds a run'):
    trainer.Trainer(config, workdir=str(tmp_path))
  assert os.listdir(tmp_path) == ['metrics.jsonl']
  (tmp_path / 'a_file').write_text('x')
  with pytest.raises(trainer.WorkdirError, match='is a file: expected a folder'):
    trainer.Trainer(config, workdir=str(tmp_path / 'a_file' / 'run'))


def test_bad_input_is_refused_before_compiling(tmp_path):
  with unchecked(), pytest.raises(ValueError, match=r"EnvConfig.opponent='alphazero' is unknown"):
    smoke_experiment(env=dataclasses.replace(smoke_experiment().env, opponent='alphazero'))
  with pytest.raises(ValueError, match='per-turn token limit'):
    smoke_experiment(
      rollout=dataclasses.replace(
        smoke_experiment().rollout,
        sampling=dataclasses.replace(smoke_experiment().rollout.sampling, max_new_tokens=256),
      )
    )
  six = smoke_experiment(
    rollout=dataclasses.replace(smoke_experiment().rollout, num_episodes=6),
    selector=dataclasses.replace(smoke_experiment().selector, candidates=('dp8',)),
  )
  with pytest.raises(ShardingError, match='responses=6 is not divisible by the 8 batch shards'):
    trainer.Trainer(six, workdir=str(tmp_path))
  with pytest.raises(ValueError, match="Unknown model preset 'huge'"):
    smoke_experiment(model='huge')


def test_a_hf_checkpoint_trains_with_the_qwen_chat_template(tmp_path):
  """--model_dir: weights and tokenizer from a HF directory, replies parsed leniently."""
  base = smoke_experiment()
  env = dataclasses.replace(base.env, parse='lenient')
  config = smoke_experiment(
    loss=_LOSS_WITH_A_GRADIENT,
    model_dir=fixture_path('qwen2_tiny'),
    env=env,
    eval_env=env,
    rollout=dataclasses.replace(
      base.rollout,
      sampling=dataclasses.replace(base.rollout.sampling, max_new_tokens=4),
      prompt_buckets=(64, 128),
    ),
    buckets=BucketConfig(lengths=(128, 256, 512)),
    steps=1,
    eval_every=0,
    checkpoint_every=0,
  )
  t = trainer.Trainer(config, workdir=str(tmp_path), log_fn=lambda _: None)
  assert t.model_cfg.vocab_size == 512 and t.tokenizer.eot_id == 499
  before = [np.asarray(x) for x in jax.tree.leaves(t.state.params)]
  t.run(progress=False)
  row = metrics.read_jsonl(os.path.join(tmp_path, 'metrics.jsonl'))[-1]
  assert row['ctx/turn_len_mean'] > 20  # the chat template's turn prompt
  assert np.isfinite(row['loss/loss'])
  after = [np.asarray(x) for x in jax.tree.leaves(t.state.params)]
  assert any(not np.array_equal(a, b) for a, b in zip(before, after))


# Stages on three layouts: the rollout's rows reach the experience layout in place, and the
# experience -> train move sends rows across devices (and across processes on 2 x 4).
WINNERS = {'rollout': 'dp4.tp2', 'experience': 'dp8', 'train': 'dp2.tp4'}
EXACT = ('win_rate', 'return_mean', 'invalid_rate', 'tokens', 'generated_tokens', 'bucket')


def _compare(rows, ref):
  assert [r['step'] for r in rows] == [r['step'] for r in ref]
  for a, b in zip(rows, ref):
    for k in b:
      if k in EXACT or k.startswith(('ctx/', 'eval/', 'plan/')) or k.endswith('/bytes'):
        assert a[k] == b[k], (a['step'], k, a[k], b[k])
      elif k.startswith('loss/'):
        assert abs(a[k] - b[k]) <= 1e-5, (a['step'], k, a[k], b[k])


def _one_and_two_processes(tmp_path, **kwargs) -> tuple[dict, list[dict]]:
  """`mp_bodies.trainer_run` on this process's 8 devices, then on 2 processes x 4 devices."""
  ref = mp_bodies.trainer_run(str(tmp_path / 'one'), **kwargs)
  two = multiprocess.run(
    'earl_jax.testing.mp_bodies:trainer_run',
    num_processes=2,
    devices_per_process=4,
    kwargs={'workdir': str(tmp_path / 'two'), **kwargs},
  )
  return ref, two


@pytest.mark.multiprocess
def test_two_processes_equal_one_and_resume_there(tmp_path):
  """2 processes x 4 devices: 3 steps (a checkpoint), then --resume for 1 more, equal the same
  seed's run on this process's 8 devices; the experience -> train move sends real bytes."""
  ref = mp_bodies.trainer_run(str(tmp_path / 'one'), steps=4, resume=False, winners=WINNERS)
  kwargs = {'workdir': str(tmp_path / 'two'), 'steps': 3, 'resume': False, 'winners': WINNERS}
  first = multiprocess.run(
    'earl_jax.testing.mp_bodies:trainer_run', num_processes=2, devices_per_process=4, kwargs=kwargs
  )
  assert [r['steps'] for r in first] == [3, 3] and first[1]['rows'] is None  # process 0 writes
  assert sorted(os.listdir(tmp_path / 'two' / 'checkpoints')) == ['2', '3']
  again = multiprocess.run(
    'earl_jax.testing.mp_bodies:trainer_run',
    num_processes=2,
    devices_per_process=4,
    kwargs={**kwargs, 'steps': 4, 'resume': True},
  )
  rows = again[0]['rows']
  _compare(rows, ref['rows'])
  for r in rows[1:]:
    assert (r['plan/rollout'].split('@')[0], r['plan/experience'].split('@')[0]) == (
      'dp4.tp2',
      'dp8.tp1',
    )
    assert r['plan/train'].startswith('dp2.tp4')
    assert r['dispatch/experience_train/strategy'] == 'layout_aware'
    assert r['dispatch/experience_train/bytes'] > 0
    assert r['dispatch/experience_train/wire_bytes'] >= r['dispatch/experience_train/bytes']
    assert r['dispatch/kernels'] >= 1
  moves = first[0]['moves']['experience_train']
  assert moves['layouts_differ'] == 3 and moves['bytes_moved_steps'] == 3 and moves['bytes'] > 0
  assert moves['wire_bytes'] >= moves['bytes']  # the rounds' padding on top of the minimum


@pytest.mark.multiprocess
def test_dynamic_sampling_rloo_and_gspo_on_two_processes_equal_one(tmp_path):
  """Groups of 2 with dynamic sampling (up to 2 more rounds a step), RLOO's advantages and GSPO's
  per-episode ratio on packed rows, on 2 processes x 4 devices, equal the same seed's run on 8
  devices: every process replaces the same flat groups from the same rounds, and receives the
  episodes of a group another process played. The rounds ran, and the trained batch holds no
  more flat groups than the first round had. (GRPO's statistics are the same collective per
  group; the token ratio is the smoke's own, in the test above.)"""
  kwargs = {
    'steps': 2,
    'resume': False,
    'winners': WINNERS,
    'dynamic_sampling_rounds': 2,
    'ratio': 'sequence',
    'estimator': 'rloo',
  }
  ref, two = _one_and_two_processes(tmp_path, **kwargs)
  rows = two[0]['rows']
  _compare(rows, ref['rows'])
  steps = rows[1:]
  local = ('sampling/extra_rollout_s', 'sampling/moved_episodes')
  for r, b in zip(steps, ref['rows'][1:]):
    assert {k: v for k, v in r.items() if k.startswith('sampling/') and k not in local} == {
      k: v for k, v in b.items() if k.startswith('sampling/') and k not in local
    }
    assert b['sampling/moved_episodes'] == 0  # one process holds every row
    assert r['groups/count'] == 4 and r['groups/flat_rate'] * 4 == r['sampling/flat_left']
    assert r['groups/flat_rate'] <= r['sampling/sampled_flat_rate']
  assert any(r['sampling/rounds'] > 1 and r['sampling/dropped_groups'] > 0 for r in steps)
  # A flat group's rows on one process took a group the other played: its episodes moved.
  assert any(r['sampling/moved_episodes'] > 0 for r in steps)
  assert all(r['time/resample_s'] > 0 for r in steps if r['sampling/rounds'] > 1)


def test_stages_on_different_layouts_train_like_one_layout(tmp_path):
  """Experience and train on other layouts than the rollout's give the same run as every stage
  on the rollout's layout: the dispatcher moves the batch, and nothing else changes."""
  one = mp_bodies.trainer_run(
    str(tmp_path / 'one'), steps=3, resume=False, winners=dict.fromkeys(WINNERS, 'dp4.tp2')
  )
  staged = mp_bodies.trainer_run(str(tmp_path / 'staged'), steps=3, resume=False, winners=WINNERS)
  assert all(r['dispatch/experience_train/bytes'] > 0 for r in staged['rows'][1:])
  # The train blocks (dp2.tp4) are 4x the experience blocks (dp8): only the last step's train
  # batch, released after its update, can land the move's outputs (recycling, on CPU).
  recycled = [r['dispatch/experience_train/recycled_bytes'] for r in staged['rows'][1:]]
  assert recycled[0] == 0 and all(b > 0 for b in recycled[1:]), recycled
  ref = [
    {k: v for k, v in r.items() if not k.startswith(('plan/', 'dispatch/'))} for r in one['rows']
  ]
  _compare(staged['rows'], ref)


CP_CANDIDATES = ('dp8', 'dp4.tp2', 'dp2.tp4', 'dp2.cp4', 'dp1.tp2.cp4')
CP_WINNERS = {'rollout': 'dp2.cp4', 'experience': 'dp1.tp2.cp4', 'train': 'dp2.cp4'}


def test_context_parallel_stages_train_like_one_layout(tmp_path):
  """Every stage on a context-parallel layout (each row's tokens over a ring of 4 devices): the
  rollout decodes on dp2.cp4 with its KV cache split along the slots, the experience forward
  (ring attention) runs on dp1.tp2.cp4 and the update on dp2.cp4. The run equals every stage
  on dp4.tp2: the dispatcher lays the rows' tokens onto each ring, and nothing else changes."""
  run = functools.partial(mp_bodies.trainer_run, steps=3, resume=False, candidates=CP_CANDIDATES)
  one = run(str(tmp_path / 'one'), winners=dict.fromkeys(CP_WINNERS, 'dp4.tp2'))
  cp = run(str(tmp_path / 'cp'), winners=CP_WINNERS)
  for r in cp['rows'][1:]:
    assert r['plan/rollout'].startswith('dp2.tp1.cp4@')
    assert r['plan/experience'].startswith('dp1.tp2.cp4@')
    assert r['plan/train'].startswith('dp2.tp1.cp4@')
    assert r['dispatch/rollout_experience/bytes'] > 0
    assert r['dispatch/experience_train/bytes'] > 0
  ref = [
    {k: v for k, v in r.items() if not k.startswith(('plan/', 'dispatch/'))} for r in one['rows']
  ]
  _compare(cp['rows'], ref)


@pytest.mark.multiprocess
def test_context_parallel_stages_on_two_processes_equal_one(tmp_path):
  """2 processes x 4 devices with every stage on a context-parallel layout equal the same seed's
  run on 8 devices: the dp2.cp4 rings of the rollout and the update lie within a process, the
  experience's dp1.tp2.cp4 rings (devices 0, 2, 4, 6 and 1, 3, 5, 7) span both, so K/V shards
  cross processes."""
  kwargs = {'steps': 2, 'resume': False, 'winners': CP_WINNERS, 'candidates': CP_CANDIDATES}
  ref, two = _one_and_two_processes(tmp_path, **kwargs)
  _compare(two[0]['rows'], ref['rows'])
  assert all(r['plan/experience'].startswith('dp1.tp2.cp4@') for r in two[0]['rows'][1:])


def test_a_program_refused_at_compile_time_falls_back_to_the_next_layout(tmp_path):
  """The selector believes dp8 fits the train stage, XLA's memory analysis says it does not:
  the trainer marks it, takes the next candidate, and the run goes on."""
  base = smoke_experiment(steps=2, eval_every=0, checkpoint_every=0)
  probe = trainer.Trainer(base, workdir=str(tmp_path / 'probe'), log_fn=lambda _: None)
  peak = {
    c: probe.executables.get(
      probe.executables.key('train', ParallelConfig.parse(c), 64, 8)
    ).memory.peak
    for c in ('dp8', 'dp4.tp2')
  }
  assert peak['dp4.tp2'] < peak['dp8']
  budget_mib = (peak['dp4.tp2'] + peak['dp8']) / 2 / (1 << 20)
  config = dataclasses.replace(
    base,
    selector=dataclasses.replace(base.selector, budget_mib=budget_mib, safety_margin=0.0),
  )
  # The profile puts train on dp8 and claims it needs nothing (as a wrong estimate would).
  profile = staged_profile(config, {'train': 'dp8'}, needs={'train': {'dp8': 1, 'dp4.tp2': 1}})
  lines = []
  t = trainer.Trainer(config, workdir=str(tmp_path / 'run'), log_fn=lines.append, profile=profile)
  summary = t.run(progress=False)
  rows = metrics.read_jsonl(os.path.join(tmp_path, 'run', 'metrics.jsonl'))
  assert summary['steps'] == 2 and all(r['plan/train'].startswith('dp4.tp2') for r in rows)
  refused = [d for d in summary['decisions'] if 'REFUSED' in d['reason']]
  assert refused and all(d['stage'] == 'train' and d['config'] == 'dp8.tp1' for d in refused)
  assert 'needs' in refused[0]['reason'] and any('refused at compile time' in x for x in lines)


def test_the_long_context_preset_takes_context_parallelism_exactly_where_nothing_else_fits(
  tmp_path,
):
  """`long_context` at reduced size (buckets 1K and 2K, a 10 MiB per-device budget): a match of
  one game, then of three. At 2K no train layout without context parallelism fits, and the run
  trains there on one that splits each row's tokens; the same run without context-parallel
  candidates is refused at that bucket in one line."""
  from earl_jax.memory_budget import InfeasibleError
  from experiments.configs import train as presets

  base = presets.long_context()
  config = dataclasses.replace(
    base,
    buckets=BucketConfig(lengths=(1024, 2048)),
    series_schedule=((0, 1), (1, 3)),
    steps=2,
    eval_every=0,
    checkpoint_every=0,
    selector=dataclasses.replace(base.selector, budget_mib=10.0),
  )
  summary = trainer.Trainer(config, workdir=str(tmp_path / 'cp'), log_fn=lambda _: None).run(
    progress=False
  )
  rows = metrics.read_jsonl(os.path.join(tmp_path, 'cp', 'metrics.jsonl'))
  assert [r['env/games_mean'] for r in rows] == [1.0, 3.0]
  assert [r['plan/train'].split('@')[1] for r in rows] == ['1024', '2048']
  for d in summary['decisions']:
    chosen_cp = ParallelConfig.parse(d['config']).cp > 1
    others_fit = any(
      o['feasible'] and ParallelConfig.parse(o['config']).cp == 1 for o in d['options']
    )
    assert chosen_cp == (not others_fit), d['reason']
  trained_on = [ParallelConfig.parse(r['plan/train'].split('@')[0]) for r in rows]
  assert [p.cp > 1 for p in trained_on] == [False, True]
  no_cp = dataclasses.replace(config, selector=dataclasses.replace(config.selector, with_cp=False))
  t = trainer.Trainer(no_cp, workdir=str(tmp_path / 'no_cp'), log_fn=lambda _: None)
  with pytest.raises(InfeasibleError, match=r'No train layout fits .* at bucket 2048 .*with_cp'):
    t.run(progress=False)
  assert len(metrics.read_jsonl(os.path.join(tmp_path, 'no_cp', 'metrics.jsonl'))) == 1


def test_the_long_preset_credits_an_invalid_move_to_that_move_alone(tmp_path, monkeypatch):
  """The `long` preset at reduced size (16 episodes, 2 steps, no profile): every reply a column
  digit, and the batch the experience and train stages get holds own-turn returns, each turn's
  move reward (an invalid move's penalty) for its turn alone (`move_credit='own_turn'`)."""
  from earl_jax.models.tokenizer import GameTokenizer
  from earl_jax.rollout.trajectories import Trajectories
  from experiments.configs import train as presets

  base = presets.long()
  assert (base.advantages.credit, base.advantages.move_credit) == ('turn', 'own_turn')
  config = dataclasses.replace(
    base,
    rollout=dataclasses.replace(base.rollout, num_episodes=16),
    selector=dataclasses.replace(
      base.selector,
      candidates=('dp8',),
      profile=dataclasses.replace(base.selector.profile, stages=(), cache=None),
    ),
    steps=2,
    eval_every=0,
    checkpoint_every=0,
  )
  seen = []
  real = Trajectories.to_device_batch

  def spy(self, **kwargs):
    batch = real(self, **kwargs)
    gamma, credit = kwargs['gamma'], kwargs['move_credit']
    seen.append((self, np.asarray(batch.returns), self.token_returns(gamma, move_credit=credit)))
    return batch

  monkeypatch.setattr(Trajectories, 'to_device_batch', spy)
  trainer.Trainer(config, workdir=str(tmp_path / 'run'), log_fn=lambda _: None).run(progress=False)
  assert len(seen) == 2
  for traj, returns, own in seen:
    replies = GameTokenizer().decode(traj.tokens[traj.loss_mask].tolist())
    assert set(replies) <= set('1234567') and len(replies) >= traj.num_episodes
    B, T = own.shape
    np.testing.assert_allclose(returns[:B, :T], own, rtol=1e-6)
    for i in range(B):  # the last turn of an invalid game: its penalty, nothing discounted in
      if traj.outcomes[i] == 'invalid':
        last = np.flatnonzero(traj.loss_mask[i])[-1]
        assert own[i, last] == pytest.approx(config.env.invalid_penalty)
  assert any('invalid' in traj.outcomes for traj, _, _ in seen)  # a full column was played
