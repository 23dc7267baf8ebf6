"""earl_jax.selector."""
