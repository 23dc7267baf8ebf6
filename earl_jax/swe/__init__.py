"""Software-engineering tasks from real Python projects (SWE-smith's method, offline): pinned
sdists that ship their tests (`sources`), bugs injected by AST transformations (`mutations`),
kept when tests that passed now fail and the rest still pass (`testrun`: the tests run in the
sandbox), with the inverse edit as the gold patch (`patches`: unified diffs made and applied
strictly).

  from earl_jax.swe import mutations, patches
  site = mutations.sites(source)[0]
  buggy = mutations.apply(source, site)
  gold = patches.make('pkg/mod.py', buggy, source)     # what fixes it
"""
