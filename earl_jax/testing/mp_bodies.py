"""Small function bodies that tests run in several processes (see testing.multiprocess)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def global_psum(stdout_noise: str = '') -> dict:
  """Every device holds its global index; a jitted sum over the global array adds them.

  `stdout_noise` is written straight to file descriptor 1 with no newline, as gloo's C++ threads
  do: the result must come back however the process's stdout is interleaved.
  """
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',))
  sharding = NamedSharding(mesh, P('x'))
  index = {d: i for i, d in enumerate(jax.devices())}
  local = [jax.device_put(np.array([float(index[d])], np.float32), d) for d in jax.local_devices()]
  x = jax.make_array_from_single_device_arrays((jax.device_count(),), sharding, local)
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
  result = {
    'process_index': jax.process_index(),
    'device_count': jax.device_count(),
    'local_device_count': jax.local_device_count(),
    'psum': float(total.addressable_data(0)),
  }
  if stdout_noise:  # after the sum has run, so after gloo's own connection messages
    os.write(1, stdout_noise.encode())
  return result


def load_tiny_checkpoint_and_score(model_dir: str, reference: str) -> dict:
  """Loads a HF checkpoint onto a mesh spanning every process and checks its logits."""
  from flax import nnx
  from jax.experimental import multihost_utils

  from earl_jax.config import ParallelConfig
  from earl_jax.models import hf_import
  from earl_jax.sharding import mesh as mesh_lib

  mesh = mesh_lib.make_mesh(ParallelConfig(dp=2, tp=2))
  _, graphdef, state = hf_import.load(model_dir, mesh)
  ref = np.load(reference)
  tokens = np.resize(ref['tokens'], (4, ref['tokens'].shape[1]))

  def logits(state, tokens):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model.logits(model(tokens, positions)[0])

  with jax.set_mesh(mesh):
    tokens = jax.make_array_from_callback(
      tokens.shape, NamedSharding(mesh, P(('data', 'fsdp'))), lambda idx: tokens[idx]
    )
    out = jax.jit(logits)(state, tokens)
  full = np.asarray(multihost_utils.process_allgather(out, tiled=True))
  n = ref['tokens'].shape[0]
  return {
    'max_abs_diff': float(np.abs(full[:n] - ref['logits_untied']).max()),
    'addressable_devices': len(state['embed_tokens'][...].addressable_shards),
    'global_devices': jax.device_count(),
  }


def rollout_peaks_near_a_budget(
  bucket: int, rows: int, small: str, big: str, repeats: int = 3
) -> dict:
  """XLA's per-device peak of two rollout layouts against their measured peak when run.

  The model is wide for its size (D = 512, V = 4096), so that the layouts' weights differ by
  megabytes. Each program runs once unmeasured (the first run of a program allocates its
  runtime state), then `repeats` times measured, keeping the least. Runs in a fresh process:
  the measurement reads this process's resident memory, which earlier work in a long-lived test
  process would disturb.
  """
  from earl_jax.config import ModelConfig, ParallelConfig
  from earl_jax.models import qwen2
  from earl_jax.programs import builders, memory
  from earl_jax.programs.executables import Executables
  from earl_jax.rollout.sampler import SamplingConfig
  from earl_jax.stage import Stage

  cfg = ModelConfig.preset('small-kv').replace(
    name='wide-kv', hidden_size=512, intermediate_size=2048, vocab_size=4096, head_dim=64
  )
  small, big = ParallelConfig.parse(small), ParallelConfig.parse(big)
  out = {}
  spec = builders.StageSpec(sampling=SamplingConfig(max_new_tokens=4))
  with Executables(cfg, spec=spec) as exe:
    need = {c: exe.get(exe.key(Stage.ROLLOUT, c, bucket, rows)).memory.peak for c in (small, big)}
    budget = (need[small] + need[big]) // 2
    exe.get(exe.key(Stage.ROLLOUT, small, bucket, rows), budget=budget)
    try:
      exe.get(exe.key(Stage.ROLLOUT, big, bucket, rows), budget=budget)
      out['refused'] = None
    except memory.InfeasibleError as e:
      out['refused'] = str(e)
    _, params = qwen2.init_model(
      cfg, exe.get(exe.key(Stage.ROLLOUT, small, bucket, rows)).program.mesh
    )
    for c in (small, big):
      entry = exe.get(exe.key(Stage.ROLLOUT, c, bucket, rows))
      p = jax.jit(lambda x: x, out_shardings=entry.program.in_shardings[0])(params)
      jax.block_until_ready(entry.compiled(*builders.make_inputs(entry.program, p)))
      # What else the process touches during a run (thread stacks, allocator arenas) only adds
      # to the rise of its resident set, so the least of a few runs is the program's own peak.
      runs = []
      for _ in range(repeats):
        args = builders.make_inputs(entry.program, p)
        measured, result = memory.measure_run_peak(entry.compiled, args)
        runs.append(measured)
        decoded_to = int(result[1].lengths[0])
        del args, result
      out[c.name] = {'need': need[c], 'measured': min(runs), 'runs': runs, 'decoded_to': decoded_to}
  out['budget'] = budget
  return out


def trainer_run(
  workdir: str,
  steps: int,
  resume: bool,
  winners: dict[str, str],
  dynamic_sampling_rounds: int = 0,
  ratio: str = 'token',
  estimator: str = 'grpo',
  candidates: tuple[str, ...] = ('dp8', 'dp4.tp2', 'dp2.tp4'),
) -> dict:
  """The smoke preset on this process group, with the stages on the `winners` layouts (among
  `candidates`); returns its metrics rows and summary (every process returns what it holds).
  `dynamic_sampling_rounds`:
  with it, groups of 2 and `estimator`'s advantages (a grouped one), flat groups replaced from
  up to this many rounds. `ratio`: the loss's importance ratio ('sequence': GSPO's)."""
  import dataclasses

  from earl_jax.rl.advantages import AdvantageConfig
  from earl_jax.run import metrics
  from earl_jax.testing import configs
  from earl_jax.train import trainer

  # Seed 1: step 1's episodes have unequal returns. With all returns equal (seed 0) the first
  # gradient is float noise (the policy is its own reference), which Adam scales up to full-size
  # steps that differ between layouts, and the runs could not be compared.
  config = configs.smoke_experiment(steps=steps, checkpoint_every=2, eval_every=2, seed=1)
  config = dataclasses.replace(
    config,
    selector=dataclasses.replace(config.selector, candidates=candidates),
  )
  if dynamic_sampling_rounds:
    config = dataclasses.replace(
      config,
      rollout=dataclasses.replace(config.rollout, group_size=2),
      advantages=AdvantageConfig(estimator=estimator),
      dynamic_sampling_rounds=dynamic_sampling_rounds,
    )
  config = dataclasses.replace(config, loss=dataclasses.replace(config.loss, ratio=ratio))
  t = trainer.Trainer(
    config,
    workdir=workdir,
    resume=resume,
    log_fn=lambda _: None,
    profile=configs.staged_profile(config, winners),
  )
  summary = t.run(progress=False)
  rows = metrics.read_jsonl(f'{workdir}/metrics.jsonl') if t.is_main else None
  return {
    'rows': rows,
    'moves': summary['moves'],
    'steps': summary['steps'],
    'process': jax.process_index(),
  }


def agreement_and_rows() -> dict:
  """The agreement helpers and the row helpers across processes (2 x 4 devices)."""
  from earl_jax import distributed
  from earl_jax.config import ParallelConfig
  from earl_jax.sharding import mesh as mesh_lib

  pid = jax.process_index()
  out = {
    'min': distributed.process_min(10 + pid),
    'min_none': distributed.process_min(None if pid == 0 else 5),
    'max': distributed.process_max([pid, 7 - pid]),
    'json': distributed.broadcast_json({'from': pid, 'cells': list(range(pid + 3))}),
  }
  held = np.zeros(8, bool)
  held[[0, 1, 2] if pid == 0 else [2, 3, 4, 5, 6, 7]] = True
  values = np.where(held, 100 * (pid + 1) + np.arange(8), -1)
  out['rows'] = distributed.gather_rows(values, held).tolist()
  layouts = {}
  for name in ('dp8', 'dp2.tp4', 'dp1.tp8'):
    mesh = mesh_lib.make_mesh(ParallelConfig.parse(name))
    sharding = NamedSharding(mesh, P(('data', 'fsdp'), None))
    rows = mesh_lib.local_rows(sharding, (16, 2))
    x = mesh_lib.put_rows(np.stack([rows, -rows], 1), rows, (16, 2), sharding)
    total = jax.jit(lambda a: a[:, 0].sum(), out_shardings=NamedSharding(mesh, P()))(x)
    got, back = mesh_lib.host_rows(x)
    layouts[name] = {
      'rows': rows.tolist(),
      'back': bool(np.array_equal(got, rows) and np.array_equal(back[:, 1], -rows)),
      'total': int(np.asarray(total.addressable_data(0))),
    }
  out['layouts'] = layouts
  return out


def code_trainer_run(
  workdir: str, steps: int, curriculum: bool = False, resume: bool = False, checkpoint_every=0
) -> dict:
  """A smoke-sized run of the code environment on this process group: the tiny model from
  scratch with the code tokenizer, the 'functions' tasks in up to two attempts, every program
  judged by this process's sandbox. `curriculum`: groups of 2, their tasks drawn by the online
  curriculum. `resume`, `checkpoint_every`: as the trainer's.

  Returns:
    rows: the metrics rows (process 0; None elsewhere).
    played: per step, the episodes this process played (its rows of the batch) and the programs
      each ran ({row: programs}).
    programs_run: the programs this process's sandbox judged during the run.
  """
  import dataclasses

  from earl_jax.config import BucketConfig
  from earl_jax.envs import code_env
  from earl_jax.envs.base import CodeEnvConfig
  from earl_jax.envs.curriculum import CurriculumConfig
  from earl_jax.rollout.engine import RolloutConfig
  from earl_jax.rollout.sampler import SamplingConfig
  from earl_jax.run import metrics
  from earl_jax.sandbox import SandboxConfig
  from earl_jax.testing import configs
  from earl_jax.train import trainer

  # A reply with no code ends its episode at -1: a batch's returns differ, so every update moves
  # the policy (an untrained model passes no test: every other return is 0). Feedback lines of at
  # most 40 characters keep a repair turn's prompt under 256 tokens and an episode under 512:
  # one prompt bucket and one context bucket, so that each stage compiles one program.
  env = CodeEnvConfig(
    task='functions',
    max_turns=2,
    invalid_reward=-1.0,
    feedback_chars=40,
    sandbox=SandboxConfig(workers=1),
  )
  config = configs.smoke_experiment(
    model='tiny',
    tokenizer='code',
    env=env,
    eval_env=env.replace(split='heldout'),
    rollout=RolloutConfig(
      num_episodes=8,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=8),
      prompt_buckets=(256,),
    ),
    buckets=BucketConfig(lengths=(512,)),
    steps=steps,
    eval_every=0,
    checkpoint_every=checkpoint_every,
    seed=1,
  )
  if curriculum:
    config = dataclasses.replace(
      config,
      rollout=dataclasses.replace(config.rollout, group_size=2),
      curriculum=CurriculumConfig(enabled=True, memory=0.5),
    )
  t = trainer.Trainer(config, workdir=workdir, resume=resume, log_fn=lambda _: None)
  played: list[dict[str, float]] = []
  roll_out = t.engines.train.run

  def recording_run(*args, **kwargs):
    traj = roll_out(*args, **kwargs)
    programs = traj.env_stats['programs'].tolist()
    played.append({str(r): p for r, p in zip(traj.row_ids.tolist(), programs)})
    return traj

  t.engines.train.run = recording_run
  sandbox = code_env.shared_sandbox(env.sandbox)
  before = sandbox.programs_run
  t.run(progress=False)
  return {
    'rows': metrics.read_jsonl(f'{workdir}/metrics.jsonl') if t.is_main else None,
    'played': played,
    'programs_run': sandbox.programs_run - before,
    'process': jax.process_index(),
  }
