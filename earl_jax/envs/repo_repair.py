"""Repository repair: fix a planted bug in a small generated repository with text tools.

Each episode gets its own copy of a generated repository (`RepoTask`) of three files:
  nums.py       two functions of an int, from the 'functions' templates of `code_tasks`;
  words.py      a function of a str and one of a list of ints;
  test_repo.py  two asserts per function and a runner: `python test_repo.py` prints one
                'FAIL test_<name>: AssertionError <got>' line per failing test, then
                'N failed' or 'all tests passed', and exits 1 or 0.
One function's one-line body carries a planted bug: another parameter of its template or a
swapped operator (x*3+1 -> x*3-1), always caught by one of the visible tests and by the hidden
ones. The repository lives in the environment (a dict of file texts); every command that runs
code writes it into a fresh private directory of the sandbox.

Commands, one per reply (leading blank lines ignored, a reply wrapped in one Markdown code fence
unwrapped; the first line names the command):
  view FILE           the file, one 'N|text' line per line (N from 1)
  view FILE A B       lines A..B only
  replace FILE A B    the reply's following lines replace lines A..B (1-based, inclusive; B =
                      A - 1 inserts before line A; no following lines deletes A..B); a Markdown
                      code fence around the new lines is allowed
  run                 runs `python test_repo.py`: its output (head and tail kept,
                      `CodeEnvConfig.output_chars`) and exit code
  submit              ends the episode: the hidden tests judge the repository
A reply whose first line is no command, or longer than `max_reply_chars`, ends the episode as
'invalid' (`invalid_reward`). A command with a bad argument (no such file, lines out of range)
answers 'error: ...' and the episode goes on. The last turn submits after its command.

Reward: the hidden tests (`TestCase`s that call the functions of nums.py and words.py, on
inputs the visible tests do not use) are run by the sandbox on the submitted repository, never
by its test file, so editing or deleting test_repo.py gains nothing: the reward is 1 when every
one passes (outcome 'win'), else 0 ('loss'); or their pass fraction with
`CodeEnvConfig.reward='fraction'`.

Tasks are numbered 0..NUM_REPOS-1, each generated from its own seed; `CodeEnvConfig.split_seed`
shuffles the numbers and the first `heldout_fraction` of them are 'heldout', the rest 'train'.
All programs of a step (hidden checks and test runs) go to the sandbox together.
"""

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from earl_jax.envs import base, code_env, code_tasks
from earl_jax.sandbox import Program, TestCase, Verdict

NUM_REPOS = 1000
TEST_FILE = 'test_repo.py'
MODULES = ('nums', 'words')
VISIBLE_PER_FUNCTION = 2
HIDDEN_PER_FUNCTION = 3
# What each template's function is called in a repository.
FUNCTION_NAMES = {
  'affine': 'scale',
  'square': 'lift',
  'mod': 'wrap',
  'div': 'bucket',
  'max': 'at_least',
  'dist': 'distance',
  'repeat': 'repeat',
  'reverse': 'backwards',
  'append': 'suffix',
  'count': 'count_char',
  'prefix': 'head',
  'upper': 'shout',
  'add_each': 'shift_all',
  'mul_each': 'scale_all',
  'sum': 'total',
  'max_item': 'largest',
  'sorted': 'ordered',
  'above': 'above',
  'len': 'weight',
  'shift_mul': 'shift_scale',
  'mod_add': 'wrap_up',
  'div_add': 'bucket_up',
  'max_add': 'floor_up',
  'dist_mul': 'spread',
  'affine_each': 'scale_shift_all',
}
# Wrong bodies for the templates without parameters (the others also get other parameters).
_EXTRA_MUTANTS = {
  'reverse': ('s[:-1]', 's'),
  'upper': ('s.lower()', 's.title()'),
  'max_item': ('min(xs)', 'xs[0]'),
  'sorted': ('xs', 'sorted(xs)[::-1]'),
}
_OPERATOR_SWAPS = (('+', '-'), ('*', '+'), ('>', '>='), ('//', '%'), ('%', '//'))
# test_repo.py: this head, the test functions, then this main.
_TEST_HEAD = """import nums
import words


def _ok(test):
    try:
        test()
        return True
    except Exception as e:
        print('FAIL', test.__name__ + ':', type(e).__name__, e)
        return False"""
_TEST_MAIN = """


if __name__ == '__main__':
    failed = [n for n, t in sorted(globals().items()) if n.startswith('test_') and not _ok(t)]
    print(f'{len(failed)} failed' if failed else 'all tests passed')
    raise SystemExit(1 if failed else 0)
"""
# Runs test_repo.py as __main__; returns its exit code (what it prints is the program's output).
_TEST_RUNNER = """import runpy
import sys
import traceback


def _run_tests():
    try:
        runpy.run_path('test_repo.py', run_name='__main__')
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc(limit=2)
        return 1
    finally:
        sys.stdout.flush()
    return 0
"""
_COMMAND = re.compile(r'(view|replace|run|submit)(?:[ \t]+(.*))?')
_INT = r'\s+(-?\d+)'
_VIEW = re.compile(r'(\S+)(?:' + _INT + _INT + r')?\s*')
_REPLACE = re.compile(r'(\S+)' + _INT + _INT + r'\s*')

INTRO = (
  'Fix the bug in this repository so that its tests pass.\n'
  'files: nums.py words.py test_repo.py\n'
  'commands: view FILE [A B] | replace FILE A B + new lines | run | submit\n'
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepoTask:
  """A generated repository with one planted bug.

  Attributes:
    task_id: 'repo/<k>'.
    files: file name -> text, the buggy repository.
    hidden_tests: calls of the modules' functions ('nums.scale(5)') and their expected values.
    bug_file / bug_line: where the bug is (line numbers from 1).
    fixed_line: the line that fixes it.
  """

  task_id: str
  files: Mapping[str, str]
  hidden_tests: tuple[TestCase, ...]
  bug_file: str
  bug_line: int
  fixed_line: str

  def reference_commands(self) -> list[str]:
    """A scripted repair, one reply per turn: run the tests, view the file, patch it, submit."""
    patch = f'replace {self.bug_file} {self.bug_line} {self.bug_line}\n{self.fixed_line}\n'
    return ['run', f'view {self.bug_file}', patch, 'submit']

  def fixed_files(self) -> dict[str, str]:
    """The repository with the bug fixed (the reference patch)."""
    files = dict(self.files)
    lines = files[self.bug_file].split('\n')
    lines[self.bug_line - 1] = self.fixed_line
    files[self.bug_file] = '\n'.join(lines)
    return files


def _mutants(template: code_tasks.Template, params: dict[str, Any]) -> list[str]:
  body = template.body.format(**params)
  wrong = [template.body.format(**other) for other in template.params if other != params]
  wrong += list(_EXTRA_MUTANTS.get(template.name, ()))
  wrong += [body.replace(a, b, 1) for a, b in _OPERATOR_SWAPS if a in body]
  return [w for w in dict.fromkeys(wrong) if w != body]


def _outputs(body: str, arg: str, inputs: Sequence[Any]) -> list[Any]:
  """What a one-line body returns on each input (our own generated code, run here)."""
  fn = eval(f'lambda {arg}: {body}')  # trusted template text, never model output
  results = []
  for x in inputs:
    try:
      results.append(fn(x))
    except Exception as e:  # a mutant may raise; that differs from any value
      results.append(e)
  return results


@dataclasses.dataclass(frozen=True)
class _Function:
  """One function of a generated repository and the inputs of its tests."""

  module: str
  template: code_tasks.Template
  params: dict[str, Any]
  visible: list[Any]  # inputs of the asserts in test_repo.py
  hidden: list[Any]  # inputs of the hidden tests

  @property
  def name(self) -> str:
    return FUNCTION_NAMES[self.template.name]

  @property
  def body(self) -> str:
    return self.template.body.format(**self.params)

  def expected(self, x: Any) -> Any:
    return self.template.fn(**self.params)(x)


def _pick_functions(rng: np.random.Generator) -> list[_Function]:
  """Two int functions for nums.py, a str and a list function for words.py."""
  by_arg = {arg: [t for t in code_tasks.TEMPLATES if t.arg == arg] for arg in ('x', 's', 'xs')}
  first, second = rng.choice(len(by_arg['x']), 2, replace=False).tolist()
  chosen = [by_arg['x'][first], by_arg['x'][second]]
  chosen += [by_arg[arg][int(rng.integers(len(by_arg[arg])))] for arg in ('s', 'xs')]
  functions = []
  for k, template in enumerate(chosen):
    params = template.params[int(rng.integers(len(template.params)))]
    count = VISIBLE_PER_FUNCTION + HIDDEN_PER_FUNCTION
    inputs = code_tasks.distinct_inputs(template.arg, rng, count)
    visible, hidden = inputs[:VISIBLE_PER_FUNCTION], inputs[VISIBLE_PER_FUNCTION:]
    functions.append(_Function(MODULES[k // 2], template, params, visible, hidden))
  return functions


def _plant_bug(functions: list[_Function], rng: np.random.Generator) -> tuple[int, str]:
  """(which function, its wrong body): a mutant caught by a visible and by a hidden test."""
  for k in rng.permutation(len(functions)).tolist():
    function = functions[k]
    arg = function.template.arg
    caught = [
      mutant
      for mutant in _mutants(function.template, function.params)
      if _outputs(mutant, arg, function.visible) != [function.expected(x) for x in function.visible]
      and _outputs(mutant, arg, function.hidden) != [function.expected(x) for x in function.hidden]
    ]
    if caught:
      return k, caught[int(rng.integers(len(caught)))]
  raise AssertionError('no mutant of any function is caught by its tests.')


@functools.cache
def make_repo_task(index: int) -> RepoTask:
  """Repository number `index`, the same every time (see the module docstring)."""
  task_id = f'repo/{index}'
  rng = code_tasks.task_rng(task_id)
  functions = _pick_functions(rng)
  bug, mutant = _plant_bug(functions, rng)
  files, tests, hidden_tests = {}, [], []
  bug_line = 0
  for module, title in zip(MODULES, ('Number', 'Text and list')):
    lines = [f'"""{title} helpers."""']
    for k, function in enumerate(functions):
      if function.module != module:
        continue
      lines += ['', '', f'def {function.name}({function.template.arg}):']
      if k == bug:
        bug_line = len(lines) + 1
      lines.append(f'    return {mutant if k == bug else function.body}')
      tests += ['', '', f'def test_{function.name}():']
      for x in function.visible:
        call = f'{module}.{function.name}({x!r})'
        tests.append(f'    assert {call} == {function.expected(x)!r}, {call}')
      hidden_tests += [
        TestCase(call=f'{module}.{function.name}({x!r})', expected=function.expected(x))
        for x in function.hidden
      ]
    files[f'{module}.py'] = '\n'.join(lines) + '\n'
  files[TEST_FILE] = '\n'.join([_TEST_HEAD, *tests]) + _TEST_MAIN
  return RepoTask(
    task_id=task_id,
    files=files,
    hidden_tests=tuple(hidden_tests),
    bug_file=f'{functions[bug].module}.py',
    bug_line=bug_line,
    fixed_line=f'    return {functions[bug].body}',
  )


def repo_task_indices(split: str, split_seed: int, heldout_fraction: float) -> list[int]:
  """The repository numbers of a split (see the module docstring)."""
  if split not in base.CODE_SPLITS:
    raise ValueError(f'Unknown split {split!r}; known splits: {list(base.CODE_SPLITS)}.')
  order = np.random.default_rng(split_seed).permutation(NUM_REPOS)
  num_heldout = math.ceil(heldout_fraction * NUM_REPOS)
  chosen = order[:num_heldout] if split == 'heldout' else order[num_heldout:]
  return sorted(chosen.tolist())


def numbered(name: str, text: str, first: int = 1, last: int | None = None) -> str:
  """'name:' then lines first..last of `text` as 'N|line'."""
  lines = text.split('\n')
  if lines and lines[-1] == '':
    lines = lines[:-1]
  last = len(lines) if last is None else last
  shown = ''.join(f'{n}|{lines[n - 1]}\n' for n in range(first, last + 1))
  return f'{name}:\n{shown}'


class RepoRepairEnv(code_env.CodeEpisodes):
  """B episodes of repairing a generated repository (see the module docstring)."""

  def __init__(
    self,
    config: base.CodeEnvConfig,
    *,
    tasks: Sequence[RepoTask] | None = None,
    sandbox: code_env.ProgramChecker | None = None,
  ):
    """An environment of `config` (task 'repo_repair').

    Args:
      config: the code config.
      tasks: the repositories to play instead of `config`'s split (tests).
      sandbox: the sandbox to run programs in; None: `code_env.shared_sandbox(config.sandbox)`.
    """
    if config.task != 'repo_repair':
      raise ValueError(f'RepoRepairEnv plays repo_repair, not {config.task!r}.')
    super().__init__(config, sandbox)
    if tasks is None:
      indices = repo_task_indices(config.split, config.split_seed, config.heldout_fraction)
      self._task_of = lambda k: make_repo_task(indices[k])  # built when first played
      self._num_tasks = len(indices)
    else:
      fixed = tuple(tasks)
      self._task_of = fixed.__getitem__
      self._num_tasks = len(fixed)
    self._files: list[dict[str, str]] = []

  @property
  def files(self) -> list[dict[str, str]]:
    """A copy of each episode's repository now."""
    return [dict(files) for files in self._files]

  def reset(
    self, n: int, seed: int, *, group_size: int = 1, rows: Sequence[int] | None = None
  ) -> list[str]:
    """Starts n episodes (or the subset `rows`); see `base.TextEnv.reset`."""
    _, task_index = code_env.assign(self._num_tasks, n, seed, group_size, rows)
    self._start([self._task_of(k) for k in task_index.tolist()])
    self._files = [dict(task.files) for task in self._episode_tasks]
    return [INTRO] * len(self._files)

  def step(self, actions: Sequence[str]) -> base.StepResult:
    """Runs one command per episode; see the module docstring.

    Raises:
      RuntimeError: before `reset`.
      ValueError: `actions` is a single str or does not hold one reply per episode.
      SandboxError: the sandbox itself failed.
    """
    rewards, observations, infos, active = self._begin_step(actions)
    config = self.config
    runs, submits = [], []
    for i in active:
      last_turn = self._turns[i] + 1 >= self.max_turns
      command = self._command(actions[i])
      if command is None:
        self._outcomes[i] = 'invalid'
        rewards[i] = config.invalid_reward
        observations[i] = 'invalid\n'
        infos[i] = self._info(i)
      elif command[0] == 'submit' or last_turn:
        if command[0] in ('view', 'replace'):
          self._edit_or_view(i, command)  # its answer is never read: the episode ends
        submits.append(i)
      elif command[0] == 'run':
        runs.append(i)
      else:
        observations[i] = self._edit_or_view(i, command)
        infos[i] = self._info(i)
    programs = [self._test_run(i) for i in runs] + [self._hidden_check(i) for i in submits]
    verdicts = self._run_programs(programs, runs + submits)
    for i, verdict in zip(runs, verdicts[: len(runs)]):
      observations[i] = self._run_output(verdict)
      infos[i] = self._info(i, status=verdict.status)
    for i, verdict in zip(submits, verdicts[len(runs) :]):
      passed, total = verdict.passed, len(self._episode_tasks[i].hidden_tests)
      if len(verdict.results) != total:
        passed = 0
      self._outcomes[i] = 'win' if passed == total else 'loss'
      rewards[i] = config.reward_of(passed, total)
      observations[i] = f'passed {passed}/{total} hidden tests\n'
      infos[i] = self._info(i, status=verdict.status, passed=passed, total=total)
    return self._end_step(active, observations, rewards, infos)

  def _command(self, reply: object) -> tuple | None:
    """A parsed command ('view', file, a, b) / ('replace', file, a, b, lines) / ('run',) /
    ('submit',), or None when the reply is not one."""
    if not isinstance(reply, str) or len(reply) > self.config.max_reply_chars:
      return None
    whole = code_env.CODE_FENCE.match(reply.strip())  # a command inside one code fence
    if whole is not None:
      reply = whole.group(1)
    first, _, rest = reply.lstrip('\n').partition('\n')
    match = _COMMAND.fullmatch(first.strip())
    if match is None:
      return None
    verb, args = match.group(1), match.group(2) or ''
    if verb in ('run', 'submit'):
      return (verb,) if not args.strip() else None
    if verb == 'view':
      view = _VIEW.fullmatch(args)
      if view is None:
        return None
      name, a, b = view.groups()
      return ('view', name, None if a is None else int(a), None if b is None else int(b))
    replace = _REPLACE.fullmatch(args)
    if replace is None:
      return None
    fence = code_env.CODE_FENCE.search(rest)
    text = code_env.encodable(fence.group(1) if fence else rest)
    lines = text.split('\n')
    if lines and lines[-1] == '':
      lines = lines[:-1]
    name, a, b = replace.groups()
    return ('replace', name, int(a), int(b), lines)

  def _edit_or_view(self, i: int, command: tuple) -> str:
    """Applies a view or replace command to episode i's repository; returns the answer."""
    files, name = self._files[i], command[1]
    if name not in files:
      return code_env.printable(f'error: no file {name!r}; files: {" ".join(files)}\n')
    lines = files[name].split('\n')
    if lines[-1] == '':
      lines = lines[:-1]
    count = len(lines)
    if command[0] == 'view':
      a, b = command[2] or 1, command[3] or count
      if command[2] is not None and not 1 <= a <= b <= count:
        return f'error: lines {a}-{b} are outside 1-{count} of {name}\n'
      text = numbered(name, files[name], a, b)
      return code_env.printable(code_env.head_tail(text, self.config.output_chars))
    _, _, a, b, new = command
    if not (1 <= a <= count + 1 and a - 1 <= b <= count):
      return f'error: lines {a}-{b} cannot be replaced in {name} (lines 1-{count})\n'
    lines[a - 1 : b] = new
    files[name] = '\n'.join(lines) + '\n'
    return f'{name}: replaced lines {a}-{b} with {len(new)} lines; now {len(lines)} lines\n'

  def _test_run(self, i: int) -> tuple[Program, list[TestCase]]:
    """The program that runs the repository's test file: its output is the verdict's output,
    its one test returns the exit code."""
    return Program(source=_TEST_RUNNER, files=dict(self._files[i])), [
      TestCase(call='_run_tests()', expected=0)
    ]

  def _run_output(self, verdict: Verdict) -> str:
    """The answer to 'run': the tests' output (head and tail) and exit code."""
    result = verdict.results[0]
    code = result.got if result.status in ('pass', 'fail') and result.got else None
    output = verdict.output.rstrip('\n')
    if code is None:  # the runner itself stopped: say why
      output += ('\n' if output else '') + code_env.last_line(result.error or verdict.feedback)
      code = '1'
    text = code_env.head_tail(output, self.config.output_chars)
    return code_env.printable((f'{text}\n' if text else '') + f'exit code {code}\n')

  def _hidden_check(self, i: int) -> tuple[Program, list[TestCase]]:
    source = ''.join(f'import {module}\n' for module in MODULES)
    return Program(source=source, files=dict(self._files[i])), list(
      self._episode_tasks[i].hidden_tests
    )
