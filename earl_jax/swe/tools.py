"""The tools of the `swe` environment: what a reply may call, read in two formats, and what
each call does to a repository held as text (path -> file text; nothing here touches a disk).

Tools (`TOOLS`; plain command, then the Qwen2.5 tool call's name and arguments):
  ls [DIR]             list_files {path?}            the repository's files (under DIR)
  view FILE [A B]      view_file {path, start?, end?} lines A..B, numbered 'N|text'
  search TEXT [DIR/|FILE.py]  search {text, path?}    'FILE:N|text' of lines holding TEXT
  replace FILE A B     replace_lines {path, start, end, text}
                       + the new lines               lines A..B replaced (B = A - 1 inserts
                                                      before A; no new lines deletes A..B)
  diff + a unified diff  apply_diff {diff}            a diff applied strictly (`patches`)
  test [TEST ...]      run_tests {tests?}             the tests: all, or the named ids or files
  submit               submit {}                      the end: the tests judge the repository

Plain replies: the first non-blank line is the command (a reply wrapped in one Markdown code
fence is unwrapped). Qwen replies: one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
block, as Qwen2.5-Instruct writes when its chat template declares `TOOLS` (`qwen_tools`); text
around the block is allowed. A reply that names no known tool, or an argument of the wrong kind,
is a `ToolError`, as is a path outside the repository or an edit that does not apply: the
environment answers its one-line message, and the episode goes on.

  call = tools.parse_plain('view pkg/core.py 10 20')     # Call('view', {'path': ..., ...})
  answer = tools.Workspace(files, protected=('tests',)).run(call)   # not 'test' or 'submit'
"""

import dataclasses
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from earl_jax.swe import patches

FENCE = re.compile(r'^```[^\n]*\n(.*?)\n?```\s*$', re.S)
TOOL_CALL = re.compile(r'<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)', re.S)  # cut: still read
_INT = re.compile(r'-?\d+')
MAX_LISTED = 200
MAX_MATCHES = 50


class ToolError(ValueError):
  """A call the environment refuses: its message is the observation (one line)."""


@dataclasses.dataclass(frozen=True)
class Call:
  """A parsed tool call: the plain command's name and its arguments."""

  name: str
  args: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Tool:
  name: str  # the plain command
  qwen: str  # the Qwen tool's name
  usage: str
  description: str
  parameters: dict[str, Any]  # JSON schema properties
  required: tuple[str, ...] = ()


def _string(description: str) -> dict:
  return {'type': 'string', 'description': description}


def _integer(description: str) -> dict:
  return {'type': 'integer', 'description': description}


TOOLS = (
  Tool('ls', 'list_files', 'ls [DIR]', 'List the files of the repository, or of one directory.',
       {'path': _string('A directory of the repository (default: all of it).')}),
  Tool('view', 'view_file', 'view FILE [A B]', 'Show a file, or lines A to B, numbered.',
       {'path': _string('The file.'), 'start': _integer('First line (from 1).'),
        'end': _integer('Last line.')}, ('path',)),
  Tool('search', 'search', 'search TEXT [DIR/|FILE.py]',
       'Lines that contain TEXT, in every file, or under a directory or in a file.',
       {'text': _string('The text to find.'), 'path': _string('A file or directory.')},
       ('text',)),
  Tool('replace', 'replace_lines', 'replace FILE A B, then the new lines',
       'Replace lines A to B of a file with new lines (B = A - 1 inserts before line A; no new '
       'lines deletes them).',
       {'path': _string('The file.'), 'start': _integer('First line replaced (from 1).'),
        'end': _integer('Last line replaced.'), 'text': _string('The new lines.')},
       ('path', 'start', 'end', 'text')),
  Tool('diff', 'apply_diff', 'diff, then a unified diff', 'Apply a unified diff to the files.',
       {'diff': _string('A unified diff (--- a/FILE, +++ b/FILE, @@ hunks).')}, ('diff',)),
  Tool('test', 'run_tests', 'test [TEST ...]',
       'Run the tests: all of them, or the named test ids or files.',
       {'tests': {'type': 'array', 'items': {'type': 'string'},
                  'description': 'Test ids or files (default: all).'}}),
  Tool('submit', 'submit', 'submit', 'Finish: the tests judge the repository.', {}),
)  # fmt: skip
_BY_QWEN = {t.qwen: t for t in TOOLS}
_BY_NAME = {t.name: t for t in TOOLS}


def plain_help() -> str:
  """The commands, one per line, for the plain format's first observation."""
  width = max(len(t.usage) for t in TOOLS)
  return '\n'.join(f'  {t.usage:<{width}}  {t.description}' for t in TOOLS)


def qwen_tools() -> list[dict]:
  """`TOOLS` as a chat template's `tools` (OpenAI function schemas, as Qwen2.5 declares them)."""
  return [
    {
      'type': 'function',
      'function': {
        'name': t.qwen,
        'description': t.description,
        'parameters': {
          'type': 'object',
          'properties': t.parameters,
          'required': list(t.required),
        },
      },
    }
    for t in TOOLS
  ]


def _unfenced(reply: str) -> str:
  match = FENCE.match(reply.strip())
  return match.group(1) if match else reply


def parse_plain(reply: str) -> Call:
  """The call of a plain reply.

  Raises:
    ToolError: no command, an unknown one, or bad arguments.
  """
  text = _unfenced(reply).lstrip('\n')
  first, _, rest = text.partition('\n')
  words = first.split()
  if not words:
    raise ToolError('error: empty reply; expected a command: ' + ' | '.join(_BY_NAME))
  name, args = words[0], words[1:]
  if name not in _BY_NAME:
    raise ToolError(f'error: unknown command {name!r}; expected one of: {" | ".join(_BY_NAME)}')
  if name in ('ls', 'submit', 'diff') and len(args) > (name == 'ls'):
    raise ToolError(f'error: {name} takes {"at most one argument" if name == "ls" else "none"}')
  if name == 'ls':
    return Call('ls', {'path': args[0]} if args else {})
  if name == 'submit':
    return Call('submit')
  if name == 'diff':
    return Call('diff', {'diff': _unfenced(rest)})
  if name == 'test':
    return Call('test', {'tests': args})
  if name == 'search':
    match = re.fullmatch(r'search\s+(.+?)(?:\s+(\S+/\S*|\S+\.py))?\s*', first)
    if match is None:
      raise ToolError('error: usage: search TEXT [DIR/|FILE.py]')
    text, path = match.groups()
    return Call('search', {'text': text, **({'path': path} if path else {})})
  numbers = args[1:]
  if not args or not all(_INT.fullmatch(n) for n in numbers):
    raise ToolError(f'error: usage: {_BY_NAME[name].usage}')
  if name == 'view':
    if len(numbers) not in (0, 2):
      raise ToolError('error: usage: view FILE [A B]')
    lines = {'start': int(numbers[0]), 'end': int(numbers[1])} if numbers else {}
    return Call('view', {'path': args[0], **lines})
  if len(numbers) != 2:
    raise ToolError('error: usage: replace FILE A B, then the new lines')
  return Call(
    'replace',
    {'path': args[0], 'start': int(numbers[0]), 'end': int(numbers[1]), 'text': _unfenced(rest)},
  )


_KINDS = {
  'string': (lambda v: isinstance(v, str), 'a string'),
  'integer': (lambda v: isinstance(v, int) and not isinstance(v, bool), 'an integer'),
  'array': (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), 'strings'),
}


def parse_qwen(reply: str) -> Call:
  """The call of a Qwen2.5 tool-call reply (the first `<tool_call>` block).

  Raises:
    ToolError: no block, JSON that does not parse, an unknown tool or bad arguments.
  """
  match = TOOL_CALL.search(reply)
  if match is None:
    raise ToolError('error: no <tool_call> in the reply; call one of the tools')
  try:
    call = json.loads(match.group(1))
  except ValueError as e:
    raise ToolError(f'error: the tool call is not JSON: {e}') from None
  if not isinstance(call, dict) or not isinstance(call.get('name'), str):
    raise ToolError('error: expected {"name": TOOL, "arguments": {...}}')
  tool = _BY_QWEN.get(call['name'])
  if tool is None:
    raise ToolError(f'error: unknown tool {call["name"]!r}; tools: {", ".join(_BY_QWEN)}')
  args = call.get('arguments', {})
  if isinstance(args, str):  # some models write the arguments as a JSON string
    try:
      args = json.loads(args)
    except ValueError:
      args = None
  if not isinstance(args, dict):
    raise ToolError(f'error: the arguments of {tool.qwen} must be an object')
  missing = [k for k in tool.required if k not in args]
  unknown = [k for k in args if k not in tool.parameters]
  if missing or unknown:
    raise ToolError(f'error: {tool.qwen}: missing {missing}, unknown {unknown} arguments')
  for key, value in args.items():
    kind = tool.parameters[key]['type']
    if not _KINDS[kind][0](value):
      raise ToolError(f'error: {tool.qwen}: {key} must be {_KINDS[kind][1]}, got {value!r}')
  return Call(tool.name, args)


def _numbered(path: str, text: str, first: int, last: int) -> str:
  lines = text.split('\n')
  if lines and lines[-1] == '':
    lines = lines[:-1]
  return f'{path}:\n' + ''.join(f'{n}|{lines[n - 1]}\n' for n in range(first, last + 1))


class Workspace:
  """A repository as text, and the calls that read or edit it (`ls`, `view`, `search`,
  `replace`, `diff`). `protected` paths (the tests) can be edited: what counts at submit is
  the rest (`library_files`)."""

  def __init__(self, files: Mapping[str, str], protected: Sequence[str] = ()):
    self.files = dict(files)
    self.protected = tuple(p.rstrip('/') for p in protected)

  def path(self, path: str, *, directory: bool = False) -> str:
    """`path` normalised inside the repository.

    Raises:
      ToolError: an absolute path, one that leaves the repository, or no such file.
    """
    if not isinstance(path, str) or not path or '\0' in path:
      raise ToolError(f'error: bad path {path!r}')
    norm = posixpath.normpath(path.strip())
    if posixpath.isabs(norm) or norm == '..' or norm.startswith('../'):
      raise ToolError(f'error: {path!r} is outside the repository')
    if norm == '.':
      return ''
    if directory:
      if norm in self.files or any(f.startswith(norm + '/') for f in self.files):
        return norm
      raise ToolError(f'error: no file or directory {path!r} in the repository')
    if norm not in self.files:
      raise ToolError(f'error: no file {path!r} in the repository (ls lists them)')
    return norm

  def _under(self, prefix: str) -> list[str]:
    return sorted(f for f in self.files if not prefix or f == prefix or f.startswith(prefix + '/'))

  def is_protected(self, path: str) -> bool:
    name = posixpath.basename(path)
    return (
      name.startswith('test_')
      or name == 'conftest.py'
      or any(path == p or path.startswith(p + '/') for p in self.protected)
    )

  def run(self, call: Call) -> str:
    """The answer to a reading or editing call.

    Raises:
      ToolError: a bad path, lines out of range, a diff that does not apply.
    """
    args = call.args
    if call.name == 'ls':
      listed = self._under(self.path(args.get('path', '.'), directory=True))
      more = f'... and {len(listed) - MAX_LISTED} more\n' if len(listed) > MAX_LISTED else ''
      return ''.join(f'{f}\n' for f in listed[:MAX_LISTED]) + more
    if call.name == 'view':
      path = self.path(args['path'])
      count = len(self.files[path].splitlines())
      first, last = args.get('start', 1), args.get('end', count)
      if not 1 <= first <= last <= max(count, 1):
        raise ToolError(f'error: lines {first}-{last} are outside 1-{count} of {path}')
      return _numbered(path, self.files[path], first, min(last, count))
    if call.name == 'search':
      text = args['text']
      if not text:
        raise ToolError('error: search needs a text')
      found = [
        f'{f}:{n}|{line}\n'
        for f in self._under(self.path(args.get('path', '.'), directory=True))
        for n, line in enumerate(self.files[f].splitlines(), 1)
        if text in line
      ]
      more = f'... and {len(found) - MAX_MATCHES} more\n' if len(found) > MAX_MATCHES else ''
      return ''.join(found[:MAX_MATCHES]) + more if found else f'no line holds {text!r}\n'
    if call.name == 'replace':
      path = self.path(args['path'])
      lines = self.files[path].splitlines()
      first, last = args['start'], args['end']
      if not (1 <= first <= len(lines) + 1 and first - 1 <= last <= len(lines)):
        raise ToolError(
          f'error: lines {first}-{last} cannot be replaced in {path} (lines 1-{len(lines)})'
        )
      new = args['text'].splitlines()
      lines[first - 1 : last] = new
      self.files[path] = '\n'.join(lines) + '\n'
      return f'{path}: replaced lines {first}-{last} with {len(new)} lines; now {len(lines)}\n'
    if call.name == 'diff':
      for path in patches.files(args['diff']):
        self.path(path)
      try:
        self.files = patches.apply_all(self.files, args['diff'])
      except patches.PatchError as e:
        raise ToolError(f'error: the diff does not apply: {e}') from None
      return f'applied to {", ".join(patches.files(args["diff"]))}\n'
    raise ValueError(f'Workspace.run does not run {call.name!r}')

  def library_files(self) -> dict[str, str]:
    """The files that count at submit: every file but the protected ones."""
    return {f: t for f, t in self.files.items() if not self.is_protected(f)}
