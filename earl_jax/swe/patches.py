"""Unified diffs of file texts: made from two versions, and applied strictly (the gold patch of a
task, an edit a policy proposes).

  diff = patches.make('pkg/mod.py', before, after)           # '--- a/pkg/mod.py\\n+++ b/...'
  patches.apply(before, diff) == after
  patches.files(diff)                                        # ['pkg/mod.py']

`apply` checks every context and removed line against the text (no fuzz, no offsets beyond the
hunk header's): a diff that does not match raises `PatchError` with the first line that differs.
"""

import difflib
import re
from collections.abc import Iterator

_HUNK = re.compile(r'^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@')


class PatchError(ValueError):
  """A diff that is malformed or does not match the text it is applied to."""


def make(path: str, before: str, after: str, *, context: int = 3) -> str:
  """The unified diff from `before` to `after` of the file `path` ('' when they are equal)."""
  lines = difflib.unified_diff(
    before.splitlines(keepends=True),
    after.splitlines(keepends=True),
    fromfile=f'a/{path}',
    tofile=f'b/{path}',
    n=context,
  )
  out = []
  for line in lines:
    out.append(line if line.endswith('\n') else line + '\n\\ No newline at end of file\n')
  return ''.join(out)


def files(diff: str) -> list[str]:
  """The paths a diff changes (its '+++ ' lines, without a 'b/'), in order."""
  return [path for path, _ in _file_diffs(diff)]


def _file_diffs(diff: str) -> Iterator[tuple[str, list[str]]]:
  """(path, its hunk lines) per file of a multi-file diff."""
  path, body = None, []
  for line in diff.splitlines(keepends=True):
    if line.startswith('--- '):
      if path is not None:
        yield path, body
      path, body = None, []
    elif line.startswith('+++ '):
      name = line[4:].rstrip('\n')
      path = name[2:] if name.startswith('b/') else name
    elif path is not None:
      body.append(line)
  if path is not None:
    yield path, body


def apply(text: str, diff: str) -> str:
  """`text` with a one-file unified diff applied.

  Raises:
    PatchError: the diff is malformed, changes several files, or does not match `text`.
  """
  parts = list(_file_diffs(diff))
  if len(parts) != 1:
    raise PatchError(f'expected a diff of one file, got {len(parts)}')
  return _apply_hunks(text, parts[0][1])


def apply_all(texts: dict[str, str], diff: str) -> dict[str, str]:
  """`texts` (path -> text) with a multi-file unified diff applied (a new path starts empty)."""
  out = dict(texts)
  parts = list(_file_diffs(diff))
  if not parts:
    raise PatchError('no file in the diff (expected --- a/PATH and +++ b/PATH lines)')
  for path, body in parts:
    out[path] = _apply_hunks(out.get(path, ''), body)
  return out


def reverse(diff: str) -> str:
  """The diff that undoes `diff` (SWE-smith's bug patch -> the fix): each hunk's sides
  swapped, removed lines before added ones.

  Raises:
    PatchError: no file in the diff.
  """
  parts = list(_file_diffs(diff))
  if not parts:
    raise PatchError('no file in the diff (expected --- a/PATH and +++ b/PATH lines)')
  out = []
  for path, body in parts:
    out += [f'--- a/{path}\n', f'+++ b/{path}\n']
    block: list[list[str]] = []  # the changed lines since the last context line
    for line in [*body, None]:
      changed = line is not None and line[:1] in ('+', '-', '\\') and not _HUNK.match(line)
      if not changed:
        out.extend(x for entry in block if entry[0].startswith('-') for x in entry)
        out.extend(x for entry in block if entry[0].startswith('+') for x in entry)
        block.clear()
      if line is None:
        break
      match = _HUNK.match(line)
      if match:
        a, b, c, d = match.group(1), match.group(2), match.group(3), match.group(4)
        old = c if d is None else f'{c},{d}'
        new = a if b is None else f'{a},{b}'
        out.append(f'@@ -{old} +{new} @@\n')
      elif line.startswith('\\'):
        (block[-1] if block else out).append(line)
      elif line[:1] in '+-':
        block.append([('-' if line[0] == '+' else '+') + line[1:]])
      else:
        out.append(line)
  return ''.join(out)


def _apply_hunks(text: str, body: list[str]) -> str:
  lines = text.splitlines(keepends=True)
  out: list[str] = []
  pos = 0  # lines of `text` consumed
  i = 0
  if not any(_HUNK.match(line) for line in body):
    raise PatchError('no hunk in the diff (expected an @@ -a,b +c,d @@ line)')
  while i < len(body):
    match = _HUNK.match(body[i])
    if not match:
      if body[i].strip():
        raise PatchError(f'unexpected line outside a hunk: {body[i].rstrip()!r}')
      i += 1
      continue
    start = int(match.group(1))
    old_len = 1 if match.group(2) is None else int(match.group(2))
    begin = start - 1 if old_len else start  # an empty old side inserts after line `start`
    if begin < pos or begin > len(lines):
      raise PatchError(f'hunk at line {start} is out of order or past the end ({len(lines)} lines)')
    out.extend(lines[pos:begin])
    pos = begin
    i += 1
    while i < len(body) and not _HUNK.match(body[i]):
      line = body[i]
      tag, content = line[:1], line[1:]
      if line.startswith('\\'):  # '\ No newline at end of file': the line before has none
        if out and out[-1].endswith('\n') and body[i - 1][:1] in ' +':
          out[-1] = out[-1][:-1]
        i += 1
        continue
      if tag in (' ', '-'):
        have = lines[pos] if pos < len(lines) else None
        want = content
        if have is None or have.rstrip('\n') != want.rstrip('\n'):
          raise PatchError(
            f'line {pos + 1} does not match the diff: expected {want.rstrip()!r}, found '
            f'{(have or "<end of file>").rstrip()!r}'
          )
        if tag == ' ':
          out.append(have)
        pos += 1
      elif tag == '+':
        out.append(content)
      elif line.strip() == '':  # a blank context line some tools emit without its space
        have = lines[pos] if pos < len(lines) else None
        if have is None or have.strip():
          raise PatchError(f'line {pos + 1} does not match the diff: expected an empty line')
        out.append(have)
        pos += 1
      else:
        raise PatchError(f'bad diff line {line.rstrip()!r} (expected " ", "-" or "+" first)')
      i += 1
  out.extend(lines[pos:])
  return ''.join(out)
