"""Write a Python function, in one turn or with repair turns: the 'functions' and 'humaneval' tasks.

Each episode gets a `code_tasks.CodeTask`. Its first observation is the task's prompt (the
signature and docstring); a reply is either the body that completes it (the tiny model's form:
'    return x*3+1') or a whole definition of the entry point, which replaces the prompt's stub
(a chat model's form). A reply with a Markdown code fence is read from its first fence. The
program is the prompt followed by that code, run by the sandbox on the public and the hidden
tests together.

Turns (`CodeEnvConfig.max_turns`): an attempt ends the episode when it passes every public test
or every hidden test, or on the last turn. Otherwise the next observation lists up to
`feedback_tests` failing public tests, one line each, and the prompt again::

  f(4) == 13 failed: got 12
  f(0) == 1 failed: NameError: name 'y' is not defined
  def f(x):
      \"\"\"multiply x by 3 and add 1 ...

so every turn makes the context longer. A program that does not load (a syntax error) fails each
test with the load error's last line. The final attempt's hidden tests make the reward: their
pass fraction, or 1/0 (`CodeEnvConfig.reward`); outcome 'win' when all pass, else 'loss'. The
step that ends an episode observes 'passed k/n hidden tests'. A reply with no code or longer than `max_reply_chars` ends the episode at
once with `invalid_reward` (outcome 'invalid'). Nothing a reply contains raises; a failure of the
sandbox itself (`SandboxError`) does, since it is not the policy's doing.

All the programs of a step go to the sandbox in one `check_many` batch, so its workers run them
in parallel; every process of a run has its own pool (`shared_sandbox`) for the episodes it
plays. `episode_stats` reports, per episode, what the sandbox ran and judged (the first-turn and
final pass, programs, time-outs, crashes, sandbox seconds): the metrics of every step line. Observations are printable ASCII, tab and newline (`printable`), the alphabet of the code
tokenizer (HumanEval's few non-ASCII characters show as '?').

Randomness: `reset(n, seed)` shuffles the tasks with the seed and gives group g (of `group_size`
consecutive episodes) the task at position g mod T of the shuffle, so n >= T episodes play every
task and the episodes of a group play the same task.
"""

import atexit
import functools
import re
import threading
import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from earl_jax.envs import base, code_tasks
from earl_jax.sandbox import Program, Sandbox, SandboxConfig, TestCase, TestResult, Verdict

# The per-episode counts of `CodeEpisodes.episode_stats`, and the verdicts counted as crashes.
_COUNTS = ('programs', 'timeouts', 'crashes', 'sandbox_s')
_KILLED = ('crash', 'memory')
CODE_FENCE = re.compile(r'```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:^[ \t]*```|\Z)', re.S | re.M)
_sandboxes: dict[SandboxConfig, Sandbox] = {}
_sandboxes_lock = threading.Lock()


@runtime_checkable
class ProgramChecker(Protocol):
  """What an environment needs of a sandbox: judge a batch of (program, tests) at once."""

  def check_many(self, items: Sequence[tuple[Program, Sequence[TestCase]]]) -> list[Verdict]: ...


def shared_sandbox(config: SandboxConfig) -> Sandbox:
  """The process's sandbox for `config`, started on first use and closed at exit.

  The rollout engine builds a new environment for every rollout; they all share this pool.
  """
  with _sandboxes_lock:
    if config not in _sandboxes:
      if not _sandboxes:
        atexit.register(_close_sandboxes)
      _sandboxes[config] = Sandbox(config)
    return _sandboxes[config]


def _close_sandboxes() -> None:
  with _sandboxes_lock:
    for sandbox in _sandboxes.values():
      sandbox.close()
    _sandboxes.clear()


def printable(text: str) -> str:
  """`text` as an observation may show it: '\\r\\n' as '\\n', every character outside printable
  ASCII, tab and newline as '?', and '<|' (how a chat tokenizer's special tokens begin, e.g.
  '<|im_end|>') as '<?|', so that no text a program prints can close a chat turn."""
  text = text.replace('\r\n', '\n')
  text = ''.join(c if c in '\t\n' or ' ' <= c <= '~' else '?' for c in text)
  return text.replace('<|', '<?|')


def encodable(text: str) -> str:
  """`text` with every character UTF-8 cannot encode (a lone surrogate) as '?', so that it can
  travel to the sandbox as a program or a file."""
  return text.encode('utf-8', 'replace').decode('utf-8')


def truncate(text: str, limit: int) -> str:
  """`text` cut to `limit` characters, ending in '...' when cut."""
  return text if len(text) <= limit else text[: limit - 3] + '...'


def head_tail(text: str, limit: int) -> str:
  """`text` kept to about `limit` characters: its head and its tail around a marker line."""
  if len(text) <= limit:
    return text
  half = limit // 2
  return f'{text[:half]}\n...[{len(text) - 2 * half} characters cut]...\n{text[-half:]}'


def extract_code(reply: str) -> str | None:
  """The code of a reply: its first Markdown code fence if it has one, else the whole reply,
  without trailing whitespace; None when that is empty."""
  fence = CODE_FENCE.search(reply)
  code = (fence.group(1) if fence else reply).rstrip()
  return code if code.strip() else None


def program_source(task: code_tasks.CodeTask, code: str) -> str:
  """The program a reply's code makes: the prompt, then the code (a body that completes it, or a
  new definition of the entry point after the prompt's stub)."""
  defines = re.search(rf'^def {re.escape(task.entry_point)}\s*\(', code, re.M)
  code = encodable(code)
  return f'{task.prompt}\n{code}\n' if defines else f'{task.prompt}{code}\n'


def last_line(text: str) -> str:
  """The last non-empty line of `text` ('' if none)."""
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return lines[-1].strip() if lines else ''


def failure_line(test: TestCase, result: TestResult, limit: int) -> str:
  """One feedback line: the test, what was expected and what came back (or the error)."""
  if result.status == 'fail' and result.got:
    outcome = f'got {result.got}'
  else:
    outcome = last_line(result.error or '') or result.status
  return truncate(printable(f'{test.call} == {test.expected!r} failed: {outcome}'), limit)


@functools.cache
def load_tasks(task: str, split: str, split_seed: int, heldout_fraction: float) -> tuple:
  """The tasks of a 'functions' split or HumanEval, built once per process."""
  if task == 'humaneval':
    return tuple(code_tasks.humaneval_tasks())
  if task == 'functions':
    return tuple(code_tasks.function_tasks(split, split_seed, heldout_fraction))
  raise ValueError(f'No function tasks named {task!r}; known: functions, humaneval.')


def assign(
  num_tasks: int,
  n: int,
  seed: int,
  group_size: int,
  rows: Sequence[int] | None,
  weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """(played rows, the task index of each) for `reset(n, seed, group_size, rows)`. With
  `weights` (one per task, >= 0, some > 0: a curriculum's), the groups' tasks are drawn from
  the seed in proportion to them, without replacement while there are tasks of weight > 0 left.

  Raises:
    ValueError: bad n, seed, group_size, rows or weights, each named.
  """
  played = base.check_reset_args(n, seed, group_size, rows)
  groups = np.arange(n) // group_size
  rng = np.random.default_rng(seed)
  if weights is None:
    order = rng.permutation(num_tasks)
    return played, order[groups % num_tasks][played]
  weights = np.asarray(weights, np.float64)
  if weights.shape != (num_tasks,) or not (weights >= 0).all() or not weights.sum() > 0:
    raise ValueError(
      f'task_weights: expected {num_tasks} weights >= 0 with a positive sum, got shape '
      f'{weights.shape}, sum {weights.sum()}.'
    )
  num_groups = int(groups[-1]) + 1
  drawn = rng.choice(
    num_tasks,
    size=num_groups,
    replace=num_groups > np.count_nonzero(weights),
    p=weights / weights.sum(),
  )
  return played, drawn[groups][played]


class CodeEpisodes(base.TextEnv):
  """What every code environment keeps per episode: its task, turns, outcome and last facts."""

  def __init__(self, config: base.CodeEnvConfig, sandbox: 'ProgramChecker | None'):
    self.config = config
    self._sandbox = sandbox
    self._episode_tasks: list = []
    self._done = np.zeros(0, bool)
    self._turns = np.zeros(0, np.int64)
    self._outcomes: list[base.Outcome | None] = []
    self._last: list[base.CodeStepInfo] = []
    self._counts = np.zeros((0, len(_COUNTS)), np.float64)

  @property
  def sandbox(self) -> 'ProgramChecker':
    if self._sandbox is None:
      self._sandbox = shared_sandbox(self.config.sandbox)
    return self._sandbox

  @property
  def max_turns(self) -> int:
    return self.config.turns

  @property
  def num_envs(self) -> int:
    return len(self._episode_tasks)

  @property
  def episode_tasks(self) -> list:
    """The task of each played episode."""
    return list(self._episode_tasks)

  @property
  def done(self) -> np.ndarray:
    return self._done.copy()

  @property
  def outcomes(self) -> list[base.Outcome | None]:
    return list(self._outcomes)

  def _start(self, episode_tasks: list) -> None:
    """Starts one episode per task."""
    self._episode_tasks = episode_tasks
    count = len(episode_tasks)
    self._done = np.zeros(count, bool)
    self._turns = np.zeros(count, np.int64)
    self._outcomes = [None] * count
    self._last = [self._info(i) for i in range(count)]
    self._counts = np.zeros((count, len(_COUNTS)), np.float64)

  def episode_stats(self) -> dict[str, np.ndarray]:
    """Per episode (see `base.TextEnv.episode_stats`): `pass_final_rate` 1 when its final
    attempt passed every hidden test (outcome 'win'); `programs` it ran in the sandbox, of which
    `timeouts` hit a time limit and `crashes` were killed (a signal, an early exit, the memory
    limit); `sandbox_s` its share of the wall time of the sandbox calls that ran them (each
    call's time split evenly over its programs: summed over the episodes, the seconds this
    process waited on the sandbox)."""
    stats = {name: self._counts[:, k].copy() for k, name in enumerate(_COUNTS)}
    return {'pass_final_rate': np.array([o == 'win' for o in self._outcomes], float), **stats}

  def _run_programs(
    self, batch: Sequence[tuple[Program, Sequence[TestCase]]], episodes: Sequence[int]
  ) -> list[Verdict]:
    """The sandbox's verdicts of `batch` (one job per episode of `episodes`, in one
    `check_many` call), counted for `episode_stats`."""
    if not batch:
      return []
    t0 = time.perf_counter()
    verdicts = self.sandbox.check_many(batch)
    share = (time.perf_counter() - t0) / len(batch)
    for i, verdict in zip(episodes, verdicts):
      self._counts[i] += (1, verdict.status == 'timeout', verdict.status in _KILLED, share)
    return verdicts

  def _info(self, i: int, **changes) -> base.CodeStepInfo:
    info = base.CodeStepInfo(
      outcome=self._outcomes[i],
      turn=int(self._turns[i]),
      ignored=False,
      task_id=self._episode_tasks[i].task_id,
      status=None,
      passed=0,
      total=0,
      public_passed=0,
      public_total=0,
    )
    info.update(changes)  # type: ignore[typeddict-item]
    return info

  def _begin_step(
    self, actions: Sequence[str]
  ) -> tuple[np.ndarray, list[str], list[base.CodeStepInfo], list[int]]:
    """(rewards, observations, infos, active episodes) of a step, before any reply is judged.

    An episode that had ended repeats its last facts, with the number of turns it took.

    Raises:
      RuntimeError: before `reset`.
      ValueError: `actions` does not hold one reply per episode.
    """
    n = self.num_envs
    if not n:
      raise RuntimeError('Call reset(n, seed) before using the environment.')
    base.check_actions(actions, n)
    infos = [
      base.CodeStepInfo(**{**info, 'ignored': True, 'turn': int(turns)})
      for info, turns in zip(self._last, self._turns)
    ]
    active = np.flatnonzero(~self._done).tolist()
    return np.zeros(n, np.float32), [''] * n, infos, active

  def _end_step(
    self,
    active: Sequence[int],
    observations: list[str],
    rewards: np.ndarray,
    infos: list[base.CodeStepInfo],
  ) -> base.StepResult:
    """The step's result, once each active episode's facts, turn and end are recorded."""
    for i in active:
      self._last[i] = infos[i]
      self._turns[i] += 1
      self._done[i] = self._outcomes[i] is not None
    return base.StepResult(
      observations=observations, rewards=rewards, dones=self._done.copy(), infos=infos
    )


class CodeEnv(CodeEpisodes):
  """B episodes of writing a function (see the module docstring)."""

  def __init__(
    self,
    config: base.CodeEnvConfig,
    *,
    tasks: Sequence[code_tasks.CodeTask] | None = None,
    sandbox: ProgramChecker | None = None,
  ):
    """An environment of `config`'s task.

    Args:
      config: a 'functions' or 'humaneval' config.
      tasks: the tasks to play instead of `config`'s (tests, scripted evaluations).
      sandbox: the sandbox to run programs in; None: `shared_sandbox(config.sandbox)`.
    """
    if config.task not in ('functions', 'humaneval'):
      raise ValueError(f'CodeEnv plays functions and humaneval, not {config.task!r}.')
    super().__init__(config, sandbox)
    self.tasks = (
      tuple(tasks)
      if tasks is not None
      else load_tasks(config.task, config.split, config.split_seed, config.heldout_fraction)
    )
    if not self.tasks:
      raise ValueError(f'CodeEnv for {config.task!r} has no tasks.')
    self._first_pass = np.zeros(0, bool)  # per episode: its first attempt passed every test
    self._task_ids = np.zeros(0, np.int64)  # per episode: its task's index among `tasks`

  def reset(
    self,
    n: int,
    seed: int,
    *,
    group_size: int = 1,
    rows: Sequence[int] | None = None,
    task_weights: np.ndarray | None = None,
  ) -> list[str]:
    """Starts n episodes (or the subset `rows`); see `base.TextEnv.reset`. `task_weights`: a
    curriculum's weight per task (`assign`); None: the seed's shuffle."""
    _, task_index = assign(len(self.tasks), n, seed, group_size, rows, task_weights)
    self._task_ids = task_index.astype(np.int64)
    self._start([self.tasks[i] for i in task_index.tolist()])
    self._first_pass = np.zeros(len(self._episode_tasks), bool)
    return [printable(task.prompt) for task in self._episode_tasks]

  def episode_stats(self) -> dict[str, np.ndarray]:
    """`CodeEpisodes.episode_stats`, `pass_first_rate` (1 when the episode's first attempt
    passed every hidden test: what a single-turn episode would have scored), and `task_id` (its
    task's index among `tasks`: an identifier for the curriculum, not a metric)."""
    return {
      'pass_first_rate': self._first_pass.astype(float),
      'task_id': self._task_ids.astype(float),
      **super().episode_stats(),
    }

  def step(self, actions: Sequence[str]) -> base.StepResult:
    """Judges one reply per episode; see the module docstring.

    Raises:
      RuntimeError: before `reset`.
      ValueError: `actions` is a single str or does not hold one reply per episode.
      SandboxError: the sandbox itself failed.
    """
    rewards, observations, infos, active = self._begin_step(actions)
    config = self.config
    batch: list[tuple[Program, list[TestCase]]] = []
    judged: list[int] = []
    for i in active:
      reply = actions[i]
      code = extract_code(reply) if isinstance(reply, str) else None
      if code is None or len(reply) > config.max_reply_chars:
        self._outcomes[i] = 'invalid'
        rewards[i] = config.invalid_reward
        observations[i] = 'invalid\n'
        continue
      task = self._episode_tasks[i]
      batch.append(
        (Program(source=program_source(task, code)), [*task.public_tests, *task.hidden_tests])
      )
      judged.append(i)
    verdicts = self._run_programs(batch, judged)
    for i, verdict in zip(judged, verdicts):
      observations[i], rewards[i], infos[i] = self._judge(i, verdict)
    for i in active:
      if self._outcomes[i] == 'invalid':
        infos[i] = self._info(i)
    return self._end_step(active, observations, rewards, infos)

  def _judge(self, i: int, verdict: Verdict) -> tuple[str, float, base.CodeStepInfo]:
    """The observation, reward and info of episode i's attempt judged by `verdict`."""
    config, task = self.config, self._episode_tasks[i]
    num_public = len(task.public_tests)
    results = verdict.results
    if len(results) == num_public + len(task.hidden_tests):
      oks = [bool(r.ok) for r in results]
    else:  # the program stopped before the tests could run
      oks = [False] * (num_public + len(task.hidden_tests))
    public_ok, hidden_ok = oks[:num_public], oks[num_public:]
    passed, total = sum(hidden_ok), len(hidden_ok)
    if self._turns[i] == 0:
      self._first_pass[i] = passed == total > 0
    info = self._info(
      i,
      status=verdict.status,
      passed=passed,
      total=total,
      public_passed=sum(public_ok),
      public_total=num_public,
    )
    last_turn = self._turns[i] + 1 >= self.max_turns
    if not (all(public_ok) or passed == total or last_turn):
      return self._feedback(task, verdict, public_ok) + printable(task.prompt), 0.0, info
    self._outcomes[i] = 'win' if passed == total else 'loss'
    info['outcome'] = self._outcomes[i]
    reward = config.reward_of(passed, total)
    return f'passed {passed}/{total} hidden tests\n', reward, info

  def _feedback(self, task: code_tasks.CodeTask, verdict: Verdict, public_ok: list[bool]) -> str:
    """The lines that say why an attempt failed its public tests (a program that did not load
    fails each test with its load error)."""
    limit = self.config.feedback_chars
    if len(verdict.results) != len(public_ok) + len(task.hidden_tests):
      line = f'program failed: {verdict.status}: {last_line(verdict.feedback)}'
      return truncate(printable(line), limit) + '\n'
    lines = []
    for test, result, ok in zip(task.public_tests, verdict.results, public_ok):
      if not ok and len(lines) < self.config.feedback_tests:
        lines.append(failure_line(test, result, limit))
    return ''.join(f'{line}\n' for line in lines)
