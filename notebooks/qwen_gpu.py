# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Qwen2.5 on a GPU: the EARL loop on a real checkpoint
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/earl-jax/earl_jax/blob/main/notebooks/qwen_gpu.ipynb)
#
# For a Colab GPU runtime: installs earl_jax with its `cuda12` extra, fetches
# Qwen2.5-0.5B-Instruct from the Hugging Face hub (the only download, in its own cell: nothing in
# earl_jax downloads at run time), then
#
# 1. measures the decode throughput of the rollout program on the GPU;
# 2. lets the Parallelism Selector choose layouts against the device's real memory;
# 3. trains the model on Connect Four with its chat template through the same EARL loop as the
#    main job (`experiments/train.py --config=qwen`).
#
# The parameter cell below points it at the tiny HF fixture on CPU instead (8 fake devices and an
# emulated memory budget), which is how CI executes it; its committed outputs come from that run.

# %%
# Parameters. On a GPU runtime: MODEL = 'Qwen/Qwen2.5-0.5B-Instruct', STEPS = 20.
MODEL = 'fixture'  # 'fixture' (the tiny HF checkpoint in tests/fixtures) or a hub id
STEPS = 2

# %%
import os
import pathlib
import subprocess
import sys

REPO_URL = 'https://github.com/earl-jax/earl_jax'  # the repository to install on Colab
ON_GPU = MODEL != 'fixture'
flags = os.environ.get('XLA_FLAGS', '')  # the caller's XLA flags are kept
if not ON_GPU and 'host_platform_device_count' not in flags:  # 8 fake CPU devices, before JAX
  os.environ['XLA_FLAGS'] = f'{flags} --xla_force_host_platform_device_count=8'.strip()


def _checkout() -> pathlib.Path | None:
  """The earl_jax checkout this notebook runs in, if any (its root holds pyproject.toml)."""
  for d in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (d / 'pyproject.toml').exists() and (d / 'earl_jax').is_dir():
      return d
  return None


ROOT = _checkout()
if ROOT is None:  # Colab: clone and install, with the CUDA 12 wheels on a GPU runtime
  ROOT = pathlib.Path('/content/earl_jax')
  if not ROOT.exists():
    subprocess.run(['git', 'clone', '-q', '--depth=1', REPO_URL, str(ROOT)], check=True)
  target = f'{ROOT}[cuda12]' if ON_GPU else str(ROOT)
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', target], check=True)
os.chdir(ROOT)

import jax

jax.config.update('jax_compilation_cache_dir', str(ROOT / '.jax_cache'))
print(jax.__version__, jax.device_count(), jax.devices()[0].platform, 'devices')

# %%
# The checkpoint: downloaded from the hub on a GPU runtime (this cell only).
if ON_GPU:
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', 'huggingface_hub'], check=True)
  from huggingface_hub import snapshot_download

  MODEL_DIR = snapshot_download(MODEL, allow_patterns=['*.json', '*.safetensors'])
else:
  MODEL_DIR = str(ROOT / 'tests' / 'fixtures' / 'qwen2_tiny')
print(MODEL_DIR, sorted(os.listdir(MODEL_DIR)))

# %% [markdown]
# ## 1. Decode throughput of the rollout program
#
# The rollout program the main job runs (prefill a chunk, then decode `N` tokens against a KV
# cache whose capacity is a context bucket), timed after a warm-up.

# %%
import time

from earl_jax.config import ParallelConfig
from earl_jax.models import hf_import
from earl_jax.programs import builders, memory
from earl_jax.programs.executables import Executables
from earl_jax.rollout.sampler import SamplingConfig
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage

dtype = 'bfloat16' if ON_GPU else 'float32'
model_cfg = hf_import.load_config(MODEL_DIR, param_dtype=dtype, dtype=dtype)
n = jax.device_count()
layout = ParallelConfig(dp=n)  # one replica per device: decode is memory-bound
N, bucket = 32, 1024
exe = Executables(model_cfg, spec=builders.StageSpec(sampling=SamplingConfig(max_new_tokens=N)))
_, _, params = hf_import.load(MODEL_DIR, mesh_lib.make_mesh(layout), param_dtype=dtype)
for rows in (n, 4 * n):
  entry = exe.get(exe.key(Stage.ROLLOUT, layout, bucket, rows))
  placed = exe.resharder(params, entry.program.param_shardings)
  jax.block_until_ready(entry(*builders.make_inputs(entry.program, placed)))  # warm-up
  args = builders.make_inputs(entry.program, placed)  # a fresh cache: the call donates it
  jax.block_until_ready(args)
  t0 = time.perf_counter()
  jax.block_until_ready(entry(*args))
  seconds = time.perf_counter() - t0
  print(f'{layout.name}, {rows} rows, cache {bucket}: {rows * N / seconds:,.0f} new tokens/s '
        f'({entry.memory.peak / memory.MiB:,.0f} MiB per device by XLA)')  # fmt: skip

# %% [markdown]
# ## 2. The selector against the device's memory
#
# On a GPU the budget is the device's own limit; on CPU an emulated one. Every candidate layout of
# the rollout stage is sized by the analytic memory model at each bucket, for 64 responses.

# %%
from earl_jax.profiling import analytic

budget = memory.device_budget(emulated=None if ON_GPU else 128 * memory.MiB)
print(f'budget {budget / memory.MiB:,.0f} MiB per device')
candidates = [c for c in mesh_lib.factorizations(n, with_fsdp=False) if c.tp <= n]
for T in (1024, 4096, 16384):
  cells = []
  for c in candidates:
    try:
      mesh_lib.check_model_fits(c, model_cfg)
    except mesh_lib.ShardingError:
      continue
    need = analytic.estimate(Stage.ROLLOUT, model_cfg, c, T, 64, decode_tokens=N, chunk=128).total
    cells.append(f'{c.name} {need / memory.MiB:,.0f} MiB ({"fits" if need <= budget else "no"})')
  print(f'bucket {T:6d}: ' + ', '.join(cells))

# %% [markdown]
# ## 3. The EARL loop on the checkpoint
#
# The `qwen` preset of the main job: Connect Four against a random opponent with the model's chat
# template, replies parsed leniently, every stage planned by the selector.

# %%
import dataclasses
import tempfile

from earl_jax.config import BucketConfig
from earl_jax.rollout.engine import RolloutConfig
from earl_jax.train.trainer import Trainer
from experiments.configs import train as presets

run = dataclasses.replace(presets.qwen(), model_dir=MODEL_DIR, param_dtype=dtype, steps=STEPS)
if not ON_GPU:  # the fixture: small enough for CPU
  run = dataclasses.replace(
    run,
    rollout=RolloutConfig(
      num_episodes=8,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=4),
      prompt_buckets=(64, 128),
    ),
    buckets=BucketConfig(lengths=(128, 256, 512)),
    selector=dataclasses.replace(run.selector, candidates=('dp8', 'dp4.tp2'), budget_mib=64.0),
    eval_every=0,
    checkpoint_every=0,
  )
workdir = tempfile.mkdtemp(prefix='earl_qwen_')
lines = []
trainer = Trainer(run, workdir=workdir, log_fn=lines.append)
summary = trainer.run(progress=False)
print('\n'.join(x for x in lines if x.startswith('step')))
print(f'{summary["steps"]} steps in {summary["wall_s"]:.0f} s')
