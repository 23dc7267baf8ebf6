"""earl_jax.models."""
