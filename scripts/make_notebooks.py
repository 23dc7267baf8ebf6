"""Regenerates the notebooks: every `notebooks/*.py` (a jupytext percent source) as an `.ipynb`
executed here, with its outputs.

  python scripts/make_notebooks.py                       # every notebook
  python scripts/make_notebooks.py notebooks/quickstart.py

The `.py` files are the reviewable sources; the `.ipynb` files are what Colab opens, committed
with the outputs of a real run. Each is executed with nbclient in a fresh kernel from the
repository root; a cell that raises fails the run. Prints each notebook's time and the peak
resident memory its kernel reported in its last cell.
"""

import glob
import os
import re
import sys
import time

import jupytext
import nbformat
from nbclient import NotebookClient

from earl_jax import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(
  source: str, *, timeout: int = 900, env: dict[str, str] | None = None
) -> tuple[nbformat.NotebookNode, float]:
  """The notebook of a percent source, executed (its kernel's environment: this one's, without
  a fake-device count in XLA_FLAGS, plus `env`); and its run time in seconds."""
  nb = jupytext.read(source)
  nb.metadata['kernelspec'] = {'display_name': 'Python 3', 'language': 'python', 'name': 'python3'}
  flags = distributed.xla_flags_without_device_count(os.environ.get('XLA_FLAGS', ''))
  env = {**os.environ, 'XLA_FLAGS': ' '.join(flags), **(env or {})}
  t0 = time.perf_counter()
  client = NotebookClient(
    nb, timeout=timeout, kernel_name='python3', resources={'metadata': {'path': ROOT}}
  )
  old = dict(os.environ)
  os.environ.clear()
  os.environ.update(env)
  try:
    client.execute()
  finally:
    os.environ.clear()
    os.environ.update(old)
  return nb, time.perf_counter() - t0


def peak_gb(nb: nbformat.NotebookNode) -> float | None:
  """The peak resident memory the notebook's last cell printed, if it did."""
  for cell in reversed(nb.cells):
    for out in cell.get('outputs', []):
      m = re.search(r'peak resident memory: ([0-9.]+) GB', out.get('text', ''))
      if m:
        return float(m.group(1))
  return None


def main(argv: list[str]) -> int:
  sources = argv or sorted(glob.glob(os.path.join(ROOT, 'notebooks', '*.py')))
  for source in sources:
    nb, seconds = execute(source)
    target = os.path.splitext(source)[0] + '.ipynb'
    nbformat.write(nb, target)
    peak = peak_gb(nb)
    print(f'{os.path.relpath(target, ROOT)}: {seconds:.0f} s, peak resident memory '
          f'{"-" if peak is None else f"{peak:.2f} GB"}')  # fmt: skip
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
