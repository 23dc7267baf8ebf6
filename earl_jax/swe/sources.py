"""Pinned source distributions of real Python projects, fetched from a package index (PyPI's
simple API, PEP 691 JSON) and checked against their pinned sha256, then unpacked safely.

The projects (`PROJECTS`) are pure Python, ship their test suites in their sdists, and carry
permissive licences (recorded from each sdist's PKG-INFO). A fetched archive is cached by file
name; a cached one is checked again before use.

  project = sources.PROJECTS['toolz']
  root = sources.fetch(project, cache_dir='.earl_cache/swe')   # .../toolz-1.0.0/
  sources.licence(root)                                        # 'BSD'
"""

import dataclasses
import hashlib
import json
import os
import re
import tarfile
import urllib.request

PYPI = 'https://pypi.org/simple'
PYTEST = 'pytest==8.3.4'  # of these projects' time (boltons' conftest uses a hook pytest 9 removed)
_ACCEPT = 'application/vnd.pypi.simple.v1+json'


class SourceError(RuntimeError):
  """An archive that cannot be found, fetched or trusted (its hash, its members)."""


@dataclasses.dataclass(frozen=True)
class Project:
  """A pinned project: its PyPI name, version, the sdist's sha256, its licence as its PKG-INFO
  says; where its library code and its tests are (paths relative to the sdist's root), the test
  files left out (`ignore`: they need what the sandbox forbids, e.g. sockets), the directory its
  code imports from (`pythonpath`: 'src' for a src layout), and what its tests need installed."""

  name: str
  version: str
  sha256: str
  licence: str
  tests: tuple[str, ...]
  library: tuple[str, ...]
  ignore: tuple[str, ...] = ()
  pythonpath: str = ''
  requirements: tuple[str, ...] = (PYTEST,)

  @property
  def archive(self) -> str:
    return f'{self.name}-{self.version}.tar.gz'

  @property
  def base(self) -> str:
    """The name of its clean tree (the sdist's root directory)."""
    return f'{self.name}-{self.version}'

  @property
  def test_args(self) -> tuple[str, ...]:
    """pytest's arguments for the whole suite."""
    return (*self.tests, *(f'--ignore={path}' for path in self.ignore))


# Checked on 2026-12-05 (sha256 of the sdist on PyPI; licence from its PKG-INFO).
PROJECTS = {
  p.name: p
  for p in (
    Project(
      'toolz', '1.0.0', '2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02',
      'BSD', tests=('toolz/tests',), library=('toolz',),
    ),
    Project(
      'boltons', '24.1.0', '4a49b7d57ee055b83a458c8682a2a6f199d263a8aa517098bda9bab813554b87',
      'BSD', tests=('tests',), library=('boltons',),
      ignore=('tests/test_socketutils.py',),  # servers on sockets: the sandbox has no network
    ),
    Project(
      'inflection', '0.5.1', '1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417',
      'MIT', tests=('test_inflection.py',), library=('inflection',),
    ),
    Project(
      'tabulate', '0.9.0', '0095b12bf5966de529c0feb1fa08671671b3368eec77d7ef7ab114be2c068b3c',
      'MIT', tests=('test',), library=('tabulate',),
    ),
    Project(
      'cachetools', '5.5.0', '2cc24fb4cbe39633fb7badd9db9ca6295d766d9c2995f245725a46715d050f2a',
      'MIT', tests=('tests',), library=('src/cachetools',), pythonpath='src',
    ),
    Project(
      'parse', '1.20.2', 'b41d604d16503c79d81af5165155c0b20f6c8d6c559efa66b4b695c3e5a0a0ce',
      'MIT', tests=('tests',), library=('parse.py',),
    ),
  )
}  # fmt: skip


def _normalise(name: str) -> str:
  return re.sub(r'[-_.]+', '-', name).lower()


def find_sdist(name: str, version: str, *, index: str = PYPI) -> tuple[str, str]:
  """(url, sha256) of `name`'s sdist `version` on a PEP 691 index.

  Raises:
    SourceError: the index does not answer, or lists no such sdist.
  """
  url = f'{index.rstrip("/")}/{_normalise(name)}/'
  request = urllib.request.Request(url, headers={'Accept': _ACCEPT})
  try:
    with urllib.request.urlopen(request, timeout=60) as response:
      listing = json.load(response)
  except (OSError, ValueError) as e:
    raise SourceError(f'{name}: the index at {url} did not answer: {e}') from None
  for entry in listing.get('files', ()):
    filename = entry.get('filename', '')
    if filename.endswith(f'-{version}.tar.gz') and _normalise(
      filename[: -len(f'-{version}.tar.gz')]
    ) == _normalise(name):
      return entry['url'], entry.get('hashes', {}).get('sha256', '')
  raise SourceError(f'{name}: the index lists no sdist of version {version} ({url}).')


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def fetch(project: Project, cache_dir: str, *, index: str = PYPI) -> str:
  """The unpacked sdist of `project` under `cache_dir` (fetched once, its hash checked every
  time; unpacked with tarfile's 'data' filter: no absolute paths, links out of it or devices).
  Returns the path of its root directory.

  Raises:
    SourceError: not found, a hash that differs from the pinned one, or an unsafe archive.
  """
  os.makedirs(cache_dir, exist_ok=True)
  archive = os.path.join(cache_dir, project.archive)
  if not os.path.exists(archive):
    url, listed = find_sdist(project.name, project.version, index=index)
    if listed and listed != project.sha256:
      raise SourceError(
        f'{project.name} {project.version}: the index lists sha256 {listed}, pinned '
        f'{project.sha256}.'
      )
    partial = archive + '.part'
    try:
      urllib.request.urlretrieve(url, partial)
    except OSError as e:
      raise SourceError(f'{project.name}: could not fetch {url}: {e}') from None
    os.replace(partial, archive)
  got = _sha256(archive)
  if got != project.sha256:
    os.remove(archive)
    raise SourceError(
      f'{project.archive}: sha256 {got}, pinned {project.sha256}: removed from the cache.'
    )
  root = os.path.join(cache_dir, f'{project.name}-{project.version}')
  if not os.path.isdir(root):
    staging = root + '.unpacking'
    with tarfile.open(archive) as tar:
      try:
        tar.extractall(staging, filter='data')
      except tarfile.FilterError as e:
        raise SourceError(f'{project.archive}: unsafe member: {e}') from None
    tops = os.listdir(staging)
    if len(tops) != 1:
      raise SourceError(f'{project.archive}: expected one top directory, got {sorted(tops)}')
    os.replace(os.path.join(staging, tops[0]), root)
    os.rmdir(staging)
  return root


def licence(root: str) -> str:
  """The licence the sdist's PKG-INFO states (License-Expression, else License, else the first
  'License ::' classifier's last part, e.g. 'MIT' for '... :: MIT License'; '' when it states
  none)."""
  with open(os.path.join(root, 'PKG-INFO'), encoding='utf-8', errors='replace') as f:
    info = f.read()
  for pattern in (r'^License-Expression: (.+)$', r'^License: (.+)$'):
    match = re.search(pattern, info, re.M)
    if match and len(match.group(1).strip()) < 40:
      return match.group(1).strip()
  match = re.search(r'^Classifier: License :: (?:.* :: )?(.+)$', info, re.M)
  return match.group(1).strip().removesuffix(' License') if match else ''
