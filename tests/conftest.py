"""Test harness: 8 fake CPU devices, the persistent compilation cache, runtime shape checks.

The XLA flag must be set before JAX is imported anywhere, so this module sets it first thing.
Tests that need another device count or several processes run in subprocesses
(`earl_jax.testing.multiprocess`), never by changing flags here.
"""

import os

_flags = [
  f for f in os.environ.get('XLA_FLAGS', '').split() if 'host_platform_device_count' not in f
]
# The tests compile hundreds of small programs whose kernels then run for microseconds; LLVM's
# optimisation of those kernels is about a third of each compile. Subprocesses inherit the
# setting; an opt level in the caller's XLA_FLAGS wins.
if not any('xla_backend_optimization_level' in f for f in _flags):
  _flags.append('--xla_backend_optimization_level=0')
os.environ['XLA_FLAGS'] = ' '.join([*_flags, '--xla_force_host_platform_device_count=8'])
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(_ROOT, '.jax_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')

# Shape-typed signatures (jaxtyping) are checked at runtime while tests trace them.
from jaxtyping import install_import_hook  # noqa: E402

import earl_jax.testing.typecheck  # noqa: E402,F401  (the checker must exist before the hook)

install_import_hook('earl_jax', 'earl_jax.testing.typecheck.checker')

import jax  # noqa: E402

jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
jax.config.update('jax_numpy_rank_promotion', 'raise')
