"""The supervised warm start: examples the environment would pass, a few steps that lower the
held-out loss, resume, and its checkpoint restored into the RL job's placement (or refused in
one line)."""

import dataclasses
import os
import re
import shutil

import jax
import numpy as np
import pytest

from earl_jax import checkpointing, sft
from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.envs import base, code_env
from earl_jax.errors import ConfigError
from earl_jax.experiment import ExperimentConfig
from earl_jax.models import tokenizer
from earl_jax.placement import StagePlacement, WarmStartError, check_warm_start
from earl_jax.programs import Executables, StageSpec
from earl_jax.rl.losses import LossConfig
from earl_jax.run import rundir
from earl_jax.sandbox import Sandbox, SandboxConfig
from earl_jax.testing import fixture_path
from earl_jax.testing.configs import smoke_experiment
from experiments.configs import sft as presets

DP4TP2 = ParallelConfig(dp=4, tp=2)


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_examples_are_the_rollout_first_turn_with_the_reply_the_env_passes():
  tok = tokenizer.load_tokenizer('code')
  env = base.CodeEnvConfig(task='functions', split='heldout')
  examples = sft.build_examples(env, tok)
  pairs = sft.first_turns(env)
  assert len(examples) == len(pairs) == 128 and examples.pad_id == tok.pad_id
  replies = []
  for i, (task, observation) in enumerate(pairs):
    ids, mask = examples.tokens[i].tolist(), examples.loss_mask[i]
    prompt = tok.turn_prompt_ids(code_env.printable(task.prompt), first=True)
    assert observation == code_env.printable(task.prompt) and ids[: len(prompt)] == prompt
    assert not mask[: len(prompt)].any() and mask[len(prompt) :].all()  # reply + eot only
    assert ids[-1] == tok.eot_id and tok.decode(ids[len(prompt) : -1]) == task.reference
    replies.append(tok.decode(ids[len(prompt) : -1]))
  # What the masked tokens spell (the eot dropped, as the engine does) passes every hidden test.
  with Sandbox(SandboxConfig(workers=2, test_timeout_s=2.0, program_timeout_s=5.0)) as pool:
    game = code_env.CodeEnv(env, tasks=[t for t, _ in pairs[:6]], sandbox=pool)
    game.reset(6, 0)
    result = game.step([replies[game.tasks.index(t)] for t in game.episode_tasks])
  assert game.outcomes == ['win'] * 6 and (result.rewards == 1.0).all()


def test_examples_through_a_chat_template():
  tok = tokenizer.load_tokenizer(fixture_path('qwen2_tiny'))
  examples = sft.build_examples(base.CodeEnvConfig(task='functions'), tok)
  (task, observation), ids = sft.first_turns(base.CodeEnvConfig())[0], examples.tokens[0]
  prompt = tok.turn_prompt_ids(observation, first=True)
  assert tok.decode(ids[: len(prompt)]).startswith('<|im_start|>system\n')
  assert (
    not examples.loss_mask[0][: len(prompt)].any() and examples.loss_mask[0][len(prompt) :].all()
  )
  assert tok.decode(ids[len(prompt) :]) == task.reference + '<|im_end|>'


def _edited_constants(reply: str, reference: str) -> int | None:
  """How many constants (digits, quoted letters) `reply` changes in `reference`; None when it
  differs elsewhere."""
  if len(reply) != len(reference):
    return None
  spots = {m.start() for m in sft._CONSTANT.finditer(reference)}
  changed = [i for i, (a, b) in enumerate(zip(reply, reference)) if a != b]
  return len(changed) if set(changed) <= spots else None


def test_near_misses_are_a_sibling_then_one_constant_changed():
  tasks = code_env.CodeEnv(base.CodeEnvConfig(split='heldout')).tasks
  for task in tasks:
    misses = sft.near_misses(task, tasks, 4)
    assert misses == sft.near_misses(task, tasks, 4)  # a hash of the task id, not a global RNG
    assert len(set(misses)) == len(misses) == 4 and task.reference not in misses
    template = task.task_id.rsplit('/', 1)[0]
    sibling = {t.reference for t in tasks if t.task_id.rsplit('/', 1)[0] == template}
    assert misses[0] in sibling or misses[0] in {t.reference for t in tasks}
    constants = len(sft._CONSTANT.findall(task.reference))
    for miss in misses[1 : 1 + 2 * constants]:  # one constant changed (each before any twice)
      assert _edited_constants(miss, task.reference) == 1, (task.task_id, miss)
  # The commonest slip first: one constant copied into the other's place.
  two = next(
    t
    for t in tasks
    if t.task_id.startswith('functions/affine/') and len(set(re.findall(r'\d', t.reference))) == 2
  )
  a, b = re.findall(r'\d', two.reference)
  swapped = {two.reference.replace(a, b, 1), two.reference[::-1].replace(b, a, 1)[::-1]}
  assert set(sft.near_misses(two, tasks, 3)[1:]) == swapped


def test_repair_examples_answer_the_feedback_of_a_near_miss_with_the_reference():
  tok = tokenizer.load_tokenizer('code')
  env = base.CodeEnvConfig(split='heldout', feedback_tests=1, feedback_chars=80)
  tasks = {t.task_id: t for t in code_env.CodeEnv(env).tasks}
  with Sandbox(SandboxConfig(workers=2, test_timeout_s=2.0, program_timeout_s=5.0)) as pool:
    examples = sft.build_examples(env, tok, repair=3, sandbox=pool)
  assert sorted(examples.task_ids[: len(tasks)]) == sorted(tasks)  # first turns, then repairs
  repairs = examples.task_ids[len(tasks) :]
  names = [re.fullmatch(r'(.*)#repair(\d)', task_id).groups() for task_id in repairs]
  # A near miss that passes both public tests has none (s.count of a letter neither shows).
  assert len(set(repairs)) == len(repairs) and 0.9 * 3 * len(tasks) <= len(repairs)
  attempts = {}
  for i, (task_id, _) in enumerate(names, len(tasks)):
    task = tasks[task_id]
    text, mask = tok.decode(examples.tokens[i].tolist()), examples.loss_mask[i]
    first, attempt, feedback, reply = re.fullmatch(
      r'<bos><obs>(.*?)<act>(.*?)<eot><obs>(.*?)<act>(.*?)<eot>', text, re.S
    ).groups()
    # The near miss: one of the task's `near_misses`, which fails a public test the feedback
    # names (one line, at most 80 characters), then the prompt again.
    assert first == task.prompt and attempt in sft.near_misses(task, list(tasks.values()), 3)
    attempts.setdefault(task_id, []).append(attempt)
    line, rest = feedback.split('\n', 1)
    assert rest == task.prompt and ' failed: ' in line and len(line) <= 80
    assert line.split(' == ')[0] in {t.call for t in task.public_tests}
    # The loss: the reference and its end-of-turn token, nothing before.
    assert reply == task.reference and tok.decode(examples.tokens[i][mask].tolist()) == (
      task.reference + '<eot>'
    )
  assert all(len(set(a)) == len(a) for a in attempts.values())  # each task's misses differ


def test_batches_are_bucketed_and_every_epoch_sees_every_example():
  tok = tokenizer.load_tokenizer('code')
  examples = sft.build_examples(base.CodeEnvConfig(split='heldout'), tok)
  table = BucketConfig(lengths=(128, 192))
  buckets = sft.example_buckets(examples, table)
  sizes = {b: int((buckets == b).sum()) for b in (128, 192)}
  assert sizes[128] and sizes[192] and sum(sizes.values()) == len(examples) == 128
  per_epoch = sum(-(-n // 6) for n in sizes.values())  # ceil(n / 6) batches of each bucket
  epoch = [sft.batch_indices(buckets, s, 6, seed=3) for s in range(per_epoch)]
  seen = np.concatenate(epoch)
  assert sorted(seen.tolist()) == list(range(len(examples)))  # one epoch, each example once
  for indices in epoch:  # each batch holds up to 6 examples of one bucket
    assert 1 <= len(indices) <= 6 and len(set(buckets[indices].tolist())) == 1
  order = [int(buckets[i[0]]) for i in epoch]
  assert order != sorted(order)  # the buckets' batches are shuffled together
  np.testing.assert_array_equal(
    sft.batch_indices(buckets, 2, 6, 3), sft.batch_indices(buckets, 2, 6, 3)
  )
  again = [sft.batch_indices(buckets, s, 6, 3) for s in range(per_epoch, 2 * per_epoch)]
  assert sorted(np.concatenate(again).tolist()) == list(range(len(examples)))
  assert not all(map(np.array_equal, again, epoch))  # the next epoch reshuffles
  other = [sft.batch_indices(buckets, s, 6, 4) for s in range(per_epoch)]
  assert not all(map(np.array_equal, other, epoch))  # another seed, other batches
  short = int(examples.lengths.argmin())
  batch = sft.pad_batch(examples, [short], 8, table)
  assert batch.tokens.shape == (8, 128) and batch.loss_mask[1:].sum() == 0
  assert (batch.tokens[0, examples.lengths[short] :] == tok.pad_id).all()
  longest = int(examples.lengths.argmax())
  assert sft.pad_batch(examples, [short, longest], 8, table).bucket == 192


def test_config_errors_are_one_line():
  for changes, fragment in (
    ({'batch_size': 0}, 'batch_size must be a positive int'),
    ({'env': base.CodeEnvConfig(task='repo_repair')}, 'tasks with reference solutions'),
    ({'model': 'huge'}, "Unknown model preset 'huge'"),
    ({'eval_every': -1}, 'eval_every must be an int >= 0'),
    (
      {'repair_examples': 2, 'env': base.CodeEnvConfig(task='humaneval')},
      "repair_examples=2 with env.task='humaneval'",
    ),
    ({'repair_examples': True}, 'repair_examples=True .*expected an int >= 0'),
  ):
    with pytest.raises(ConfigError, match=fragment) as e:
      dataclasses.replace(presets.smoke(), **changes)
    assert '\n' not in str(e.value)
  with pytest.raises(ConfigError, match=r'init_from=.*expected the path') as e:
    ExperimentConfig(init_from=' ')
  assert '\n' not in str(e.value)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """The smoke preset (4 steps), with the greedy pass rate of 8 short held-out episodes."""
  workdir = str(tmp_path_factory.mktemp('sft') / 'run')
  config = dataclasses.replace(presets.smoke(), pass_episodes=8, max_new_tokens=8)
  run = sft.SFTRun(config, workdir=workdir)
  summary = run.run(progress=False)
  return run, summary, workdir


def test_a_few_steps_lower_the_heldout_loss(trained):
  run, summary, workdir = trained
  assert summary['steps'] == 4 and summary['train_config'] == 'dp8.tp1'
  assert summary['heldout_loss_last'] < summary['heldout_loss_first'] - 0.5
  # One train and one held-out program per bucket reached, each compiled once.
  buckets = {r['bucket'] for r in run.history if 'bucket' in r}
  assert {('train', b) for b in buckets} <= set(run.programs._compiled)
  assert summary['compiles'] == len(run.programs._compiled) <= 2 * len(run.config.buckets.lengths)
  evals = [r for r in run.history if 'heldout/loss' in r]
  assert [r['step'] for r in evals] == [0, 2, 4]
  assert all(0.0 <= r['heldout/pass_rate'] <= 1.0 for r in evals)
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  assert ckpt.all_steps() == [2, 4]
  meta = ckpt.read_meta(4)
  assert meta['kind'] == 'sft' and meta['model']['hidden_size'] == 64 and meta['step'] == 4
  ckpt.close()


def test_resume_continues_where_the_run_stopped(trained, tmp_path):
  run, _, workdir = trained
  copy = str(tmp_path / 'run')
  shutil.copytree(workdir, copy)
  config = dataclasses.replace(run.config, steps=5, eval_every=0, pass_episodes=0)
  with pytest.raises(rundir.WorkdirError, match='holds a run'):
    sft.SFTRun(config, workdir=copy)
  with pytest.raises(rundir.ResumeError, match=r'another config \(seed: 0 -> 1\)'):
    sft.SFTRun(dataclasses.replace(config, seed=1), workdir=copy, resume=True)
  resumed = sft.SFTRun(config, workdir=copy, resume=True)
  assert resumed.global_step == 4
  for a, b in zip(_host(resumed.state), _host(run.state)):
    np.testing.assert_array_equal(a, b)
  resumed.run(progress=False)
  assert resumed.global_step == 5 and int(resumed.state.step) == 5


def _rl_config(init_from: str, **changes) -> ExperimentConfig:
  code = base.CodeEnvConfig()
  return smoke_experiment(
    model='tiny-code', tokenizer='code', env=code, eval_env=code, init_from=init_from, **changes
  )


def test_the_warm_start_initializes_the_rl_policy_on_its_train_layout(trained):
  run, _, workdir = trained
  model = ModelConfig.preset(run.config.model)  # the code presets' model
  config = _rl_config(os.path.join(workdir, 'checkpoints'), loss=LossConfig(kl_coef=0.01))
  spec = StageSpec(optim=config.optim, loss=config.loss)
  with Executables(model, spec=spec) as exe:
    placement = StagePlacement.initialize(config, model, exe, DP4TP2)
    params, want = placement.state.params, exe.param_shardings(DP4TP2)
    assert [x.sharding for x in jax.tree.leaves(params)] == jax.tree.leaves(want)
    for a, b, c in zip(_host(params), _host(run.state.params), _host(placement.ref_on(DP4TP2))):
      np.testing.assert_array_equal(a, b)
      np.testing.assert_array_equal(c, b)
    assert int(placement.state.step) == 0  # fresh moments: RL starts its own optimizer
    # The run folder names its checkpoints too.
    again = StagePlacement.initialize(
      dataclasses.replace(config, init_from=workdir), model, exe, DP4TP2
    )
    for a, b in zip(_host(again.state.params), _host(run.state.params)):
      np.testing.assert_array_equal(a, b)


def test_bad_warm_starts_are_one_line_errors(trained, tmp_path):
  _, _, workdir = trained
  tiny = ModelConfig.preset('tiny')
  cases = [
    (str(tmp_path / 'nope'), tiny, 'does not exist or is not a folder'),
    (str(tmp_path), tiny, 'no checkpoint in'),
    (workdir, ModelConfig.preset('small-kv'), r'hidden_size \(D\)=64 \(here 128\)'),
  ]
  # A checkpoint with no model in its meta (as the RL job writes them): the shapes decide.
  other = str(tmp_path / 'game')
  ckpt = checkpointing.Checkpointer(other, async_save=False)
  ckpt.save(1, {'params': {'embed_tokens': {'value': jax.numpy.zeros((64, 64))}}}, {'step': 1})
  ckpt.close()
  cases.append((other, tiny, r'embed_tokens has shape \(64, 64\) \(here \(512, 64\)\); .* missing'))
  for init_from, model, fragment in cases:
    with pytest.raises(WarmStartError, match=fragment) as e:
      check_warm_start(init_from, model)
    assert '\n' not in str(e.value)
  assert not os.path.exists(tmp_path / 'nope')  # nothing is created where nothing was
