"""Helpers shared by tests, experiments and notebooks."""

import os
import subprocess
import sys
from collections.abc import Mapping

import jax
from flax import nnx

from earl_jax import distributed
from earl_jax.config import ParallelConfig
from earl_jax.models import qwen2
from earl_jax.sharding import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES_DIR = os.path.join(ROOT, 'tests', 'fixtures')


def fixture_path(*parts: str) -> str:
  """Path of a committed fixture (made by scripts/make_qwen2_fixture.py)."""
  return os.path.join(FIXTURES_DIR, *parts)


def entry_point_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
  """This process's environment for a subprocess that runs an entry point: the repository on
  PYTHONPATH, and XLA_FLAGS without the tests' fake-device count (each entry point sets its
  own), keeping the others (the tests' compiler settings); then `extra`."""
  env = {**os.environ, 'PYTHONPATH': ROOT}
  flags = distributed.xla_flags_without_device_count(env.pop('XLA_FLAGS', ''))
  if flags:
    env['XLA_FLAGS'] = ' '.join(flags)
  return {**env, **(extra or {})}


def run_module(
  module: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
  """`python -m module args` from the repository root, as a user runs it, output captured
  (environment: `entry_point_env(env)`)."""
  full = entry_point_env(env)
  return subprocess.run(
    [sys.executable, '-m', module, *args],
    cwd=ROOT,
    env=full,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def small_mesh(dp: int = 1, tp: int = 1, fsdp: int = 1, cp: int = 1) -> jax.sharding.Mesh:
  """A mesh over the first dp * fsdp * cp * tp devices."""
  pc = ParallelConfig(dp=dp, fsdp=fsdp, tp=tp, cp=cp)
  return mesh_lib.make_mesh(pc, mesh_lib.canonical_devices()[: pc.num_devices])


def logprob_fn(graphdef: nnx.GraphDef):
  """(state, tokens_BxT) -> log-probs_BxT, to be jitted under `jax.set_mesh(mesh)`."""

  def fn(state, tokens):
    return qwen2.token_logprobs(nnx.merge(graphdef, state), tokens)

  return fn
