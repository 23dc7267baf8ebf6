"""Presets of experiments/sft.py.

code    the tiny model ('tiny', the code tokenizer) on the 'functions' tasks of the train split,
        held-out loss (and the greedy first-turn pass rate) on the heldout split, 8 fake CPU
        devices: the warm start of the RL `code` preset (`--config.init_from=runs/code_sft`).
smoke   a few steps of the same, for tests and CI.
qwen    a real Qwen2.5 checkpoint (--config.model_dir=...) through its chat template, for GPUs.
"""

import dataclasses

from earl_jax.config import BucketConfig
from earl_jax.envs.base import CodeEnvConfig
from earl_jax.rl.train_step import OptimConfig
from earl_jax.sft import SFTConfig


def code() -> SFTConfig:
  return SFTConfig(
    name='code_sft',
    model='tiny',
    tokenizer='code',
    env=CodeEnvConfig(task='functions', split='train'),
    eval_env=CodeEnvConfig(task='functions', split='heldout', max_turns=1),
    # A first turn is 67 to 133 tokens and a reply 16 to 35: every example fits 192.
    buckets=BucketConfig(lengths=(128, 192)),
    batch_size=32,
    optim=OptimConfig(learning_rate=3e-3, warmup_steps=20, decay_steps=580, end_lr_fraction=0.1),
    steps=600,
    log_every=25,
    eval_every=100,
    pass_episodes=48,  # the 42 held-out tasks (6 twice): a multiple of the 8 devices
    max_new_tokens=48,
    checkpoint_every=200,
  )


def smoke() -> SFTConfig:
  return dataclasses.replace(
    code(),
    name='sft_smoke',
    optim=OptimConfig(learning_rate=3e-3),
    steps=4,
    log_every=1,
    eval_every=2,
    pass_episodes=0,
    checkpoint_every=2,
  )


def qwen() -> SFTConfig:
  return SFTConfig(
    name='qwen_sft',
    model_dir='/path/to/Qwen2.5-0.5B-Instruct',
    param_dtype='bfloat16',
    env=CodeEnvConfig(task='functions', split='train'),
    eval_env=CodeEnvConfig(task='functions', split='heldout', max_turns=1),
    buckets=BucketConfig(lengths=(128, 256, 512)),
    batch_size=32,
    optim=OptimConfig(learning_rate=1e-5, warmup_steps=10),
    steps=200,
    eval_every=50,
    pass_episodes=48,
    max_new_tokens=128,
  )


PRESETS = {'code': code, 'smoke': smoke, 'qwen': qwen}
