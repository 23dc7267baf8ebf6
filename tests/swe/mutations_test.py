"""Injected bugs: every kind at its sites, one small edit each, its inverse diff the fix."""

import ast

import pytest

from earl_jax.swe import mutations, patches

SOURCE = '''"""A module."""
LIMIT = 10


def clamp(x, lo=0, hi=LIMIT):
    """Clamp x."""
    if x < lo:
        return lo
    elif x > hi:
        return hi
    else:
        return x


def window(items, n):
    out = []
    total = 0
    for i in range(len(items) - n + 1):
        out.append(sum(items[i:i + n]))
        total += 1
    if not out and n > 0:
        return None
    return out


def pick(a, b, flag=True):
    # the larger unless told otherwise
    if flag:
        value = max(a, b)
    else:
        value = min(a, b)
    return value
'''


def test_every_kind_has_sites_inside_functions_only():
  found = mutations.sites(SOURCE)
  assert {s.kind for s in found} == set(mutations.KINDS)
  assert all(s.line > 3 for s in found)  # LIMIT = 10 runs at import: never mutated
  assert found == sorted(
    found, key=lambda s: (s.line, s.col, mutations.KINDS.index(s.kind), s.end_line)
  )


@pytest.mark.parametrize(
  'kind, line, before, after',
  [
    ('flip_comparison', 7, '    if x < lo:\n', '    if x >= lo:\n'),
    ('flip_boolean', 21, '    if not out and n > 0:\n', '    if not out or n > 0:\n'),
    (
      'off_by_one',
      18,
      '    for i in range(len(items) - n + 1):\n',
      '    for i in range(len(items) - n + 2):\n',
    ),
    ('change_constant', 26, 'def pick(a, b, flag=True):\n', 'def pick(a, b, flag=False):\n'),
    ('swap_arguments', 29, '        value = max(a, b)\n', '        value = max(b, a)\n'),
  ],
)
def test_an_expression_bug_edits_one_line(kind, line, before, after):
  (site,) = [s for s in mutations.sites(SOURCE) if s.kind == kind and s.line == line][:1]
  bug = mutations.apply(SOURCE, site)
  diff = patches.make('m.py', SOURCE, bug)
  assert [
    line
    for line in diff.splitlines()
    if line.startswith(('-', '+')) and not line.startswith(('---', '+++'))
  ] == [
    '-' + before.rstrip('\n'),
    '+' + after.rstrip('\n'),
  ]
  fix = patches.make('m.py', bug, SOURCE)  # the gold patch: the inverse edit
  assert patches.apply(bug, fix) == SOURCE


def test_statement_bugs_remove_or_insert_whole_lines():
  bugs = {(s.kind, s.line): mutations.apply(SOURCE, s) for s in mutations.sites(SOURCE)}
  assert '        total += 1\n' not in bugs[('remove_statement', 20)]
  # pick's if/else: the if's branch goes, the else's body stays at the if's level.
  kept = bugs[('remove_branch', 28)]
  assert '    value = min(a, b)\n    return value\n' in kept and 'max(a, b)' not in kept
  assert '    return None\n    return out\n' in bugs[('early_return', 23)]
  # An elif chain is left whole (no remove_branch at clamp's if or elif).
  assert not [s for s in mutations.sites(SOURCE) if s.kind == 'remove_branch' and s.line in (7, 9)]
  for bug in bugs.values():
    if bug is not None:
      ast.parse(bug)
      assert ast.dump(ast.parse(bug)) != ast.dump(ast.parse(SOURCE))


def test_an_edit_that_changes_nothing_is_not_a_site():
  src = 'def f(x):\n    return g(x, x)\n'
  assert not [
    s for s in mutations.sites(src) if s.kind == 'swap_arguments'
  ]  # g(x, x) swapped is itself
  same = 'def f(x):\n    return x == x\n'
  (site,) = [s for s in mutations.sites(same) if s.kind == 'flip_comparison']
  assert mutations.apply(same, site) == 'def f(x):\n    return x != x\n'
  with pytest.raises(SyntaxError):
    mutations.sites('def f(:\n')


def test_lambdas_and_if_expressions_have_no_blocks():
  """Their `body` is an expression, not a block of statements (found on toolz's itertoolz.py)."""
  src = 'def f(xs, k):\n    key = lambda x: x[k]\n    return sorted(xs, key=key) if xs else []\n'
  found = {(s.kind, s.line) for s in mutations.sites(src)}
  assert ('remove_statement', 2) in found and ('early_return', 3) in found
  assert all(mutations.apply(src, s) != src for s in mutations.sites(src))
