"""earl_jax.rl."""
