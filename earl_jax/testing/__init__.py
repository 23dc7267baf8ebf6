"""earl_jax.testing."""
