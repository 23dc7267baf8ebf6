"""The notebooks: every committed `.ipynb` matches its percent source, and each one executes on
CPU from a fresh kernel (a cell that raises fails the test)."""

import glob
import importlib.util
import os

import jupytext
import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, 'notebooks', '*.py')))


def _make_notebooks():
  spec = importlib.util.spec_from_file_location(
    'make_notebooks', os.path.join(ROOT, 'scripts', 'make_notebooks.py')
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _code(nb) -> list[str]:
  return [c.source.strip() for c in nb.cells if c.cell_type == 'code']


def test_there_are_notebooks():
  assert [os.path.basename(s) for s in SOURCES] == ['quickstart.py']


@pytest.mark.parametrize('source', SOURCES, ids=os.path.basename)
def test_committed_notebook_matches_its_source_and_has_outputs(source):
  committed = nbformat.read(os.path.splitext(source)[0] + '.ipynb', as_version=4)
  assert _code(committed) == _code(jupytext.read(source)), (
    'the .ipynb differs from its .py source: run python scripts/make_notebooks.py'
  )
  code = [c for c in committed.cells if c.cell_type == 'code']
  assert all(c.get('outputs') is not None for c in code)
  assert sum(bool(c.outputs) for c in code) >= len(code) - 1  # executed, not just converted
  assert not any(o.get('output_type') == 'error' for c in code for o in c.outputs)


@pytest.mark.multiprocess  # a kernel process
@pytest.mark.parametrize('source', SOURCES, ids=os.path.basename)
def test_notebook_executes_on_cpu(source):
  make = _make_notebooks()
  nb, seconds = make.execute(source, timeout=600)
  peak = make.peak_gb(nb)
  assert peak is not None and peak < 4.0, f'peak resident memory {peak} GB'
  assert seconds < 240
