"""Unified diffs: made from two texts, applied strictly, several files at once."""

import pytest

from earl_jax.swe import patches

BEFORE = ''.join(f'line {i}\n' for i in range(1, 21))


def test_a_diff_round_trips_and_names_its_file():
  after = BEFORE.replace('line 3\n', 'line three\n').replace('line 17\n', '')
  diff = patches.make('pkg/mod.py', BEFORE, after)
  assert diff.startswith('--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1,6 +1,6 @@')
  assert patches.files(diff) == ['pkg/mod.py']
  assert patches.apply(BEFORE, diff) == after
  assert patches.apply(after, patches.make('pkg/mod.py', after, BEFORE)) == BEFORE
  assert patches.make('x.py', BEFORE, BEFORE) == ''


def test_no_newline_at_the_end_and_insertions():
  before, after = 'a\nb', 'a\nb\nc'
  diff = patches.make('f.py', before, after)
  assert '\\ No newline at end of file' in diff
  assert patches.apply(before, diff) == after
  assert patches.apply(after, patches.make('f.py', after, before)) == before
  assert patches.apply('', patches.make('new.py', '', 'x = 1\n')) == 'x = 1\n'


def test_a_diff_that_does_not_match_is_refused_by_line():
  diff = patches.make('m.py', BEFORE, BEFORE.replace('line 10\n', 'ten\n'))
  changed = BEFORE.replace('line 9\n', 'nine\n')
  with pytest.raises(
    patches.PatchError, match=r"line 9 does not match the diff: expected 'line 9', found 'nine'"
  ):
    patches.apply(changed, diff)
  with pytest.raises(patches.PatchError, match='no hunk'):
    patches.apply(BEFORE, '--- a/m.py\n+++ b/m.py\n')
  with pytest.raises(patches.PatchError, match='bad diff line'):
    patches.apply(BEFORE, '--- a/m.py\n+++ b/m.py\n@@ -1,1 +1,1 @@\n*line 1\n')
  with pytest.raises(patches.PatchError, match='one file, got 0'):
    patches.apply(BEFORE, 'hello\n')


def test_several_files_at_once():
  texts = {'a.py': 'x = 1\n', 'b.py': 'y = 2\n'}
  diff = patches.make('a.py', 'x = 1\n', 'x = 3\n') + patches.make('b.py', 'y = 2\n', 'y = 4\n')
  assert patches.files(diff) == ['a.py', 'b.py']
  assert patches.apply_all(texts, diff) == {'a.py': 'x = 3\n', 'b.py': 'y = 4\n'}
  assert texts == {'a.py': 'x = 1\n', 'b.py': 'y = 2\n'}  # not changed in place
