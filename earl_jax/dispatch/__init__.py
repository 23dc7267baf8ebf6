"""earl_jax.dispatch."""
