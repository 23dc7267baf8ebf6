"""earl_jax: EARL (arXiv 2510.05943) in JAX.

A Parallelism Selector that picks each RL stage's mesh from the context length and load, and a
Data Dispatcher that moves RL batches between stage layouts with `shard_map` collectives.
"""

__version__ = '0.1.0'
