"""Per-project virtualenvs for running a project's tests: pytest (pinned) and the project's own
test requirements, installed once from the package index and cached.

The project itself is never installed: its files are copied into the sandbox and imported from
there (`Project.pythonpath`), so the bug under test is the code that runs. A virtualenv is made
with the interpreter that runs the builder (the sandbox exposes that interpreter's prefix), in
place, and marked complete last: a cut install is made again, never used.

  python = venvs.ensure('.earl_cache/swe/venvs', project.requirements)   # .../bin/python
"""

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

_COMPLETE = '.earl-complete'


class VenvError(RuntimeError):
  """A virtualenv that could not be made (the index unreachable, a requirement not found)."""


def key(requirements: Sequence[str], python: str = sys.executable) -> str:
  """The cache key of a virtualenv: its requirements and the interpreter's version."""
  version = subprocess.run(
    [python, '-c', 'import sys; print(sys.version)'], capture_output=True, text=True, check=True
  ).stdout.strip()
  text = '\n'.join([version, *sorted(requirements)])
  return hashlib.sha256(text.encode()).hexdigest()[:12]


def ensure(
  cache_dir: str,
  requirements: Sequence[str],
  *,
  python: str = sys.executable,
  index_url: str | None = None,
) -> str:
  """The interpreter of a virtualenv with `requirements` under `cache_dir` (made once, by key).
  Must not be under /tmp: the sandbox gives its programs an empty /tmp.

  Raises:
    VenvError: the virtualenv or an install failed (pip's last lines in the message).
  """
  root = os.path.join(os.path.abspath(cache_dir), key(requirements, python))
  interpreter = os.path.join(root, 'bin', 'python')
  if os.path.exists(os.path.join(root, _COMPLETE)):
    return interpreter
  os.makedirs(os.path.dirname(root), exist_ok=True)
  with open(root + '.lock', 'w') as lock:  # processes of one host make it once, in turn
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(os.path.join(root, _COMPLETE)):
      _make(root, requirements, python, index_url)
  return interpreter


def _make(root: str, requirements: Sequence[str], python: str, index_url: str | None) -> None:
  interpreter = os.path.join(root, 'bin', 'python')
  shutil.rmtree(root, ignore_errors=True)
  pip = [interpreter, '-m', 'pip', 'install', '--quiet', '--disable-pip-version-check']
  if index_url:
    pip += ['--index-url', index_url]
  steps = [[python, '-m', 'venv', root]] + ([[*pip, *requirements]] if requirements else [])
  for argv in steps:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
      shutil.rmtree(root, ignore_errors=True)
      tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
      raise VenvError(f'{" ".join(argv[:4])} ... failed: {" | ".join(tail)}')
  with open(os.path.join(root, _COMPLETE), 'w') as f:
    f.write('\n'.join(requirements) + '\n')
