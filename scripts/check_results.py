"""Checks docs/results.md (the current figures) and docs/results/*.md (the dated entries).

  python scripts/check_results.py          # this checkout
  python scripts/check_results.py ROOT     # another tree with docs/results.md and docs/results/

Every row of every table in docs/results.md names a command (in backticks), a date (YYYY-MM-DD)
and a commit (7+ hex digits in backticks), and links to an entry: a heading that exists in the
docs/results/*.md file it names. Every `### ` entry under docs/results/ says when, how and where
(`**Recorded:** YYYY-MM-DD, commit `hex``, `**Command:**`, `**Machine:**`). Prints one line per
problem and exits 1 if there is any. Standard library only.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLUMNS = ['what', 'figure', 'command', 'recorded', 'entry']
RECORDED = re.compile(r'\*\*Recorded:\*\* \d{4}-\d\d-\d\d, commits? `[0-9a-f]{7}')
DATE = re.compile(r'\b\d{4}-\d\d-\d\d\b')
COMMIT = re.compile(r'`[0-9a-f]{7,40}`')
LINK = re.compile(r'\]\(([^)\s]+)\)')
ENTRY_LINK = re.compile(r'\]\((results/[\w.-]+\.md)#([^)\s]+)\)')


def slugs(text: str) -> set[str]:
  """GitHub's heading anchors of a markdown file (repeats get -1, -2, ...)."""
  seen: dict[str, int] = {}
  out = set()
  in_code = False
  for line in text.splitlines():
    if line.startswith('```'):
      in_code = not in_code
    m = re.match(r'#{1,6} (.*)', line)
    if in_code or not m:
      continue
    slug = re.sub(r'[^\w\- ]', '', m.group(1).strip().lower()).replace(' ', '-')
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f'{slug}-{n}')
  return out


def cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip('|').split('|')]


def tables(text: str):
  """(line number, header cells, [(line number, row cells)]) for each table of a markdown file."""
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    if lines[i].startswith('|') and i + 1 < len(lines) and re.match(r'\|[-:| ]+\|$', lines[i + 1]):
      start, header = i + 1, cells(lines[i])
      i += 2
      rows = []
      while i < len(lines) and lines[i].startswith('|'):
        rows.append((i + 1, cells(lines[i])))
        i += 1
      yield start, header, rows
    else:
      i += 1


def entries(root: pathlib.Path) -> list[tuple[str, str, str]]:
  """(file name, heading, text) of every `### ` entry in docs/results/*.md."""
  out = []
  for path in sorted((root / 'docs' / 'results').glob('*.md')):
    for chunk in re.split(r'\n(?=### )', path.read_text())[1:]:
      out.append((path.name, chunk.splitlines()[0], chunk.split('\n## ')[0]))
  return out


def check_rows(root: pathlib.Path) -> list[str]:
  page = root / 'docs' / 'results.md'
  if not page.exists():
    return ['docs/results.md: missing']
  text = page.read_text()
  problems = []
  if 'not the README' not in ' '.join(text.split()):
    problems.append(
      'docs/results.md: does not say that a new measurement changes it, not the README'
    )
  anchors: dict[str, set[str]] = {}
  n_rows = 0
  for start, header, rows in tables(text):
    where = f'docs/results.md:{start}'
    if [h.lower() for h in header] != COLUMNS:
      problems.append(f'{where}: columns {header}, expected {COLUMNS}')
      continue
    for line, row in rows:
      n_rows += 1
      where = f'docs/results.md:{line}'
      if len(row) != len(COLUMNS):
        problems.append(f'{where}: {len(row)} cells, expected {len(COLUMNS)}')
        continue
      what, _, command, recorded, entry = row
      if not re.search(r'`[^`]+`', command):
        problems.append(f'{where}: {what!r} names no command (in backticks)')
      if not DATE.search(recorded):
        problems.append(f'{where}: {what!r} names no date (YYYY-MM-DD)')
      if not COMMIT.search(recorded):
        problems.append(f'{where}: {what!r} names no commit (7+ hex digits in backticks)')
      if not ENTRY_LINK.search(entry):
        problems.append(f'{where}: {what!r} links to no entry (results/<file>.md#<anchor>)')
      for file, anchor in ENTRY_LINK.findall(' | '.join(row)):
        target = root / 'docs' / file
        if not target.exists():
          problems.append(f'{where}: {what!r} links to {file}, which does not exist')
          continue
        if file not in anchors:
          anchors[file] = slugs(target.read_text())
        if anchor not in anchors[file]:
          problems.append(f'{where}: {what!r} links to {file}#{anchor}, no such heading')
  if not n_rows:
    problems.append('docs/results.md: no table rows')
  linked = {link.partition('#')[0] for link in LINK.findall(text)}
  for path in sorted((root / 'docs' / 'results').glob('*.md')):
    if path.name != 'README.md' and f'results/{path.name}' not in linked:
      problems.append(f'docs/results.md: does not link to results/{path.name}')
  return problems


def check_entries(root: pathlib.Path) -> list[str]:
  problems = []
  found = entries(root)
  if not found:
    problems.append('docs/results/: no entries')
  for file, title, body in found:
    where = f'docs/results/{file}: {title}'
    if not RECORDED.search(body):
      problems.append(f'{where}: no **Recorded:** YYYY-MM-DD, commit `hex`')
    for field in ('**Command:**', '**Machine:**'):
      if field not in body:
        problems.append(f'{where}: no {field}')
  tried = [
    p
    for p in (root / 'docs' / 'results').glob('*.md')
    if p.read_text().startswith('# Tried and not kept\n')
  ]
  if not tried:
    problems.append('docs/results/: no file starts with "# Tried and not kept"')
  return problems


def check(root: pathlib.Path = ROOT) -> list[str]:
  """Every problem with the results pages under root, one line each."""
  return check_rows(root) + check_entries(root)


def main(argv: list[str]) -> int:
  root = pathlib.Path(argv[1]) if len(argv) > 1 else ROOT
  problems = check(root)
  for problem in problems:
    print(problem)
  return 1 if problems else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
