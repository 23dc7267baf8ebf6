"""Bugs injected into Python source by AST transformations (SWE-smith's procedural bugs): each
candidate site of a module, one edit at that site, the rest of the file untouched.

Kinds (`KINDS`):
  flip_comparison   a < b -> a >= b, == <-> !=, in <-> not in, is <-> is not (one operator)
  flip_boolean      and <-> or; not x -> x
  off_by_one        an int constant in arithmetic, a comparison, an index or slice, or range():
                    n -> n + 1
  change_constant   True <-> False; a number outside those places: 0 <-> 1, else n -> n + 1
  remove_statement  an expression statement, an assignment or an augmented assignment of a
                    function body that has another statement
  remove_branch     the body of an `if` that has an `else` (the else's body stays) or an `if`
                    without one (when its block holds another statement)
  swap_arguments    the first two positional arguments of a call
  early_return      `return None` before the last statement of a function body of two or more

A site is found with `ast` and edited in the text at the node's exact span, so the diff of a
bug is a line or a few (`patches.make`), never a reformatted file.

  sites = mutations.sites(source)                   # [Site(kind, line, col, ...)], in file order
  bug = mutations.apply(source, sites[3])           # the mutated source (None: not applicable)
"""

import ast
import dataclasses
from collections.abc import Iterator

KINDS = (
  'flip_comparison',
  'flip_boolean',
  'off_by_one',
  'change_constant',
  'remove_statement',
  'remove_branch',
  'swap_arguments',
  'early_return',
)

_FLIPPED = {
  ast.Lt: ast.GtE,
  ast.GtE: ast.Lt,
  ast.Gt: ast.LtE,
  ast.LtE: ast.Gt,
  ast.Eq: ast.NotEq,
  ast.NotEq: ast.Eq,
  ast.In: ast.NotIn,
  ast.NotIn: ast.In,
  ast.Is: ast.IsNot,
  ast.IsNot: ast.Is,
}


@dataclasses.dataclass(frozen=True)
class Site:
  """Where one bug of `kind` can go: the node's span (1-based lines, 0-based columns, as `ast`),
  and the text that replaces it (for a removal, '' and whole lines)."""

  kind: str
  line: int
  col: int
  end_line: int
  end_col: int
  replacement: str
  whole_lines: bool = False  # the span is whole lines (removed, or replaced by `replacement`)

  def describe(self) -> str:
    return f'{self.kind} at line {self.line}'


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
  return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _span(node: ast.AST, kind: str, replacement: str, whole_lines: bool = False) -> Site:
  return Site(
    kind, node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, replacement,
    whole_lines,
  )  # fmt: skip


def _indent(source_lines: list[str], line: int) -> str:
  text = source_lines[line - 1]
  return text[: len(text) - len(text.lstrip())]


def _in_function(node: ast.AST, parents: dict) -> bool:
  while node in parents:
    node = parents[node]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      return True
  return False


def _int_constant(node: ast.AST) -> bool:
  return (
    isinstance(node, ast.Constant) and type(node.value) is int and node.lineno == node.end_lineno
  )


def _off_by_one_place(node: ast.AST, parents: dict) -> bool:
  parent = parents.get(node)
  if isinstance(parent, ast.UnaryOp):  # -1: the whole negative number
    return False
  if isinstance(parent, ast.BinOp | ast.Compare | ast.Slice | ast.Subscript):
    return True
  return (
    isinstance(parent, ast.Call)
    and isinstance(parent.func, ast.Name)
    and parent.func.id == 'range'
    and node in parent.args
  )


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
  """A block's statements but a leading docstring."""
  return body[1:] if body and _docstring(body[0]) else body


def _sites(tree: ast.Module, lines: list[str]) -> Iterator[Site]:
  parents = _parents(tree)
  for node in ast.walk(tree):
    if not hasattr(node, 'lineno') or not _in_function(node, parents):
      continue
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIPPED:
      flipped = ast.Compare(node.left, [_FLIPPED[type(node.ops[0])]()], node.comparators)
      yield _span(node, 'flip_comparison', ast.unparse(flipped))
    elif isinstance(node, ast.BoolOp):
      op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
      yield _span(node, 'flip_boolean', ast.unparse(ast.BoolOp(op, node.values)))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
      yield _span(node, 'flip_boolean', ast.unparse(node.operand))
    elif _int_constant(node) and _off_by_one_place(node, parents):
      yield _span(node, 'off_by_one', repr(node.value + 1))
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
      yield _span(node, 'change_constant', repr(not node.value))
    elif (
      isinstance(node, ast.Constant)
      and type(node.value) in (int, float)
      and not isinstance(parents.get(node), ast.UnaryOp)
    ):
      value = (
        {0: 1, 1: 0}.get(node.value, node.value + 1) if type(node.value) is int else node.value * 2
      )
      yield _span(node, 'change_constant', repr(value))
    elif isinstance(node, ast.Call) and len(node.args) >= 2:
      if any(isinstance(a, ast.Starred) for a in node.args[:2]):
        continue
      args = [node.args[1], node.args[0], *node.args[2:]]
      swapped = ast.Call(node.func, args, node.keywords)
      if ast.unparse(swapped) != ast.unparse(node):
        yield _span(node, 'swap_arguments', ast.unparse(swapped))
  for node in ast.walk(tree):
    function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    if function and len(_statements(node.body)) >= 2:
      last = _statements(node.body)[-1]
      indent = _indent(lines, last.lineno)
      yield Site('early_return', last.lineno, 0, last.lineno, 0, f'{indent}return None\n')
    if not (function or (_in_function(node, parents) and hasattr(node, 'body'))):
      continue
    for block in _blocks(node):
      body = _statements(block)
      for stmt in body:
        removable = isinstance(stmt, ast.Expr | ast.Assign | ast.AugAssign | ast.AnnAssign)
        if removable and len(body) >= 2 and not _docstring(stmt):
          yield _span(stmt, 'remove_statement', '', whole_lines=True)
        if not isinstance(stmt, ast.If) or lines[stmt.lineno - 1].lstrip().startswith('elif'):
          continue  # an elif's clauses are left alone: its else is not the statement's
        if stmt.orelse and not _is_elif(stmt, lines):
          first, last = stmt.orelse[0], stmt.orelse[-1]
          by = len(_indent(lines, first.lineno)) - len(_indent(lines, stmt.lineno))
          kept = _dedent(''.join(lines[first.lineno - 1 : last.end_lineno]), by)
          yield Site('remove_branch', stmt.lineno, 0, stmt.end_lineno, 0, kept, whole_lines=True)
        elif not stmt.orelse and len(body) >= 2:
          yield _span(stmt, 'remove_branch', '', whole_lines=True)


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
  out = []
  for name in ('body', 'orelse', 'finalbody'):
    block = getattr(node, name, None)
    if isinstance(block, list) and block:  # a lambda's or an if-expression's is an expression
      out.append(block)
  for handler in getattr(node, 'handlers', ()):
    out.append(handler.body)
  return out


def _docstring(stmt: ast.stmt) -> bool:
  """A bare string statement (a docstring, or a string used as a comment)."""
  value = getattr(stmt, 'value', None)
  return (
    isinstance(stmt, ast.Expr) and isinstance(value, ast.Constant) and isinstance(value.value, str)
  )


def _is_elif(stmt: ast.If, lines: list[str]) -> bool:
  """Whether the `if` has an `elif` (its else is one nested `if` written on an 'elif' line)."""
  if len(stmt.orelse) != 1 or not isinstance(stmt.orelse[0], ast.If):
    return False
  return lines[stmt.orelse[0].lineno - 1].lstrip().startswith('elif')


def _dedent(text: str, by: int) -> str:
  out = []
  for line in text.splitlines(keepends=True):
    strip = min(by, len(line) - len(line.lstrip(' '))) if line.strip() else 0
    out.append(line[strip:])
  return ''.join(out)


def sites(source: str) -> list[Site]:
  """Every site of every kind in `source` (inside functions only: module-level code runs at
  import), in file order, each once.

  Raises:
    SyntaxError: `source` is not Python.
  """
  tree = ast.parse(source)
  lines = source.splitlines(keepends=True)
  unique = {(s.kind, s.line, s.col, s.end_line, s.end_col): s for s in _sites(tree, lines)}
  return sorted(unique.values(), key=lambda s: (s.line, s.col, KINDS.index(s.kind), s.end_line))


def apply(source: str, site: Site) -> str | None:
  """`source` with the bug of `site`; None where the result is no longer valid Python or is
  the same program (e.g. `x == x` flipped to itself)."""
  lines = source.splitlines(keepends=True)
  if site.kind == 'early_return':
    out = ''.join(lines[: site.line - 1]) + site.replacement + ''.join(lines[site.line - 1 :])
  elif site.whole_lines:
    out = ''.join(lines[: site.line - 1]) + site.replacement + ''.join(lines[site.end_line :])
  else:
    head = ''.join(lines[: site.line - 1]) + lines[site.line - 1][: site.col]
    tail = lines[site.end_line - 1][site.end_col :] + ''.join(lines[site.end_line :])
    out = head + site.replacement + tail
  try:
    if ast.dump(ast.parse(out)) == ast.dump(ast.parse(source)):
      return None
  except SyntaxError:
    return None
  return out


__all__ = ['KINDS', 'Site', 'apply', 'sites']
