"""Shared test, experiment and notebook helpers: fixture paths, small meshes, tiny models."""

from earl_jax.testing.helpers import (
  FIXTURES_DIR,
  fixture_path,
  logprob_fn,
  small_mesh,
)

__all__ = ['FIXTURES_DIR', 'fixture_path', 'logprob_fn', 'small_mesh']
