"""Software-engineering tasks from real Python projects (SWE-smith's method, offline): bugs
injected by AST transformations (`mutations`), kept when tests that passed now fail, with the
inverse edit as the gold patch (`patches`: unified diffs made and applied strictly).

  from earl_jax.swe import mutations, patches
  site = mutations.sites(source)[0]
  buggy = mutations.apply(source, site)
  gold = patches.make('pkg/mod.py', buggy, source)     # what fixes it
"""
