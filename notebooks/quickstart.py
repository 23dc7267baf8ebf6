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
# # earl_jax quickstart: the Parallelism Selector and the Data Dispatcher at work
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/earl-jax/earl_jax/blob/main/notebooks/quickstart.ipynb)
#
# On Colab's free CPU runtime (8 fake JAX devices on the host), this notebook shows the two parts
# EARL (arXiv 2510.05943) adds to an agentic RL loop, and then runs the loop:
#
# 1. a mesh, the one table of logical-axis rules, and a model created sharded on two layouts;
# 2. a Hugging Face checkpoint (the tiny fixture) loaded through the real import path, its logits
#    checked against the reference HF computed;
# 3. the **Parallelism Selector** deciding each stage's layout as contexts grow, with every
#    layout's memory checked against a per-device budget;
# 4. the **Data Dispatcher** moving an RL batch between two layouts, with the bytes its plan
#    moves, against the single-controller baseline;
# 5. 10 steps of the EARL loop (Connect Four), with the learning curve, the context lengths and
#    which layout each stage ran on at every step.

# %%
# The device count must be set before JAX is imported.
import os

flags = os.environ.get('XLA_FLAGS', '')  # the caller's XLA flags are kept
if 'host_platform_device_count' not in flags:
  os.environ['XLA_FLAGS'] = f'{flags} --xla_force_host_platform_device_count=8'.strip()

import pathlib
import subprocess
import sys

REPO_URL = 'https://github.com/earl-jax/earl_jax'  # the repository to install on Colab


def _checkout() -> pathlib.Path | None:
  """The earl_jax checkout this notebook runs in, if any (its root holds pyproject.toml)."""
  for d in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (d / 'pyproject.toml').exists() and (d / 'earl_jax').is_dir():
      return d
  return None


ROOT = _checkout()
if ROOT is None:  # Colab: clone (for the fixtures) and install
  ROOT = pathlib.Path('/content/earl_jax')
  if not ROOT.exists():
    subprocess.run(['git', 'clone', '-q', '--depth=1', REPO_URL, str(ROOT)], check=True)
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', str(ROOT)], check=True)
os.chdir(ROOT)

import jax

jax.config.update('jax_compilation_cache_dir', str(ROOT / '.jax_cache'))
print(jax.__version__, jax.device_count(), 'devices:', jax.devices()[0].platform)

# %% [markdown]
# ## 1. Meshes, logical axes, a model sharded on two layouts
#
# Every mesh has the axes `('data', 'fsdp', 'tensor')`; a layout only sets their sizes. Model code
# names its axes logically, and one table maps the names to mesh axes.

# %%
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.programs import memory
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding import rules

for name, axes in rules.LOGICAL_AXIS_RULES.items():
  print(f'{name:15s} -> {axes}')

# %%
cfg = ModelConfig.preset('tiny')
layouts = {name: mesh_lib.make_mesh(ParallelConfig.parse(name)) for name in ('dp8', 'dp2.tp4')}
for name, mesh in layouts.items():
  graphdef, params = qwen2.init_model(cfg, mesh, seed=0)
  q = params['layers'][0]['self_attn']['q_proj'][...]
  print(
    f'{name:8s} mesh {dict(mesh.shape)}: q_proj {q.shape} as {q.sharding.spec}, one device '
    f'holds {q.addressable_shards[0].data.shape}; weights per device '
    f'{memory.resident_bytes_per_device(params) / 1024:.0f} KiB'
  )

# %% [markdown]
# ## 2. A Hugging Face checkpoint through the real import path
#
# `hf_import.load` reads `config.json` and the safetensors, and every device reads only its own
# slice of each tensor. The fixture is a tiny random Qwen2 made by `scripts/make_qwen2_fixture.py`
# with HF transformers, which also saved its logits.

# %%
import jax.numpy as jnp
import numpy as np
from flax import nnx

from earl_jax.models import hf_import
from earl_jax.testing import fixture_path

mesh = layouts['dp2.tp4']
model_cfg, graphdef, state = hf_import.load(fixture_path('qwen2_tiny'), mesh, param_dtype='float32')
ref = np.load(fixture_path('qwen2_tiny_reference.npz'))
tokens = np.resize(ref['tokens'], (4, ref['tokens'].shape[1]))  # rows divide dp=2


def logits_of(state, tokens):
  model = nnx.merge(graphdef, state)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return model.logits(model(tokens, positions)[0])


with jax.set_mesh(mesh):
  logits = np.asarray(jax.jit(logits_of)(state, tokens))[: len(ref['tokens'])]
diff = float(np.abs(logits - ref['logits_untied']).max())
print(f'{model_cfg.name}: max |ours - HF| = {diff:.2e} over {logits.size} logits')
assert diff < 1e-4

# %% [markdown]
# ## 3. The Parallelism Selector as contexts grow
#
# The selector picks each stage's layout and context bucket from the step's context statistics.
# Here it decides the rollout stage of a small model with a large K/V cache, ranking layouts by
# the fewest-splits preference and checking each one's memory with the analytic model (the main
# job measures every stage's own programs instead), against a per-device budget between what
# `dp8` and `dp4.tp2` need at 4,096 tokens: as the contexts grow, `dp8` stops fitting and the
# selector moves to a layout that splits the K/V heads.

# %%
from earl_jax.config import BucketConfig
from earl_jax.profiling import analytic
from earl_jax.programs.builders import StageSpec
from earl_jax.selector.selector import ProfileSettings, Selector, SelectorConfig, StepStats
from earl_jax.stage import Stage

sel_model = ModelConfig.preset('small-kv')
spec = StageSpec(chunk=1)
table = BucketConfig(lengths=(128, 512, 1024, 4096))
need = {
  c: analytic.estimate(Stage.ROLLOUT, sel_model, ParallelConfig.parse(c), 4096, 8, chunk=1).total
  for c in ('dp8', 'dp4.tp2')
}
budget_mib = (need['dp8'] + need['dp4.tp2']) / 2 / memory.MiB
config = SelectorConfig(
  profile=ProfileSettings(stages=()), budget_mib=budget_mib, safety_margin=0.0,
  candidates=('dp8', 'dp4.tp2', 'dp2.tp4'),
)  # fmt: skip
sel = Selector(config, model=sel_model, buckets=table, rows=8, spec=spec)
print(f'rollout stage, budget {budget_mib:.2f} MiB per device; per layout: MiB needed (fits?)')
rng = np.random.default_rng(0)
for ctx in (100, 400, 900, 2000, 3500):
  lengths = rng.integers(int(ctx * 0.8), int(ctx * 1.1), 8)
  d = sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=lengths, num_responses=8))
  needs = '  '.join(
    f'{o.config} {o.need_bytes / memory.MiB:5.2f} ({"yes" if o.feasible else "no"})'
    for o in d.options
  )
  print(
    f'longest {int(lengths.max()):5d}: {d.config.name:8s} at bucket {d.run_bucket:5d} | {needs}'
  )
  print(f'    {d.reason}')

# %% [markdown]
# ## 4. The Data Dispatcher: one move between two layouts
#
# An RL batch built on the rollout layout (`dp2.tp4`: every row on the four devices of its
# tensor-parallel group) moves to the train layout (`dp8`), with the rows permuted so that every
# train rank gets about the same number of real tokens. The layout-aware plan sends each row
# straight from a device that holds it to the device that needs it; the single-controller baseline
# (`gather_scatter`) brings every block to one place and sends it out again.

# %%
from earl_jax import dispatch
from earl_jax.rl.batch import Batch

rows, T = 64, 512
host = Batch.zeros(rows, T)
real = rng.integers(16, T, rows)
host = host.replace(
  tokens=rng.integers(0, 64, (rows, T)).astype(np.int32),
  lengths=real.astype(np.int32),
  valid=np.ones(rows, bool),
)
fields = {k: getattr(host, k) for k in ('tokens', 'loss_mask', 'sample_logprobs', 'lengths')}
src = dispatch.Layout.parse('dp2.tp4:rep', fields)
dst = dispatch.Layout.parse('dp8', fields)
perm = dispatch.balanced_permutation(real, src, dst, like=fields)
placed = {k: jax.device_put(v, src.shardings()[k]) for k, v in fields.items()}
# Timed, and without donation: `placed` is dispatched again below (the main job donates).
dispatcher = dispatch.Dispatcher(
  dispatch.DispatchConfig(timed=True, donate=False, stable_kernels=False)
)
plan = dispatcher.plan(placed, src, dst, perm=perm)
total = sum(v.nbytes for v in fields.values())
print(f'batch {total / 1024:.0f} KiB; the plan moves {plan.min_bytes / 1024:.0f} KiB in all, per '
      f'device {np.round(plan.bytes_received / 1024).astype(int).tolist()} KiB')  # fmt: skip
for strategy in ('layout_aware', 'gather_scatter'):
  for _ in range(2):  # the first call compiles
    out, report = dispatcher.dispatch(placed, dst, perm=perm, strategy=strategy)
  ok = all(np.array_equal(np.asarray(out[k]), v[perm]) for k, v in fields.items())
  print(f'{strategy:15s} {1e3 * report.wall_s:7.1f} ms, rows where they belong: {ok}')
print(f'through the controller: every block in and out, {2 * total * 7 / 8 / 1024:.0f} KiB over '
      "its links with eight workers (here all eight devices share one process's memory)")  # fmt: skip

# %% [markdown]
# ## 5. The EARL loop: 10 steps
#
# The embedded default of the main job (`experiments/train.py`): a tiny model learns Connect Four
# against a random opponent from scratch, 64 episodes per step. Every step the selector plans
# each stage: the rollout from measurements of its own programs (each bucket is measured when the
# run first reaches it; here two candidate layouts, and the other stages by the analytic model,
# to keep the notebook short; the main job measures every stage), the weights move
# device to device, the batch is dispatched between the stage layouts, and the train state is
# checkpointed with Orbax. Replies are sampled among the column digits and half the training games
# start with one column full, so the episodes reach the 1024-token bucket from the first steps.
# Ten steps are too few to learn much: the untrained greedy policy already stacks one column,
# and the demo's 60 steps are what take it past that (docs/results.md, "The default preset").

# %%
import dataclasses
import tempfile

from earl_jax.run import plotting
from earl_jax.train.trainer import Trainer
from experiments.configs import train as presets

workdir = tempfile.mkdtemp(prefix='earl_quickstart_')
base = presets.default()
profile = dataclasses.replace(
  base.selector.profile, stages=(Stage.ROLLOUT,), cache=os.path.join(workdir, 'profile.json')
)
selector = dataclasses.replace(base.selector, candidates=('dp8', 'dp4.tp2'), profile=profile)
run = dataclasses.replace(
  base, steps=10, eval_every=5, eval_episodes=64, checkpoint_every=5, selector=selector
)
lines = []
trainer = Trainer(run, workdir=workdir, log_fn=lines.append)
summary = trainer.run(progress=False)
for line in lines:
  if line.startswith('step') and int(line.split()[1]) % 2 == 0:
    print(line)
print(f'\n{summary["steps"]} steps in {summary["wall_s"]:.0f} s; greedy eval win rate against '
      f'random {summary["eval_win_rate_first"]:.2f} -> {summary["eval_win_rate_last"]:.2f}')  # fmt: skip
paths = plotting.plot_training(os.path.join(workdir, 'metrics.jsonl'), workdir)

# %%
from IPython.display import Image, display

for p in paths:
  display(Image(filename=p))

# %%
# Peak resident memory of this notebook's process so far.
with open('/proc/self/status') as f:
  peak = next(int(line.split()[1]) for line in f if line.startswith('VmHWM'))
print(f'peak resident memory: {peak / 1024 / 1024:.2f} GB')
