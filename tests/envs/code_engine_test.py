"""Code environments inside the real rollout engine: the tiny model with the code tokenizer, and
the tiny Qwen checkpoint with its chat template, play multi-turn episodes to an outcome the
trainer knows."""

import numpy as np
import pytest

from earl_jax.config import BucketConfig, ModelConfig
from earl_jax.envs import base
from earl_jax.models import hf_import, qwen2, tokenizer
from earl_jax.programs import Executables, StageSpec
from earl_jax.rollout import engine, sampler, trajectories
from earl_jax.sandbox import SandboxConfig
from earl_jax.testing import fixture_path, small_mesh


def _run(cfg, tok, params, mesh, env, *, max_new_tokens, prompts=(64, 128, 256, 512), cache=512):
  sampling = sampler.SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens)
  rollout = engine.RolloutConfig(
    num_episodes=8, group_size=2, sampling=sampling, prompt_buckets=prompts
  )
  spec = StageSpec.for_rollout(rollout, tok, cfg.vocab_size)
  programs = Executables(cfg, spec=spec, devices=list(mesh.devices.flat))
  buckets = BucketConfig(lengths=(cache, 2 * cache))
  return engine.RolloutEngine(cfg, tok, env, rollout, buckets, programs=programs).run(
    params, mesh, seed=0
  )


def _check(traj, max_turns):
  assert set(traj.outcomes) <= {'win', 'loss', 'invalid'}  # every episode ended
  assert set(traj.outcomes) <= set(trajectories.OUTCOMES)
  assert all(1 <= len(starts) <= max_turns for starts in traj.turn_starts)
  assert ((traj.returns >= 0) & (traj.returns <= 1)).all()
  np.testing.assert_array_equal(traj.group_ids, np.arange(8) // 2)


def test_code_tokenizer_rollout_of_repair_episodes():
  cfg = ModelConfig.preset('tiny')
  tok = tokenizer.load_tokenizer('code')
  env = base.CodeEnvConfig(task='functions', max_turns=2, sandbox=SandboxConfig(workers=2))
  mesh = small_mesh(dp=2, tp=1)
  _, params = qwen2.init_model(cfg, mesh, seed=0)
  traj = _run(cfg, tok, params, mesh, env, max_new_tokens=16)
  _check(traj, 2)
  first = tok.decode(traj.tokens[0, : traj.turn_tokens[0][0]].tolist())
  assert first.startswith('<bos><obs>def f(') and '<act>' in first


@pytest.mark.parametrize('task', ['humaneval', 'repo_repair'])
def test_qwen_chat_template_rollout(task):
  mesh = small_mesh(dp=2, tp=1)
  model_dir = fixture_path('qwen2_tiny')
  cfg, _, params = hf_import.load(model_dir, mesh)
  tok = tokenizer.load_tokenizer(model_dir)
  env = base.CodeEnvConfig(task=task, max_turns=2, sandbox=SandboxConfig(workers=2))
  # A HumanEval repair turn repeats the prompt after the feedback: up to about 700 tokens.
  traj = _run(cfg, tok, params, mesh, env, max_new_tokens=8, prompts=(256, 1024), cache=1024)
  _check(traj, 2)
  text = tok.decode(traj.tokens[0, : traj.lengths[0]].tolist())
  assert text.startswith('<|im_start|>system\n') and '<|im_start|>user\n' in text
  assert text.count('<|im_start|>assistant\n') == len(traj.turn_starts[0])
