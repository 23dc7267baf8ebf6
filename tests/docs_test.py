"""The docs: the README stays a landing page, every link and path in the docs resolves, every
current figure in docs/results.md and every results entry says when, how and where it was
measured (scripts/check_results.py), and docs/config.md is current."""

import dataclasses
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
# Top-level folders whose paths the docs name; a path under one of them must exist.
TOP = ('earl_jax', 'experiments', 'scripts', 'tests', 'notebooks', 'docs', '.ci')


def _script(name='make_config_docs'):
  spec = importlib.util.spec_from_file_location(name, ROOT / 'scripts' / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _doc_id(path):
  return str(path.relative_to(ROOT))


def _links(text: str) -> list[str]:
  return re.findall(r'\]\(([^)\s]+)\)', text)


def test_config_reference_is_current():
  expected = _script().render()
  current = (ROOT / 'docs' / 'config.md').read_text()
  assert current == expected, (
    'docs/config.md is out of date: run python scripts/make_config_docs.py'
  )


def test_check_flag_fails_on_a_stale_file(tmp_path, monkeypatch, capsys):
  script = _script()
  out = tmp_path / 'config.md'
  monkeypatch.setattr(script, 'OUT', str(out))
  monkeypatch.setattr(script, 'render', lambda: '# Config reference\n')
  monkeypatch.setattr('sys.argv', ['make_config_docs.py', '--check'])
  out.write_text('# Config reference\nold\n')
  assert script.main() == 1
  message = capsys.readouterr().out
  assert message.count('\n') == 1 and 'out of date' in message
  monkeypatch.setattr('sys.argv', ['make_config_docs.py'])
  assert script.main() == 0
  assert out.read_text() == '# Config reference\n'
  monkeypatch.setattr('sys.argv', ['make_config_docs.py', '--check'])
  assert script.main() == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Documented:
  """A config for the parser.

  Attributes:
    alpha: the first,
      continued on a second line.
    beta, gamma: two fields, one entry.
    delta / epsilon: two more.
  """

  alpha: int = 1
  beta: int = 2
  gamma: int = 3
  delta: int = 4
  epsilon: int = 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Commented:
  """No Attributes section."""

  # The comment above,
  # over two lines.
  above: int = 1
  trailing: int = 2  # the comment at the end
  bare: int = 3


def test_descriptions_come_from_the_docstring_or_the_comments():
  script = _script()
  assert script.attribute_docs(_Documented) == {
    'alpha': 'the first, continued on a second line.',
    'beta': 'two fields, one entry.',
    'gamma': 'two fields, one entry.',
    'delta': 'two more.',
    'epsilon': 'two more.',
  }
  assert script.comment_docs(_Commented) == {
    'above': 'The comment above, over two lines.',
    'trailing': 'the comment at the end',
  }


def test_reference_covers_every_config_of_the_main_job():
  from earl_jax import experiment

  script = _script()
  reachable = script.reachable(experiment.ExperimentConfig)
  text = (ROOT / 'docs' / 'config.md').read_text()
  for cls in reachable:
    assert f'\n## {cls.__name__}\n' in text, cls
    for field in dataclasses.fields(cls):
      assert f'| `{field.name}` |' in text, (cls, field.name)
  assert reachable[experiment.ExperimentConfig] == ['']
  sampling = [c for c in reachable if c.__name__ == 'SamplingConfig']
  assert sampling and reachable[sampling[0]] == ['rollout.sampling.']


@pytest.mark.parametrize('doc', DOCS, ids=_doc_id)
def test_relative_links_resolve(doc):
  text = doc.read_text()
  slugs = _script('check_results').slugs
  bad = []
  for link in _links(text):
    if re.match(r'[a-z]+:', link):  # http:, https:, mailto:
      continue
    path, _, anchor = link.partition('#')
    target = (doc.parent / path).resolve() if path else doc
    if not target.exists():
      bad.append(f'{link}: no such file')
    elif anchor and target.suffix == '.md' and anchor not in slugs(target.read_text()):
      bad.append(f'{link}: no heading with that anchor')
  assert not bad, f'{doc.name}: {bad}'


@pytest.mark.parametrize('doc', DOCS, ids=_doc_id)
def test_named_paths_exist(doc):
  text = doc.read_text()
  bad = []
  for path in re.findall(rf'(?<![\w./-])((?:{"|".join(map(re.escape, TOP))})/[\w./-]*)', text):
    path = path.rstrip('.')
    if not (ROOT / path).exists():
      bad.append(path)
  for module in re.findall(r'python -m ((?:earl_jax|experiments)(?:\.\w+)+)', text):
    base = ROOT / module.replace('.', '/')
    if not (base.with_suffix('.py').exists() or (base / '__init__.py').exists()):
      bad.append(module)
  assert not bad, f'{doc.name} names paths that do not exist: {sorted(set(bad))}'


def test_readme_is_a_landing_page():
  lines = (ROOT / 'README.md').read_text().splitlines()
  assert len(lines) <= 220, f'README.md has {len(lines)} lines; measurements go to docs/results/'
  first_block = lines[lines.index('```bash') + 1 : lines.index('```')]
  assert [line.split()[0] for line in first_block] == ['scripts/demo.sh', 'scripts/test.sh']
  assert 'scripts/test.sh' in (ROOT / '.ci' / 'run').read_text()
  assert lines.index('## Components') < 60, 'the component map belongs near the top'
  for heading in ('## The main job', '## Extending it', '## Results', '## Tests'):
    assert heading in lines, heading


def test_every_results_row_and_entry_says_when_how_and_where():
  checker = _script('check_results')
  assert checker.check(ROOT) == []
  assert len(checker.entries(ROOT)) > 20
  rows = [
    row for _, _, rows in checker.tables((ROOT / 'docs' / 'results.md').read_text()) for row in rows
  ]
  assert len(rows) > 20
  assert 'scripts/demo.sh' in rows[0][1][0], 'the first row is the demo'


_PAGE = """# Results

A new measurement adds an entry and updates its row here, not the README.

| what | figure | command | recorded | entry |
|---|---|---|---|---|
| the demo | 6:18 | `scripts/demo.sh` | 2026-12-04, `1280365` | [it](results/main.md#the-demo) |
{extra}
See [main](results/main.md) and [tried](results/tried.md).
"""
_ENTRY = """# Main

### The demo

- **Recorded:** 2026-12-04, commit `1280365`
{command}
- **Machine:** the 2-core CPU dev machine
"""


def test_check_results_catches_a_row_without_a_commit_and_an_entry_without_a_command(tmp_path):
  checker = _script('check_results')
  (tmp_path / 'docs' / 'results').mkdir(parents=True)
  page, entry = tmp_path / 'docs' / 'results.md', tmp_path / 'docs' / 'results' / 'main.md'
  (tmp_path / 'docs' / 'results' / 'tried.md').write_text('# Tried and not kept\n')
  page.write_text(_PAGE.format(extra=''))
  entry.write_text(_ENTRY.format(command='- **Command:** `scripts/demo.sh`'))
  assert checker.check(tmp_path) == []
  assert checker.main(['check_results.py', str(tmp_path)]) == 0

  row = '| the eval | 0.672 | `scripts/demo.sh` | 2026-12-03 | [it](results/main.md#the-demo) |'
  page.write_text(_PAGE.format(extra=row))
  entry.write_text(_ENTRY.format(command=''))
  problems = checker.check(tmp_path)
  assert len(problems) == 2, problems
  assert "'the eval' names no commit" in problems[0]
  assert problems[1] == 'docs/results/main.md: ### The demo: no **Command:**'
  assert checker.main(['check_results.py', str(tmp_path)]) == 1

  row = '| the eval | 0.672 | by hand | 2026-12-03, `5e62983` | [it](results/main.md#the-eval) |'
  page.write_text(_PAGE.format(extra=row))
  problems = checker.check(tmp_path)
  assert any('names no command' in p for p in problems), problems
  assert any('main.md#the-eval, no such heading' in p for p in problems), problems
