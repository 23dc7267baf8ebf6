"""Pinned sdists from a PEP 691 index (a real HTTP server on loopback): found, checked against
the pinned sha256, cached, unpacked safely; the licence read from PKG-INFO."""

import contextlib
import dataclasses
import functools
import hashlib
import http.server
import io
import json
import os
import tarfile
import threading

import pytest

from earl_jax.swe import sources

PKG_INFO = 'Metadata-Version: 2.1\nName: demo\nVersion: 1.0\nLicense: MIT\n'


def _sdist(path, members: dict[str, str], *, link: str | None = None) -> str:
  """A .tar.gz of `members` (name -> text) at `path`; its sha256."""
  with tarfile.open(path, 'w:gz') as tar:
    for name, text in members.items():
      data = text.encode()
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
    if link:
      info = tarfile.TarInfo('demo-1.0/escape')
      info.type, info.linkname = tarfile.SYMTYPE, link
      tar.addfile(info)
  return _hash(path)


def _hash(path) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


@contextlib.contextmanager
def _index(root):
  """A PEP 691 index of `root`'s archives on 127.0.0.1 (its simple URL)."""

  class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
      pass

    def do_GET(self):
      if self.path.startswith('/simple/'):
        name = self.path.split('/')[2]
        files = [
          {
            'filename': f,
            'url': f'http://127.0.0.1:{port}/files/{f}',
            'hashes': {'sha256': _hash(os.path.join(root, f))},
          }
          for f in sorted(os.listdir(root))
          if f.startswith(name + '-')
        ]
        body = json.dumps({'files': files}).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/vnd.pypi.simple.v1+json')
        self.end_headers()
        self.wfile.write(body)
      else:
        self.path = self.path.replace('/files/', '/', 1)
        super().do_GET()

  server = http.server.ThreadingHTTPServer(
    ('127.0.0.1', 0), functools.partial(Handler, directory=str(root))
  )
  port = server.server_address[1]
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f'http://127.0.0.1:{port}/simple'
  finally:
    server.shutdown()


def test_fetch_checks_the_hash_caches_and_unpacks(tmp_path):
  served = tmp_path / 'served'
  served.mkdir()
  members = {'demo-1.0/PKG-INFO': PKG_INFO, 'demo-1.0/demo/__init__.py': 'X = 1\n',
             'demo-1.0/tests/test_demo.py': 'def test(): pass\n'}  # fmt: skip
  sha = _sdist(served / 'demo-1.0.tar.gz', members)
  project = sources.Project('demo', '1.0', sha, 'MIT', tests=('tests',), library=('demo',))
  cache = str(tmp_path / 'cache')
  with _index(served) as index:
    assert sources.find_sdist('demo', '1.0', index=index)[1] == sha
    root = sources.fetch(project, cache, index=index)
    with open(os.path.join(root, 'demo', '__init__.py')) as f:
      assert f.read() == 'X = 1\n'
    assert sources.licence(root) == 'MIT'
    with pytest.raises(sources.SourceError, match=r'lists no sdist of version 2\.0'):
      sources.find_sdist('demo', '2.0', index=index)
    # A pin that differs from the index is refused before anything is downloaded.
    wrong = dataclasses.replace(project, version='1.0', sha256='0' * 64)
    with pytest.raises(sources.SourceError, match='lists sha256'):
      sources.fetch(wrong, str(tmp_path / 'other'), index=index)
  # Cached: no index needed; a tampered archive is refused and removed.
  assert sources.fetch(project, cache, index='http://127.0.0.1:9/none') == root
  with open(os.path.join(cache, 'demo-1.0.tar.gz'), 'ab') as f:
    f.write(b'tampered')
  with pytest.raises(sources.SourceError, match='removed from the cache'):
    sources.fetch(project, cache, index='http://127.0.0.1:9/none')
  assert not os.path.exists(os.path.join(cache, 'demo-1.0.tar.gz'))


def test_an_unsafe_archive_is_refused(tmp_path):
  served = tmp_path / 'served'
  served.mkdir()
  sha = _sdist(served / 'demo-1.0.tar.gz', {'demo-1.0/PKG-INFO': PKG_INFO}, link='/etc/passwd')
  with _index(served) as index, pytest.raises(sources.SourceError, match='unsafe member'):
    sources.fetch(
      sources.Project('demo', '1.0', sha, 'MIT', tests=(), library=()),
      str(tmp_path / 'c'),
      index=index,
    )


def test_the_pinned_projects():
  assert len(sources.PROJECTS) >= 5
  for project in sources.PROJECTS.values():
    assert len(project.sha256) == 64 and project.licence in ('MIT', 'BSD') and project.tests
