"""SWE instances for tests: the committed miniature project (tests/fixtures/swe/minicalc-0.1)
built into instances with this interpreter (it has pytest), as `build_swe_tasks` builds real
projects.

  path = swe.mini_instances(str(tmp_path))     # .../instances.jsonl (repos/ beside it)
"""

import os
import sys

from earl_jax.swe import build
from earl_jax.swe.sources import Project
from earl_jax.testing.helpers import fixture_path

MINICALC = Project(
  'minicalc', '0.1', sha256='', licence='MIT', tests=('tests',), library=('minicalc',),
  requirements=(),
)  # fmt: skip


def mini_instances(out_dir: str, per_project: int = 8, seed: int = 0) -> str:
  """Builds (or finds, built) the miniature project's instances under `out_dir`; returns the
  path of their JSONL."""
  path = os.path.join(out_dir, 'instances.jsonl')
  if not os.path.exists(path):
    build.build(
      [(MINICALC, fixture_path('swe', 'minicalc-0.1'))], out_dir,
      build.BuildConfig(per_project=per_project, seed=seed, workers=2),
      pythons={'minicalc': sys.executable}, log=lambda _: None,
    )  # fmt: skip
  return path
