"""earl_jax.envs."""
