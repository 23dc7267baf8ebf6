"""Builds SWE-bench-style bug-fixing instances from real Python projects, offline after the
first fetch (earl_jax.swe.build: SWE-smith's method in our sandbox).

  python -m experiments.build_swe_tasks --out=runs/swe_tasks
  python -m experiments.build_swe_tasks --projects=toolz,parse --per_project=20 --out=runs/swe_small

Each project's pinned sdist is fetched from the package index (sha256 checked) and its test
requirements installed into a cached virtualenv (both under --cache_dir, which must not be under
/tmp). A cut build continues where it stopped when run again with the same --out. Prints one row
per project and writes <out>/instances.jsonl and <out>/manifest.json.
"""

import os

from absl import flags, logging

from earl_jax import errors, runtime
from earl_jax.swe import build, sources, venvs

_PROJECTS = flags.DEFINE_list(
  'projects', list(sources.PROJECTS), f'Projects to build from, of {list(sources.PROJECTS)}.'
)
_OUT = flags.DEFINE_string('out', 'runs/swe_tasks', 'Directory of the instances.')
_PER_PROJECT = flags.DEFINE_integer('per_project', 100, 'Instances per project.', lower_bound=1)
_SEED = flags.DEFINE_integer('seed', 0, "The candidates' order.", lower_bound=0)
_RUNS = flags.DEFINE_integer('runs', 2, 'Runs that must agree (baseline and bug).', lower_bound=1)
_WORKERS = flags.DEFINE_integer('workers', 0, 'Test runs at once (0: the CPUs).', lower_bound=0)
_CACHE = flags.DEFINE_string(
  'cache_dir', '.earl_cache/swe', 'Where sdists and virtualenvs are cached (not under /tmp).'
)
_INDEX = flags.DEFINE_string('index', sources.PYPI, 'A PEP 691 package index.')


def _projects() -> list[sources.Project]:
  unknown = [name for name in _PROJECTS.value if name not in sources.PROJECTS]
  if unknown or not _PROJECTS.value:
    raise errors.UserError(
      f'--projects={",".join(_PROJECTS.value)}: unknown {unknown}; expected some of '
      f'{list(sources.PROJECTS)}'
    )
  return [sources.PROJECTS[name] for name in dict.fromkeys(_PROJECTS.value)]


def _prepare(projects, cache: str) -> tuple[list, dict[str, str]]:
  """Each project's clean tree and an interpreter with its test requirements (both cached)."""
  trees, pythons = [], {}
  for project in projects:
    trees.append(
      (project, sources.fetch(project, os.path.join(cache, 'sdists'), index=_INDEX.value))
    )
    pythons[project.name] = venvs.ensure(
      os.path.join(cache, 'venvs'), project.requirements,
      index_url=None if _INDEX.value == sources.PYPI else _INDEX.value,
    )  # fmt: skip
    logging.info('%s: tree and interpreter ready', project.base)
  return trees, pythons


def main(argv):
  del argv
  projects = _projects()
  cache = os.path.abspath(_CACHE.value)
  if cache == '/tmp' or cache.startswith('/tmp/'):
    raise errors.UserError(f'--cache_dir={_CACHE.value}: the sandbox hides /tmp; use another')
  config = build.BuildConfig(
    per_project=_PER_PROJECT.value, seed=_SEED.value, runs=_RUNS.value, workers=_WORKERS.value
  )
  try:
    trees, pythons = _prepare(projects, cache)
    manifest = build.build(trees, _OUT.value, config, pythons=pythons, log=print)
  except (sources.SourceError, venvs.VenvError, build.BuildError) as e:
    raise errors.UserError(str(e)) from None
  print(f'{"project":<20} {"licence":<8} {"tests":>6} {"kept":>5} {"tried":>6} {"run s":>6}  kinds')
  for row in manifest['projects']:
    kinds = ', '.join(f'{k} {n}' for k, n in sorted(row['by_kind'].items()))
    print(
      f'{row["name"] + "-" + row["version"]:<20} {row["licence"]:<8} {row["tests_passing"]:>6} '
      f'{row["kept"]:>5} {row["tried"]:>6} {row["run_seconds_median"] or 0:>6.2f}  {kinds}'
    )
  print(
    f'{manifest["instances"]} instances in {manifest["seconds"]:.0f} s '
    f'(median test run {manifest["run_seconds_median"]:.2f} s): {_OUT.value}/instances.jsonl'
  )


if __name__ == '__main__':
  runtime.run(main)
