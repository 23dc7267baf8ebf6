"""earl_jax.rollout."""
