"""SWE-bench-style instances built from real projects' source (SWE-smith's method, offline).

For each project (its clean tree on disk, an interpreter with its test requirements):
  1. the baseline: the whole suite run `runs` times in the sandbox; a test whose outcome differs
     between runs is flaky and left out of every judgement; one run records the lines the tests
     execute;
  2. the candidates: every mutation site (`mutations`) of the library's modules on a line the
     tests execute, shuffled by the seed, kinds taken in turn (so each kind is tried early);
  3. each candidate's suite run; a bug is kept when a test that passed fails and every other one
     still passes (`testrun.judge`), in each of `runs` runs alike (a flaky test is rejected);
  4. the first `per_project` kept candidates, in candidate order, are the project's instances.

Which candidates are kept depends only on the seed, never on how many run at once. Every
decision is appended to `<out>/.build/<project>.decisions.jsonl` as it is made, so that a cut
build resumes where it stopped. The output:

  <out>/instances.jsonl    one instance per line (SWE-bench's fields: instance_id, repo,
                           version, patch (the gold fix), FAIL_TO_PASS, PASS_TO_PASS,
                           problem_statement; and bug_patch, base, test_args, pythonpath, ...)
  <out>/manifest.json      the projects (version, sha256, licence, tests), counts by kind and
                           rejection, run latencies, the seed
  <out>/repos/<base>/      each project's clean tree (text files), what `bug_patch` applies to

  manifest = build.build([(project, root)], out, BuildConfig(per_project=100),
                         pythons={'toolz': python})
"""

import collections
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import random
import re
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures

from earl_jax.sandbox import Sandbox, SandboxConfig
from earl_jax.swe import mutations, patches, testrun
from earl_jax.swe.sources import Project

_SKIPPED_DIRS = ('.git', '.tox', '__pycache__', 'docs', 'doc')
_LARGEST_FILE = 1 << 20
SLACK_S = 2.0  # added to a bug's time limit (`BuildConfig.timeout_factor`)
# A bug's run that fails to run runs once more, and one that went past its time limit with this
# many times the limit: a loaded machine must not decide which bugs are kept.
CONFIRM_FACTOR = 4.0
# What the problem statement shows of the failing tests.
_SHOWN_TESTS = 5
_MESSAGE_LINES = 4
_MESSAGE_CHARS = 300
# What differs between runs of the same failure: object addresses, the sandbox's directory.
_ADDRESS = re.compile(r'\b0x[0-9a-fA-F]{6,}\b')
_SANDBOX_DIR = re.compile(r'/tmp/w\d+/[\w-]+/')


class BuildError(RuntimeError):
  """A project whose baseline cannot serve (no test passes, the suite does not run)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildConfig:
  """How instances are built.

  Attributes:
    per_project: instances kept per project (the first kept candidates in candidate order).
    seed: the candidates' order.
    runs: runs of the baseline, and of each kept bug, that must agree.
    workers: test runs at once (sandbox workers); 0 = the CPUs this process may use.
    timeout_factor: a bug's run may take this many times the baseline's seconds (plus
      `SLACK_S`); a longer one is stopped and run once more with `CONFIRM_FACTOR` times the
      limit, and a bug past both is rejected as 'slow or hung' (a task whose tests take many
      times the suite's time makes slow episodes; the margin and the second chance keep the
      decision from depending on the machine's load). A run that reports no outcomes also
      runs once more before the bug is rejected as a 'broken run'.
  """

  per_project: int = 100
  seed: int = 0
  runs: int = 2
  workers: int = 0
  timeout_factor: float = 3.0

  def __post_init__(self):
    for name, minimum in (('per_project', 1), ('runs', 1), ('workers', 0), ('seed', 0)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'BuildConfig.{name}={value!r}: expected an int >= {minimum}')
    if not isinstance(self.timeout_factor, int | float) or not self.timeout_factor >= 1:
      raise ValueError(f'BuildConfig.timeout_factor={self.timeout_factor!r}: expected >= 1')


def sandbox_config(workers: int) -> SandboxConfig:
  """The sandbox the tests of a project run in: a whole suite's time, memory and files."""
  return SandboxConfig(
    workers=workers, program_timeout_s=300.0, cpu_s=300, memory_mib=2048, file_mib=64,
    open_files=512, max_processes=64, output_bytes=1 << 22, disk_mib=256,
  )  # fmt: skip


def read_tree(root: str) -> dict[str, str]:
  """The text files of a project's tree (UTF-8, at most 1 MiB each), by relative path, without
  version control, build metadata (*.egg-info) or documentation."""
  files = {}
  for directory, subdirs, names in os.walk(root):
    subdirs[:] = sorted(
      d for d in subdirs if d not in _SKIPPED_DIRS and not d.endswith('.egg-info')
    )
    for name in sorted(names):
      path = os.path.join(directory, name)
      if os.path.islink(path) or os.path.getsize(path) > _LARGEST_FILE:
        continue
      try:
        with open(path, encoding='utf-8') as f:
          files[os.path.relpath(path, root)] = f.read()
      except (UnicodeDecodeError, ValueError):
        continue
  return files


def library_modules(project: Project, files: Mapping[str, str]) -> list[str]:
  """The modules bugs go into: .py files under `project.library`, not under its tests, not
  test or conftest files."""

  def under(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip('/') + '/') for r in roots)

  return sorted(
    path
    for path in files
    if path.endswith('.py')
    and under(path, project.library)
    and not under(path, project.tests)
    and not os.path.basename(path).startswith(('test_', 'conftest'))
  )


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One bug to try: a site in a library module."""

  file: str
  site: mutations.Site

  @property
  def key(self) -> str:
    s = self.site
    return f'{self.file}:{s.line}:{s.col}:{s.end_line}:{s.end_col}:{s.kind}'


def candidates(
  modules: Mapping[str, str], covered: Mapping[str, frozenset[int]], seed: int, name: str
) -> list[Candidate]:
  """Every site of `modules` (path -> source) on a line the tests run, in the order they are
  tried: each kind's sites shuffled by (seed, name), the kinds taken in turn."""
  by_kind = {kind: [] for kind in mutations.KINDS}
  for path in sorted(modules):
    try:
      sites = mutations.sites(modules[path])
    except SyntaxError:
      continue
    ran = covered.get(path, frozenset())
    for site in sites:
      if any(line in ran for line in range(site.line, site.end_line + 1)):
        by_kind[site.kind].append(Candidate(path, site))
  rng = random.Random(f'{seed}/{name}')
  for kind in mutations.KINDS:
    rng.shuffle(by_kind[kind])
  rounds = itertools.zip_longest(*(by_kind[k] for k in mutations.KINDS))
  return [c for round_ in rounds for c in round_ if c is not None]


def stable(runs: Sequence[Mapping[str, str]]) -> tuple[dict[str, str], tuple[str, ...]]:
  """The outcomes every run agrees on, and the tests whose outcome differs (or is missing) in
  some run: the flaky ones."""
  tests = set().union(*runs)
  flaky = tuple(sorted(t for t in tests if len({run.get(t) for run in runs}) > 1))
  outcomes = {t: runs[0][t] for t in sorted(tests) if t not in flaky}
  return outcomes, flaky


def settle(
  baseline: Mapping[str, str], runs: Sequence[Mapping[str, str]], flaky: Sequence[str] = ()
) -> testrun.Judgement | None:
  """A bug's judgement when every run of it judges alike (flaky tests left out), else None."""
  left_out = set(flaky)
  judgements = {
    testrun.judge(baseline, {t: o for t, o in run.items() if t not in left_out}) for run in runs
  }
  return judgements.pop() if len(judgements) == 1 else None


def problem_statement(
  project: Project,
  fail_to_pass: Sequence[str],
  messages: Mapping[str, str],
  total: int,
  hidden: Sequence[str] = (),
) -> str:
  """An issue written from the failing tests' output: which tests fail and how, with no hint of
  where the bug is (a message line that names one of `hidden`, the library's files, is
  dropped), the same on every run (object addresses and the sandbox's directory scrubbed)."""
  count = len(fail_to_pass)
  lines = [
    f'{count} test{"s" if count > 1 else ""} of {project.name} {project.version} '
    f'fail{"" if count > 1 else "s"} ({total} in its suite):',
    '',
  ]
  for test in fail_to_pass[:_SHOWN_TESTS]:
    lines.append(f'  {test}')
    text = _SANDBOX_DIR.sub('', _ADDRESS.sub('0x...', messages.get(test, '')))
    message = [
      x[:_MESSAGE_CHARS]
      for x in text.splitlines()
      if x.strip() and not any(path in x for path in hidden)
    ]
    lines.extend(f'      {x}' for x in message[:_MESSAGE_LINES])
  if count > _SHOWN_TESTS:
    lines.append(f'  ... and {count - _SHOWN_TESTS} more.')
  lines += [
    '',
    'The tests are right: find the bug in the library and fix it, so that these tests pass '
    'and every other test still passes. Do not change the tests.',
  ]
  return '\n'.join(lines)


def instance_id(project: Project, candidate: Candidate) -> str:
  digest = hashlib.sha256(candidate.key.encode()).hexdigest()[:8]
  return f'{project.base}.{candidate.site.kind}.{digest}'


@dataclasses.dataclass(frozen=True)
class _Baseline:
  outcomes: dict[str, str]
  flaky: tuple[str, ...]
  seconds: float
  covered: dict[str, frozenset[int]]


def _write_json(path: str, value) -> None:
  """Written whole or not at all (a temporary file renamed over it)."""
  partial = path + '.partial'
  with open(partial, 'w') as f:
    json.dump(value, f, indent=1, sort_keys=True)
    f.write('\n')
  os.replace(partial, path)


def _read_decisions(path: str) -> dict[str, dict]:
  """The decisions recorded so far (a line cut by a stopped build is ignored)."""
  decisions = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          record = json.loads(line)
        except ValueError:
          break
        decisions[record['key']] = record
  return decisions


class _ProjectBuild:
  """The instances of one project: its baseline, its candidates decided in order, resumed from
  the decisions on disk."""

  def __init__(self, box: Sandbox, project: Project, files: dict[str, str], python: str,
               config: BuildConfig, work_dir: str):  # fmt: skip
    self.box, self.project, self.files, self.python = box, project, files, python
    self.config = config
    self.modules = library_modules(project, files)  # where bugs go, named in no statement
    self.baseline_path = os.path.join(work_dir, f'{project.name}.baseline.json')
    self.decisions_path = os.path.join(work_dir, f'{project.name}.decisions.jsonl')

  def _run(self, files: Mapping[str, str], *, cover: bool = False, timeout_s: float = 300.0):
    return testrun.run_tests(
      self.box, files, python=self.python, paths=self.project.test_args,
      pythonpath=self.project.pythonpath, cover=cover, timeout_s=timeout_s,
    )  # fmt: skip

  def baseline(self) -> _Baseline:
    if os.path.exists(self.baseline_path):
      with open(self.baseline_path) as f:
        saved = json.load(f)
      covered = {k: frozenset(v) for k, v in saved['covered'].items()}
      return _Baseline(saved['outcomes'], tuple(saved['flaky']), saved['seconds'], covered)
    try:
      traced = self._run(self.files, cover=True)
      runs = [traced] + [self._run(self.files) for _ in range(self.config.runs - 1)]
    except testrun.TestRunError as e:
      raise BuildError(f'{self.project.base}: the baseline did not run: {e}') from None
    outcomes, flaky = stable([run.outcomes for run in runs])
    if not any(o == 'passed' for o in outcomes.values()):
      raise BuildError(f'{self.project.base}: no test passes at baseline ({len(flaky)} flaky)')
    seconds = statistics.median(run.seconds for run in runs[1:] or runs)
    _write_json(self.baseline_path, {
      'outcomes': outcomes, 'flaky': list(flaky), 'seconds': seconds,
      'covered': {k: sorted(v) for k, v in traced.covered.items()},
    })  # fmt: skip
    return _Baseline(outcomes, flaky, seconds, traced.covered)

  def _decide(self, baseline: _Baseline, candidate: Candidate, buggy: str) -> dict:
    files = {**self.files, candidate.file: buggy}
    timeout = baseline.seconds * self.config.timeout_factor + SLACK_S
    runs = []
    for _ in range(self.config.runs):
      try:
        try:
          runs.append(self._run(files, timeout_s=timeout))
        except testrun.TestRunError as e:
          longer = CONFIRM_FACTOR if 'ran past' in str(e) else 1.0
          runs.append(self._run(files, timeout_s=timeout * longer))
      except testrun.TestRunError as e:
        why = 'slow or hung' if 'ran past' in str(e) else 'broken run'
        return {'key': candidate.key, 'kept': False, 'why': why, 'seconds': []}
      if testrun.judge(baseline.outcomes, runs[-1].outcomes) is None:
        break  # nothing to confirm
    record = {'key': candidate.key, 'seconds': [round(r.seconds, 3) for r in runs]}
    judgement = settle(baseline.outcomes, [r.outcomes for r in runs], baseline.flaky)
    if judgement is None or len(runs) < self.config.runs:
      flaky = len(runs) == self.config.runs
      return {**record, 'kept': False, 'why': 'flaky' if flaky else 'no test changed as needed'}
    source = self.files[candidate.file]
    statement = problem_statement(
      self.project, judgement.fail_to_pass, runs[0].messages, len(baseline.outcomes),
      hidden=self.modules,
    )  # fmt: skip
    return {**record, 'kept': True, 'why': 'kept', 'instance': {
      'instance_id': instance_id(self.project, candidate),
      'repo': self.project.name,
      'version': self.project.version,
      'base': self.project.base,
      'licence': self.project.licence,
      'kind': candidate.site.kind,
      'patch': patches.make(candidate.file, buggy, source),
      'bug_patch': patches.make(candidate.file, source, buggy),
      'FAIL_TO_PASS': list(judgement.fail_to_pass),
      'PASS_TO_PASS': list(judgement.pass_to_pass),
      'problem_statement': statement,
      'test_args': list(self.project.test_args),
      'pythonpath': self.project.pythonpath,
      'requirements': list(self.project.requirements),
    }}  # fmt: skip

  def run(self, log: Callable[[str], None]) -> tuple[list[dict], dict]:
    """The project's instances (candidate order) and its row of the manifest."""
    baseline = self.baseline()
    modules = {p: self.files[p] for p in self.modules}
    order = candidates(modules, baseline.covered, self.config.seed, self.project.name)
    decisions = _read_decisions(self.decisions_path)
    resumed = len(decisions)
    width = 2 * self.box.workers
    kept: list[dict] = []
    tried = 0
    with open(self.decisions_path, 'a') as out, futures.ThreadPoolExecutor(width) as pool:
      for start in range(0, len(order), width):
        chunk = order[start : start + width]
        pending = {}
        for candidate in chunk:
          if candidate.key in decisions:
            continue
          buggy = mutations.apply(modules[candidate.file], candidate.site)
          if buggy is None:
            decisions[candidate.key] = {'key': candidate.key, 'kept': False, 'why': 'no-op'}
            continue
          pending[candidate.key] = pool.submit(self._decide, baseline, candidate, buggy)
        for candidate in chunk:  # recorded in candidate order, each as soon as it is decided
          if candidate.key in pending:
            decisions[candidate.key] = pending[candidate.key].result()
            out.write(json.dumps(decisions[candidate.key], sort_keys=True) + '\n')
            out.flush()
        for candidate in chunk:
          tried += 1
          if decisions[candidate.key]['kept'] and len(kept) < self.config.per_project:
            kept.append(decisions[candidate.key]['instance'])
        if len(kept) >= self.config.per_project:
          break
        if start // width % 10 == 0:
          log(f'{self.project.base}: {len(kept)} kept of {tried} tried')
    considered = [decisions[c.key] for c in order[:tried]]
    seconds = [s for d in considered for s in d.get('seconds', ())]
    row = {
      'name': self.project.name,
      'version': self.project.version,
      'sha256': self.project.sha256,
      'licence': self.project.licence,
      'tests': len(baseline.outcomes),
      'tests_passing': sum(o == 'passed' for o in baseline.outcomes.values()),
      'flaky': list(baseline.flaky),
      'baseline_seconds': round(baseline.seconds, 3),
      'modules': len(modules),
      'candidates': len(order),
      'tried': tried,
      'resumed': resumed,
      'kept': len(kept),
      'by_kind': dict(collections.Counter(i['kind'] for i in kept)),
      'rejected': dict(collections.Counter(d['why'] for d in considered if not d['kept'])),
      'run_seconds_median': round(statistics.median(seconds), 3) if seconds else None,
    }
    return kept, row


def _copy_tree(files: Mapping[str, str], root: str) -> None:
  """The clean tree at `root`, written whole or not at all."""
  if os.path.isdir(root):
    return
  staging = root + '.partial'
  shutil.rmtree(staging, ignore_errors=True)
  for path, text in files.items():
    target = os.path.join(staging, path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, 'w', encoding='utf-8') as f:
      f.write(text)
  os.replace(staging, root)


def build(
  projects: Sequence[tuple[Project, str]],
  out_dir: str,
  config: BuildConfig,
  *,
  pythons: Mapping[str, str],
  log: Callable[[str], None] = logging.info,
) -> dict:
  """Builds the instances of `projects` (each with its clean tree's root) into `out_dir`,
  resuming what a previous build with the same config left there. `pythons` maps a project's
  name to an interpreter with its test requirements. Returns the manifest.

  Raises:
    BuildError: a project's baseline cannot serve.
  """
  started = time.perf_counter()
  work_dir = os.path.join(out_dir, '.build')
  os.makedirs(work_dir, exist_ok=True)
  settings = {'seed': config.seed, 'runs': config.runs}
  settings_path = os.path.join(work_dir, 'settings.json')
  if os.path.exists(settings_path):
    with open(settings_path) as f:
      previous = json.load(f)
    if previous != settings:
      raise BuildError(
        f'{out_dir} holds a build with {previous}, not {settings}: use another --out'
      )
  else:
    _write_json(settings_path, settings)
  instances, rows = [], []
  with Sandbox(sandbox_config(config.workers)) as box:
    for project, root in projects:
      files = read_tree(root)
      _copy_tree(files, os.path.join(out_dir, 'repos', project.base))
      kept, row = _ProjectBuild(box, project, files, pythons[project.name], config, work_dir).run(
        log
      )
      log(f'{project.base}: {row["kept"]} instances from {row["tried"]} candidates')
      instances += kept
      rows.append(row)
  with open(os.path.join(out_dir, 'instances.jsonl.partial'), 'w') as f:
    for item in instances:
      f.write(json.dumps(item, sort_keys=True) + '\n')
  os.replace(
    os.path.join(out_dir, 'instances.jsonl.partial'), os.path.join(out_dir, 'instances.jsonl')
  )
  seconds = [r['run_seconds_median'] for r in rows if r['run_seconds_median'] is not None]
  manifest = {
    **settings,
    'per_project': config.per_project,
    'projects': rows,
    'instances': len(instances),
    'by_kind': dict(collections.Counter(i['kind'] for i in instances)),
    'seconds': round(time.perf_counter() - started, 1),
    'run_seconds_median': statistics.median(seconds) if seconds else None,
  }
  _write_json(os.path.join(out_dir, 'manifest.json'), manifest)
  return manifest
