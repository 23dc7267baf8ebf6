"""Code RL through the EARL loop: the Qwen presets on the tiny HF fixture (a smoke of the whole
path a GPU run takes), and the code environment on 2 x 4 processes equal to 1 x 8, each process
running only its own episodes' programs (with the online curriculum drawing the tasks)."""

import dataclasses
import os
import sys

import numpy as np
import pytest

from earl_jax.config import BucketConfig
from earl_jax.run import metrics
from earl_jax.sandbox import SandboxConfig
from earl_jax.testing import fixture_path, mp_bodies, multiprocess, swe
from earl_jax.testing.configs import smoke_experiment
from earl_jax.train import trainer
from experiments.configs import train as presets


def _on_the_fixture(config, max_turns: int, prompt_buckets=(256, 1024), context=1152, **env):
  """`config` on the tiny HF fixture, sized for CPU: 8 episodes in groups of 2, 8-token replies,
  up to `max_turns` turns (the evaluations' episodes too), one step, an evaluation of 8
  episodes before and after it, a checkpoint; the smoke's analytic selector instead of a
  measured profile. The fixture's tokenizer makes a HumanEval prompt up to 942 tokens (hence the
  1024 prompt bucket) and a 2-turn 'functions' episode up to ~650: one context bucket holds
  every episode, so that each program compiles once. `env`: more settings of both
  environments."""
  sandbox = SandboxConfig(workers=2)
  return dataclasses.replace(
    config,
    model_dir=fixture_path('qwen2_tiny'),
    env=config.env.replace(max_turns=max_turns, sandbox=sandbox, **env),
    eval_env=config.eval_env.replace(max_turns=max_turns, sandbox=sandbox, **env),
    rollout=dataclasses.replace(
      config.rollout,
      num_episodes=8,
      group_size=2,
      sampling=dataclasses.replace(config.rollout.sampling, max_new_tokens=8),
      prompt_buckets=prompt_buckets,
    ),
    buckets=BucketConfig(lengths=(context,)),
    selector=smoke_experiment().selector,
    steps=1,
    eval_every=1,
    eval_episodes=8,
    checkpoint_every=1,
  )


@pytest.mark.parametrize(
  'preset, task, eval_task',
  [('humaneval_qwen', 'functions', 'humaneval'), ('swe_qwen', 'swe', 'swe')],
)
def test_a_qwen_preset_runs_on_the_tiny_hf_fixture(tmp_path, preset, task, eval_task):
  """swe_qwen plays the miniature project's instances with Qwen2.5's tool calls: the fixture's
  small tokenizer makes the declared tools and a problem statement ~2,400 tokens."""
  config = presets.PRESETS[preset]()
  assert (config.env.task, config.eval_env.task, config.param_dtype) == (
    task,
    eval_task,
    'bfloat16',
  )
  assert config.advantages.estimator == 'grpo' and config.rollout.group_size == 8
  sizes = {}
  if task == 'swe':
    assert config.env.tool_format == config.eval_env.tool_format == 'qwen'
    jsonl = swe.mini_instances(str(tmp_path / 'swe_tasks'))
    sizes = {'prompt_buckets': (2560,), 'context': 3072, 'swe_tasks': jsonl,
             'swe_python': sys.executable}  # fmt: skip
  workdir = tmp_path / 'run'
  t = trainer.Trainer(
    _on_the_fixture(config, max_turns=2, **sizes), workdir=str(workdir), log_fn=lambda _: None
  )
  assert t.model_cfg.vocab_size == 512 and t.tokenizer.eot_id == 499  # the HF import path
  assert ('# Tools' in t.tokenizer.system_prompt) == (task == 'swe')  # the tools declared
  summary = t.run(progress=False)
  rows = metrics.read_jsonl(os.path.join(workdir, 'metrics.jsonl'))
  step = next(r for r in rows if r['step'] == 1 and 'loss/loss' in r)
  assert np.isfinite(step['loss/loss']) and step['ctx/turn_len_mean'] > 20  # the chat template
  assert 1 <= step['ctx/turns_mean'] <= 2
  if task == 'swe':  # 8-token replies of a random model: refused calls, one-line answers
    assert step['env/tool_errors'] > 0 and step['env/programs'] >= 1
  assert summary['eval_win_rate_first'] is not None and summary['eval_win_rate_last'] is not None
  assert os.listdir(workdir / 'checkpoints') == ['1']


# What must match between layouts and process counts (the games' test compares the same).
EXACT = ('win_rate', 'return_mean', 'invalid_rate', 'tokens', 'generated_tokens', 'bucket')


def _compare(rows, ref):
  assert [r['step'] for r in rows] == [r['step'] for r in ref]
  for a, b in zip(rows, ref):
    for k in b:
      timing = k.endswith(('_s', '_s_share'))
      if k in EXACT or k.startswith(('ctx/', 'plan/')) or (k.startswith('env/') and not timing):
        assert a[k] == b[k], (a['step'], k, a[k], b[k])
      elif k.startswith('loss/'):
        assert abs(a[k] - b[k]) <= 1e-5, (a['step'], k, a[k], b[k])


def _each_ran_its_own_programs(two: list[dict], everyone: list[dict], total: int) -> None:
  """Every process of `two` played some of the one-process run's episodes (`everyone`: per step,
  {row: programs}), none twice, together all of them with the same programs; its sandbox judged
  exactly its own episodes' programs, `total` in all."""
  for step, all_rows in enumerate(everyone):
    mine = [p['played'][step] for p in two]
    assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1])
    assert {**mine[0], **mine[1]} == all_rows  # the same episodes ran the same programs
  for p in two:
    assert p['programs_run'] == sum(sum(played.values()) for played in p['played'])
  assert total == sum(p['programs_run'] for p in two)
  assert all(0 < p['programs_run'] < total for p in two)


@pytest.mark.multiprocess
def test_the_curriculum_on_two_processes_equals_one_runs_its_own_programs_and_resumes(tmp_path):
  """Code episodes in groups of 2 whose tasks the curriculum draws: 2 processes x 4 devices play
  the same tasks to the same metrics as this process's 8 devices (every process draws from the
  same counts), each process's sandbox judging exactly the programs of the episodes it played
  (its rows of the batch); and a run resumed from step 2's checkpoint continues as the
  uninterrupted one (the counts are saved)."""
  ref = mp_bodies.code_trainer_run(str(tmp_path / 'one'), steps=3, curriculum=True)
  rows = [r for r in ref['rows'] if 'loss/loss' in r]
  seen = [r['curriculum/tasks_seen'] for r in rows]
  # 4 groups a step, each on a task drawn by weight: tasks not played yet weigh the most.
  assert len(seen) == 3 and seen[0] <= 4 and seen[0] < seen[1] < seen[2] <= 12, seen
  assert all(r['curriculum/effective_tasks'] > 0 for r in rows)
  assert any(r['loss/grad_norm'] > 0 for r in rows)  # the updates moved the policy
  programs = [r['env/programs'] for r in rows]
  assert ref['programs_run'] == sum(programs)
  kwargs = {'workdir': str(tmp_path / 'two'), 'steps': 2, 'curriculum': True, 'checkpoint_every': 1}
  first = multiprocess.run(
    'earl_jax.testing.mp_bodies:code_trainer_run',
    num_processes=2,
    devices_per_process=4,
    kwargs=kwargs,
  )
  assert first[1]['rows'] is None  # process 0 writes the metrics
  _each_ran_its_own_programs(first, ref['played'][:2], sum(programs[:2]))
  two = multiprocess.run(
    'earl_jax.testing.mp_bodies:code_trainer_run',
    num_processes=2,
    devices_per_process=4,
    kwargs={**kwargs, 'steps': 3, 'resume': True},
  )
  _each_ran_its_own_programs(two, ref['played'][2:], programs[2])
  _compare(two[0]['rows'], ref['rows'])
  for a, b in zip(two[0]['rows'], ref['rows']):
    assert {k: v for k, v in a.items() if k.startswith('curriculum/')} == {
      k: v for k, v in b.items() if k.startswith('curriculum/')
    }
