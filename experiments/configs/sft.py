"""Presets of experiments/sft.py.

code    the tiny model ('tiny', the code tokenizer) on half of the RL `code` preset's train
        tasks (82 'functions' tasks), each as a first turn and as a repair (a near miss, its
        feedback, the reference), held-out loss (and the greedy first-turn pass rate) on the
        heldout split, 8 fake CPU devices: the warm start of the RL `code` preset (its
        init_from, runs/code_sft/checkpoints), which trains on all 164 from their verdicts.
smoke   a few steps of the same, for tests and CI.
qwen    a real Qwen2.5 checkpoint (--config.model_dir=...) through its chat template, for GPUs.
"""

import dataclasses

from earl_jax.config import BucketConfig
from earl_jax.envs.base import CodeEnvConfig
from earl_jax.rl.train_step import OptimConfig
from earl_jax.sft import SFTConfig


def code() -> SFTConfig:
  # Half of the RL job's train tasks: with the same split seed, the held-out tasks of a larger
  # fraction include those of a smaller one, so these 82 tasks (train at 0.6) are among the RL
  # `code` preset's 164 (train at 0.2) and none is among its 42 held-out ones. RL then trains on
  # 82 tasks whose solutions the warm start never saw, from the sandbox's verdicts alone. The
  # feedback settings are the RL preset's.
  env = CodeEnvConfig(
    task='functions', split='train', heldout_fraction=0.6, feedback_tests=1, feedback_chars=80
  )
  return SFTConfig(
    name='code_sft',
    model='tiny',
    tokenizer='code',
    env=env,
    repair_examples=True,
    eval_env=CodeEnvConfig(task='functions', split='heldout', max_turns=1),
    # A first turn is 67 to 133 tokens and a reply 16 to 35: 192; a repair example (a near
    # miss, one failing test, the prompt again, the reference) up to 375: 384.
    buckets=BucketConfig(lengths=(192, 384)),
    batch_size=32,
    optim=OptimConfig(learning_rate=3e-3, warmup_steps=20, decay_steps=380, end_lr_fraction=0.1),
    steps=400,
    log_every=25,
    eval_every=100,
    pass_episodes=48,  # the 42 held-out tasks (6 twice): a multiple of the 8 devices
    max_new_tokens=48,
    checkpoint_every=100,
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
