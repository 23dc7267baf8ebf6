"""Process-wide JAX settings, applied by entry points (experiments, notebooks), never on import.

def main(argv):
  runtime.setup(cpu_devices=8)     # before any other JAX call
"""

import os

from absl import logging

DEFAULT_CACHE_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '.jax_cache'
)


def setup(*, cpu_devices: int | None = None, cache_dir: str | None = None) -> None:
  """Persistent compilation cache, and `cpu_devices` fake devices when running on CPU.

  Must run before JAX initialises its backends. Multi-process entry points call
  `distributed.initialize_from_env()` first (it sets the device count itself).
  """
  import jax  # imported here, after the caller had a chance to set environment variables

  cache_dir = cache_dir or os.environ.get('JAX_COMPILATION_CACHE_DIR') or DEFAULT_CACHE_DIR
  jax.config.update('jax_compilation_cache_dir', cache_dir)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
  platforms = os.environ.get('JAX_PLATFORMS', '')
  wants_fake_devices = (
    cpu_devices
    and platforms in ('', 'cpu')
    and 'host_platform_device_count' not in os.environ.get('XLA_FLAGS', '')
    and (platforms == 'cpu' or not _has_accelerator())
  )
  if wants_fake_devices:
    jax.config.update('jax_num_cpu_devices', cpu_devices)
  logging.info('JAX %s, devices: %s', jax.__version__, jax.devices())


def _has_accelerator() -> bool:
  """Whether a GPU/TPU plugin is installed (without initialising any backend)."""
  import importlib.util

  return any(
    importlib.util.find_spec(name) is not None
    for name in ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'libtpu', 'jax_rocm60_plugin')
  )
