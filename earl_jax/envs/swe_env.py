"""Fix a bug in a real project: the `swe` task (instances from `earl_jax.swe`: built by
`experiments/build_swe_tasks.py`, or SWE-bench-style JSONL with the repositories on disk).

Each episode gets an instance and its own copy of the buggy repository (text, in the
environment). The first observation is the problem statement (the failing tests and how they
fail; never where the bug is), and, in the plain format, the commands. Each reply calls one tool
(`earl_jax.swe.tools`): list, view or search files, replace lines or apply a diff, run the tests
(all or named), submit. `CodeEnvConfig.tool_format` picks how replies are written: 'plain'
commands (the tiny model's), or 'qwen', Qwen2.5's `<tool_call>` JSON with the tools declared in
the system prompt as its chat template does (`tokenizer.qwen_tool_system_prompt`); each answer
is then a `<tool_response>` block, as the template renders a tool message.

A reply that names no tool, a bad path (outside the repository, no such file), lines out of
range or a diff that does not apply gets a one-line 'error: ...' answer and counts as a turn
(`tool_errors` in `episode_stats`); nothing a reply holds raises. The last turn submits after
its call.

Reward: at submit, the project's tests run in the sandbox on a fresh copy of the buggy
repository with the episode's edits of non-test files over it (`Instance.judged_files`), so an
edit to a test never counts. 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes (outcome
'win'), else 0 ('loss'); with `CodeEnvConfig.reward='fraction'`, the fraction of FAIL_TO_PASS
that pass when every PASS_TO_PASS still does (else 0). The tests of a step (runs and judgements)
go to the sandbox together.

Tasks: the instances of `CodeEnvConfig.swe_tasks`, shuffled by `split_seed`; the first
`heldout_fraction` of them are 'heldout', the rest 'train'.
"""

import functools
import math
import time
from collections.abc import Sequence
from concurrent import futures

import numpy as np

from earl_jax.envs import base, code_env
from earl_jax.errors import ConfigError
from earl_jax.sandbox import Sandbox, SandboxConfig
from earl_jax.swe import instances as instances_lib
from earl_jax.swe import testrun, tools, venvs

# What a project's test suite needs of the sandbox (at least; `CodeEnvConfig.sandbox` may give
# more).
_SUITE_LIMITS = {
  'program_timeout_s': 120.0, 'cpu_s': 120, 'memory_mib': 2048, 'file_mib': 64,
  'open_files': 512, 'max_processes': 64, 'output_bytes': 1 << 22, 'disk_mib': 256,
}  # fmt: skip
_SHOWN_FAILURES = 10


def suite_sandbox(config: SandboxConfig) -> SandboxConfig:
  """`config` with every limit raised to at least what a project's test suite needs."""
  changes = {k: max(getattr(config, k), v) for k, v in _SUITE_LIMITS.items()}
  return SandboxConfig(**{**config.__dict__, **changes})


@functools.cache
def load_split(config: base.CodeEnvConfig) -> tuple:
  """The instances of `config`'s split of `config.swe_tasks` (loaded once per process).

  Raises:
    ConfigError: no such file, or a line that is not an instance of `swe_format`.
  """
  try:
    everything = instances_lib.load(
      config.swe_tasks, format=config.swe_format, repos_dir=config.swe_repos or None
    )
  except FileNotFoundError:
    raise ConfigError(
      f'CodeEnvConfig.swe_tasks={config.swe_tasks!r}: no such file; build the instances with '
      '`python -m experiments.build_swe_tasks --out=runs/swe_tasks`, or name a JSONL'
    ) from None
  except instances_lib.InstanceError as e:
    raise ConfigError(f'CodeEnvConfig.swe_tasks: {e}') from None
  split_seed, fraction, split = config.split_seed, config.heldout_fraction, config.split
  order = np.random.default_rng(split_seed).permutation(len(everything))
  held = math.ceil(fraction * len(everything))
  chosen = order[:held] if split == 'heldout' else order[held:]
  return tuple(everything[i] for i in sorted(chosen.tolist()))


AGENTS = ('gold', 'no-op')


def play_scripted(
  config: base.CodeEnvConfig,
  tasks: Sequence[instances_lib.Instance],
  agent: str,
  *,
  batch: int = 16,
) -> dict[str, dict[str, float]]:
  """instance_id -> {reward, test_s, runs, tool_errors} of a scripted agent on each of `tasks`,
  once, through `SWEEnv` (plain commands): 'gold' replies `diff` + the gold patch, then
  submits; 'no-op' submits at once. `config` needs `max_reply_chars` above the longest patch."""
  if agent not in AGENTS:
    raise ValueError(f'agent={agent!r}: expected one of {AGENTS}')
  out = {}
  for start in range(0, len(tasks), batch):
    env = SWEEnv(config, tasks=tasks[start : start + batch])
    env.reset(len(env.tasks), seed=0)  # every task of the batch once, in the seed's order
    played = env.episode_tasks
    total = np.zeros(len(played), np.float32)
    replies = [f'diff\n{t.patch}' if agent == 'gold' else 'submit' for t in played]
    while not env.done.all():
      total += env.step(replies).rewards
      replies = ['submit'] * len(played)
    stats = env.episode_stats()
    for k, task in enumerate(played):
      out[task.instance_id] = {
        'reward': float(total[k]),
        'test_s': float(stats['test_s'][k]),
        'runs': float(stats['programs'][k]),
        'tool_errors': float(stats['tool_errors'][k]),
      }
  return out


def check(
  config: base.CodeEnvConfig, tasks: Sequence[instances_lib.Instance], *, batch: int = 16
) -> tuple[list, list[tuple[str, str]], dict]:
  """(the valid instances, (instance_id, why) of the others, each agent's `play_scripted`):
  valid when the gold patch solves it through the environment and doing nothing does not."""
  played = {agent: play_scripted(config, tasks, agent, batch=batch) for agent in AGENTS}
  invalid = []
  for task in tasks:
    gold, noop = played['gold'][task.instance_id], played['no-op'][task.instance_id]
    if gold['tool_errors']:
      invalid.append((task.instance_id, 'the gold patch does not apply'))
    elif gold['reward'] < 1:
      invalid.append((task.instance_id, 'the gold patch does not solve it'))
    elif noop['reward'] > 0:
      invalid.append((task.instance_id, 'it is solved as it is'))
  bad = {i for i, _ in invalid}
  return [t for t in tasks if t.instance_id not in bad], invalid, played


def intro(instance: instances_lib.Instance, tool_format: str, num_files: int) -> str:
  """The first observation."""
  if tool_format == 'qwen':
    return (
      f'{instance.problem_statement}\n\nThe repository ({num_files} files) is open: use the '
      'tools to find the bug, fix it, run the tests and submit.'
    )
  return (
    f'{instance.problem_statement}\n\nThe repository has {num_files} files. Reply with one '
    f'command per turn:\n{tools.plain_help()}\n'
  )


class SWEEnv(code_env.CodeEpisodes):
  """B episodes of fixing a bug in a project's repository (see the module docstring)."""

  def __init__(
    self,
    config: base.CodeEnvConfig,
    *,
    tasks: Sequence[instances_lib.Instance] | None = None,
    sandbox: Sandbox | None = None,
  ):
    """An environment of `config` (task 'swe').

    Args:
      config: the code config.
      tasks: the instances to play instead of `config`'s split (tests, scripted agents).
      sandbox: where the tests run; None: a shared one with `suite_sandbox(config.sandbox)`.
    """
    if config.task != 'swe':
      raise ValueError(f'SWEEnv plays swe, not {config.task!r}.')
    super().__init__(config, sandbox)
    if tasks is None:
      tasks = load_split(config)
    self.tasks = tuple(tasks)
    if not self.tasks:
      raise ValueError(f'SWEEnv: no instances in the {config.split!r} split of {config.swe_tasks}')
    self._spaces: list[tools.Workspace] = []
    self._task_ids = np.zeros(0, np.int64)
    self._errors = np.zeros(0, np.float64)
    self._test_runs = np.zeros(0, np.float64)
    self._test_s = np.zeros(0, np.float64)

  @property
  def sandbox(self) -> Sandbox:
    if self._sandbox is None:
      self._sandbox = code_env.shared_sandbox(suite_sandbox(self.config.sandbox))
    return self._sandbox

  @functools.cache  # noqa: B019 (one environment per process and config)
  def python(self, requirements: tuple[str, ...]) -> str:
    """The interpreter that runs an instance's tests: `swe_python`, else a cached virtualenv
    with its requirements."""
    if self.config.swe_python:
      return self.config.swe_python
    return venvs.ensure(self.config.swe_cache, requirements)

  @property
  def workspaces(self) -> list[tools.Workspace]:
    return list(self._spaces)

  def reset(
    self,
    n: int,
    seed: int,
    *,
    group_size: int = 1,
    rows: Sequence[int] | None = None,
    task_weights: np.ndarray | None = None,
  ) -> list[str]:
    """Starts n episodes (or the subset `rows`); see `base.TextEnv.reset`."""
    _, task_index = code_env.assign(len(self.tasks), n, seed, group_size, rows, task_weights)
    self._task_ids = task_index.astype(np.int64)
    self._start([self.tasks[i] for i in task_index.tolist()])
    self._spaces = [
      tools.Workspace(task.buggy_files(), protected=task.tests) for task in self._episode_tasks
    ]
    count = len(self._spaces)
    self._errors = np.zeros(count, np.float64)
    self._test_runs = np.zeros(count, np.float64)
    self._test_s = np.zeros(count, np.float64)
    return [
      self._shown(intro(task, self.config.tool_format, len(space.files)), first=True)
      for task, space in zip(self._episode_tasks, self._spaces)
    ]

  def episode_stats(self) -> dict[str, np.ndarray]:
    """`CodeEpisodes.episode_stats`, `tool_errors` (replies refused: no tool, a bad path, an
    edit that does not apply), `test_runs` (the policy's; a submit's judgement is not one),
    `test_s` (the seconds of all its test runs, judgement included, each as the sandbox timed
    it), and `task_id` (the instance's index in `tasks`)."""
    return {
      'tool_errors': self._errors.copy(),
      'test_runs': self._test_runs.copy(),
      'test_s': self._test_s.copy(),
      'task_id': self._task_ids.astype(float),
      **super().episode_stats(),
    }

  def _shown(self, text: str, *, first: bool = False) -> str:
    text = code_env.printable(text if first else code_env.head_tail(text, self.config.output_chars))
    if self.config.tool_format == 'qwen' and not first:
      return f'<tool_response>\n{text.rstrip()}\n</tool_response>'
    return text

  def _parse(self, reply: object) -> tools.Call:
    if not isinstance(reply, str):
      raise tools.ToolError('error: the reply is not text')
    if len(reply) > self.config.max_reply_chars:
      raise tools.ToolError(
        f'error: the reply is longer than {self.config.max_reply_chars} characters'
      )
    if self.config.tool_format == 'qwen':
      return tools.parse_qwen(reply)
    return tools.parse_plain(reply)

  def step(self, actions: Sequence[str]) -> base.StepResult:
    """Runs one tool call per episode; see the module docstring.

    Raises:
      RuntimeError: before `reset`.
      ValueError: `actions` does not hold one reply per episode.
      SandboxError: the sandbox itself failed.
    """
    rewards, observations, infos, active = self._begin_step(actions)
    runs, submits = [], []
    for i in active:
      last_turn = self._turns[i] + 1 >= self.max_turns
      try:
        call = self._parse(actions[i])
        if call.name == 'test':
          tests = call.args.get('tests', [])
          runs.append((i, tuple(tests)))
        elif call.name != 'submit':
          observations[i] = self._shown(self._spaces[i].run(call))
      except tools.ToolError as e:
        self._errors[i] += 1
        observations[i] = self._shown(f'{e}\n')
        call = None
      if last_turn or (call is not None and call.name == 'submit'):
        submits.append(i)
        runs = [r for r in runs if r[0] != i]
      infos[i] = self._info(i)
    results = self._run_all([self._test_job(i, tests) for i, tests in runs] + [
      self._judge_job(i) for i in submits
    ])  # fmt: skip
    for (i, _), result in zip(runs, results[: len(runs)]):
      self._test_runs[i] += 1
      observations[i] = self._shown(self._report(result))
      infos[i] = self._info(i, status='pass' if _ok(result) else 'fail')
    for i, result in zip(submits, results[len(runs) :]):
      task = self._episode_tasks[i]
      f2p, f2p_total, p2p, p2p_total = (
        instances_lib.judge(result, task) if isinstance(result, testrun.TestRun) else
        (0, len(task.fail_to_pass), 0, len(task.pass_to_pass))
      )  # fmt: skip
      solved = f2p == f2p_total and p2p == p2p_total
      self._outcomes[i] = 'win' if solved else 'loss'
      if self.config.reward == 'fraction':
        rewards[i] = f2p / f2p_total if p2p == p2p_total else 0.0
      else:
        rewards[i] = float(solved)
      observations[i] = self._shown(
        f'FAIL_TO_PASS {f2p}/{f2p_total}, PASS_TO_PASS {p2p}/{p2p_total}\n'
      )
      infos[i] = self._info(
        i, status='pass' if solved else 'fail', passed=f2p + p2p, total=f2p_total + p2p_total
      )
    return self._end_step(active, observations, rewards, infos)

  def _test_job(self, i: int, tests: tuple[str, ...]):
    task, space = self._episode_tasks[i], self._spaces[i]
    files = space.files if not task.test_patch else task.judged_files(space.library_files())
    return i, task, files, tests or task.test_args

  def _judge_job(self, i: int):
    task = self._episode_tasks[i]
    return i, task, task.judged_files(self._spaces[i].library_files()), task.test_args

  def _run_all(self, jobs: list) -> list:
    """Each job's `TestRun`, or its `TestRunError` (a hang, no outcomes), run together."""
    if not jobs:
      return []
    box = self.sandbox
    timeout = suite_sandbox(self.config.sandbox).program_timeout_s

    def one(job):
      _, task, files, args = job
      try:
        return testrun.run_tests(
          box, files, python=self.python(task.requirements), paths=args,
          pythonpath=task.pythonpath, timeout_s=timeout,
        )  # fmt: skip
      except testrun.TestRunError as e:
        return e

    t0 = time.perf_counter()
    with futures.ThreadPoolExecutor(box.workers) as pool:
      results = list(pool.map(one, jobs))
    share = (time.perf_counter() - t0) / len(jobs)
    for (i, *_), result in zip(jobs, results):
      hung = isinstance(result, testrun.TestRunError) and 'ran past' in str(result)
      if isinstance(result, testrun.TestRun):
        self._test_s[i] += result.seconds
      self._counts[i] += (1, hung, isinstance(result, testrun.TestRunError) and not hung, share)
    return results

  def _report(self, result) -> str:
    """The answer to a test run: counts, then the failing tests with their messages."""
    if isinstance(result, testrun.TestRunError):
      return f'the tests did not run: {result}\n'
    counts = {}
    for outcome in result.outcomes.values():
      counts[outcome] = counts.get(outcome, 0) + 1
    head = ', '.join(f'{n} {o}' for o, n in sorted(counts.items())) or 'no tests ran'
    failing = [t for t, o in sorted(result.outcomes.items()) if o in ('failed', 'error')]
    lines = [head]
    for test in failing[:_SHOWN_FAILURES]:
      message = next((x for x in result.messages.get(test, '').splitlines() if x.strip()), '')
      lines.append(code_env.truncate(f'FAILED {test}: {message}', self.config.feedback_chars))
    if len(failing) > _SHOWN_FAILURES:
      lines.append(f'... and {len(failing) - _SHOWN_FAILURES} more failing')
    return '\n'.join(lines) + '\n'


def _ok(result) -> bool:
  return isinstance(result, testrun.TestRun) and result.exit_code == 0
