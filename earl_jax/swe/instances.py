"""SWE-bench-style instances: read from JSONL (ours, built by `build`, or SWE-bench, SWE-Gym,
R2E-Gym and SWE-smith instances whose repositories a user has on disk), each with the tree its
bug lives in. `swe_env.check` checks them the way the builder keeps a bug, through the
environment: the gold patch makes every FAIL_TO_PASS and PASS_TO_PASS test pass, and the
repository as it is fails some FAIL_TO_PASS.

Formats (`load(..., format=)`):
  'earl'      ours: `bug_patch` applied to `<dir>/repos/<base>` makes the buggy tree, `patch`
              fixes it; the lists are JSON lists; `test_args` runs the whole suite.
  'swebench'  SWE-bench, SWE-Gym, R2E-Gym: the repository on disk is at the buggy commit
              (`<repos_dir>/<instance_id>`, else `<repos_dir>/<repo with '/' as '__'>`),
              `patch` is the gold fix, `test_patch` the tests that show the bug (applied before
              any test runs); FAIL_TO_PASS / PASS_TO_PASS may be JSON strings of lists.
  'swesmith'  SWE-smith: the repository on disk is clean, `patch` introduces the bug; the gold
              fix is its reverse.

  tasks = instances.load('runs/swe_tasks/instances.jsonl')
  valid, invalid, _ = swe_env.check(config, tasks)     # gold solves, no-op does not
"""

import dataclasses
import functools
import json
import os
from collections.abc import Sequence

from earl_jax.swe import build, patches, testrun

FORMATS = ('earl', 'swebench', 'swesmith')


class InstanceError(ValueError):
  """A JSONL line that is not an instance of the format (the line and field named)."""


@dataclasses.dataclass(frozen=True)
class Instance:
  """One bug to fix: where its tree is, how to make it buggy, what fixes it, what judges it.

  Attributes:
    instance_id / repo / problem_statement: as SWE-bench.
    root: the directory of the tree `bug_patch` applies to.
    bug_patch: the diff that makes the tree buggy ('' when `root` is already buggy).
    patch: the gold fix of the buggy tree.
    test_patch: applied to the buggy tree before tests run (SWE-bench's new tests; '' for ours).
    fail_to_pass / pass_to_pass: the test ids that judge a fix.
    test_args: pytest's arguments for a full run (ours: the suite; else the judged ids).
    tests: the paths that hold tests (an edit there never counts).
    pythonpath: where the code imports from ('src' for a src layout).
    requirements: what the tests need installed (ours); () when the user gives the interpreter.
    kind: the transformation that made the bug (ours), else ''.
  """

  instance_id: str
  repo: str
  problem_statement: str
  root: str
  bug_patch: str
  patch: str
  test_patch: str
  fail_to_pass: tuple[str, ...]
  pass_to_pass: tuple[str, ...]
  test_args: tuple[str, ...]
  tests: tuple[str, ...]
  pythonpath: str = ''
  requirements: tuple[str, ...] = ()
  kind: str = ''

  @property
  def task_id(self) -> str:
    return self.instance_id

  def buggy_files(self) -> dict[str, str]:
    """The tree the policy sees: `root` with `bug_patch` applied."""
    files = dict(_tree(self.root))
    return patches.apply_all(files, self.bug_patch) if self.bug_patch else files

  def judged_files(self, library: dict[str, str]) -> dict[str, str]:
    """What the tests judge: a fresh buggy tree with `library` (path -> text) over it, then
    `test_patch`; the test files are the fresh ones, whatever `library` holds."""
    files = {**self.buggy_files(), **library}
    return patches.apply_all(files, self.test_patch) if self.test_patch else files


@functools.cache
def _tree(root: str) -> dict[str, str]:
  return build.read_tree(root)


def _list(value, field: str, where: str) -> tuple[str, ...]:
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except ValueError:
      raise InstanceError(f'{where}: {field} is a string that is not a JSON list') from None
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise InstanceError(f'{where}: {field} must be a list of test ids')
  return tuple(value)


def _field(row: dict, name: str, where: str) -> str:
  value = row.get(name)
  if not isinstance(value, str):
    raise InstanceError(f'{where}: missing or non-string field {name!r}')
  return value


def _repo_dir(repos_dir: str, row: dict, where: str) -> str:
  for name in (row['instance_id'], row['repo'].replace('/', '__')):
    path = os.path.join(repos_dir, name)
    if os.path.isdir(path):
      return path
  raise InstanceError(
    f'{where}: no repository for it under {repos_dir} (expected a directory '
    f'{row["instance_id"]} or {row["repo"].replace("/", "__")})'
  )


def _test_paths(ids: Sequence[str]) -> tuple[str, ...]:
  return tuple(sorted({i.split('::')[0] for i in ids}))


def parse(row: dict, *, format: str, repos_dir: str, where: str) -> Instance:
  """One instance of a JSONL row.

  Raises:
    InstanceError: a missing field or repository (`where` names the line).
  """
  if format not in FORMATS:
    raise InstanceError(f'format={format!r}: expected one of {FORMATS}')
  for name in ('instance_id', 'repo', 'patch', 'problem_statement'):
    _field(row, name, where)
  f2p = _list(row.get('FAIL_TO_PASS'), 'FAIL_TO_PASS', where)
  p2p = _list(row.get('PASS_TO_PASS', []), 'PASS_TO_PASS', where)
  if not f2p:
    raise InstanceError(f'{where}: FAIL_TO_PASS is empty')
  common = {
    'instance_id': row['instance_id'], 'repo': row['repo'],
    'problem_statement': row['problem_statement'], 'fail_to_pass': f2p, 'pass_to_pass': p2p,
  }  # fmt: skip
  if format == 'earl':
    root = os.path.join(repos_dir, _field(row, 'base', where))
    if not os.path.isdir(root):
      raise InstanceError(f'{where}: no tree {root}')
    test_args = _list(row.get('test_args'), 'test_args', where)
    return Instance(
      **common, root=root, bug_patch=_field(row, 'bug_patch', where), patch=row['patch'],
      test_patch='', test_args=test_args,
      tests=tuple(a for a in test_args if not a.startswith('-')),
      pythonpath=row.get('pythonpath', ''),
      requirements=_list(row.get('requirements', []), 'requirements', where),
      kind=row.get('kind', ''),
    )  # fmt: skip
  root = _repo_dir(repos_dir, row, where)
  judged = tuple(dict.fromkeys(f2p + p2p))
  if format == 'swesmith':
    return Instance(
      **common, root=root, bug_patch=row['patch'], patch=patches.reverse(row['patch']),
      test_patch='', test_args=judged, tests=_test_paths(judged),
    )  # fmt: skip
  test_patch = row.get('test_patch', '')
  return Instance(
    **common, root=root, bug_patch='', patch=row['patch'], test_patch=test_patch or '',
    test_args=judged, tests=_test_paths(judged) + tuple(patches.files(test_patch or '')),
  )  # fmt: skip


def load(path: str, *, format: str = 'earl', repos_dir: str | None = None) -> list[Instance]:
  """The instances of a JSONL file. `repos_dir`: where the trees are (None: ours beside the
  file, `<dir of path>/repos`).

  Raises:
    InstanceError: a line that is not JSON or not an instance (the first one, named).
    FileNotFoundError: no such file.
  """
  repos_dir = repos_dir or os.path.join(os.path.dirname(os.path.abspath(path)), 'repos')
  out = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f'{path}:{number}'
      try:
        row = json.loads(line)
      except ValueError as e:
        raise InstanceError(f'{where}: not JSON ({e})') from None
      if not isinstance(row, dict):
        raise InstanceError(f'{where}: expected a JSON object')
      out.append(parse(row, format=format, repos_dir=repos_dir, where=where))
  return out


def judge(run: testrun.TestRun, instance: Instance) -> tuple[int, int, int, int]:
  """(FAIL_TO_PASS passed, of, PASS_TO_PASS passed, of) in a run."""
  passed = run.passed
  return (
    sum(t in passed for t in instance.fail_to_pass), len(instance.fail_to_pass),
    sum(t in passed for t in instance.pass_to_pass), len(instance.pass_to_pass),
  )  # fmt: skip
