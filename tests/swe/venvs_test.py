"""Per-project virtualenvs: made once, reused by key, a cut one made again, a failed install
one line (no index needed: no requirement, or a local path that does not exist)."""

import os

import pytest

from earl_jax.swe import venvs


def test_made_once_reused_and_a_cut_one_made_again(tmp_path):
  python = venvs.ensure(str(tmp_path), ())
  assert os.path.exists(python) and python.startswith(str(tmp_path))
  marker = os.path.join(os.path.dirname(os.path.dirname(python)), '.earl-complete')
  mtime = os.path.getmtime(marker)
  assert venvs.ensure(str(tmp_path), ()) == python and os.path.getmtime(marker) == mtime
  os.remove(marker)  # as a cut install leaves it
  stray = os.path.join(os.path.dirname(marker), 'stray')
  open(stray, 'w').close()
  assert venvs.ensure(str(tmp_path), ()) == python
  assert os.path.exists(marker) and not os.path.exists(stray)
  assert venvs.key(('a==1',)) != venvs.key(())


def test_a_failed_install_is_one_line_and_leaves_nothing(tmp_path):
  with pytest.raises(venvs.VenvError, match='failed') as info:
    venvs.ensure(str(tmp_path), (str(tmp_path / 'no-such-project'),))
  assert '\n' not in str(info.value)
  assert [p for p in os.listdir(tmp_path) if not p.endswith('.lock')] == []  # no virtualenv
