"""The supervised warm start's job: one-line config errors, a few steps that lower the held-out
loss, resume, and its checkpoint restored into the RL job's placement (or refused in one line)."""

import dataclasses
import os
import shutil

import jax
import numpy as np
import pytest

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.envs import base
from earl_jax.errors import ConfigError
from earl_jax.experiment import ExperimentConfig
from earl_jax.programs import Executables, StageSpec
from earl_jax.rl.losses import LossConfig
from earl_jax.run import checkpointing, rundir
from earl_jax.sft import job as sft
from earl_jax.testing.configs import smoke_experiment
from earl_jax.train.placement import StagePlacement, WarmStartError, check_warm_start
from experiments.configs import sft as presets

DP4TP2 = ParallelConfig(dp=4, tp=2)


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


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
  # One train and one held-out program per bucket reached, each compiled once, through the
  # executable cache of the RL job's stage programs (objective 'sft').
  buckets = {r['bucket'] for r in run.history if 'bucket' in r}
  built = [r['key'] for r in run.executables.log if 'compile_ms' in r]
  assert len(built) == len(set(built)) == summary['compiles'] <= 2 * len(run.config.buckets.lengths)
  assert {f'train/dp8.tp1/S{b}/R32/sft' for b in buckets} <= set(built)
  assert all(k.startswith(('train/', 'experience/')) and k.endswith('/sft') for k in built)
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
    model='tiny-code',
    tokenizer='code',
    env=code,
    eval_env=code.replace(split='heldout'),
    init_from=init_from,
    **changes,
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


def _damage(step_dir) -> None:
  """Cuts the data files of a checkpoint step's arrays (Orbax's ocdbt.process_0/d/) to half their
  length; the metadata stays intact."""
  data = step_dir / 'state' / 'ocdbt.process_0' / 'd'
  names = os.listdir(data)
  assert names
  for name in names:
    with open(data / name, 'r+b') as f:
      f.truncate(os.path.getsize(data / name) // 2)


def test_a_damaged_warm_start_falls_back_to_the_newest_intact_step(trained, tmp_path, caplog):
  """The newest step's arrays damaged: the RL job's placement restores step 2 instead (the
  checksum and fallback path of --resume), and says so; with step 2's metadata cut as well,
  nothing restores, in one line."""
  run, _, workdir = trained
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy)
  _damage(copy / 'checkpoints' / '4')
  model = ModelConfig.preset(run.config.model)
  config = _rl_config(str(copy / 'checkpoints'))
  assert check_warm_start(config.init_from, model)[1] == 4  # its metadata still reads
  ckpt = checkpointing.Checkpointer(str(copy / 'checkpoints'), async_save=False)
  with Executables(model, spec=StageSpec(optim=config.optim)) as exe:
    placement = StagePlacement.initialize(config, model, exe, DP4TP2)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          placement.state.params)  # fmt: skip
    step_2, _ = ckpt.restore_params(target, 2)
    for a, b in zip(_host(placement.state.params), _host(step_2)):
      np.testing.assert_array_equal(a, b)
  ckpt.close()
  said = [r.getMessage() for r in caplog.records]
  assert any('warm start: step 4 of' in m and 'trying an older one' in m for m in said), said
  assert any('warm start: from step 2' in m for m in said), said
  meta = copy / 'checkpoints' / '2' / 'meta'
  for dirpath, _, files in os.walk(meta):
    for f in files:
      with open(os.path.join(dirpath, f), 'r+b') as fh:
        fh.truncate(3)
  refused = pytest.raises(WarmStartError, match=r'no checkpoint in .* restores \(steps \[4, 2\]')
  with Executables(model, spec=StageSpec(optim=config.optim)) as exe, refused as e:
    StagePlacement.initialize(config, model, exe, DP4TP2)
  assert '\n' not in str(e.value)
