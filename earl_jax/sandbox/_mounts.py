"""The launcher's view of the file system (namespaces only), made once, in named steps.

Everything read-only; /tmp and the host's other scratch places (/run, /var/tmp, /dev/shm) empty;
the interpreter reachable by the programs' uids; a private tmpfs per worker under /tmp.
"""

import errno
import os
import re
import sys

import _libc

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE = 32, 1024, 2048, 4096, 8192
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_MOUNT_FLAGS = {  # mount options (mountinfo) a read-only remount must keep
  'nosuid': MS_NOSUID,
  'nodev': MS_NODEV,
  'noexec': MS_NOEXEC,
  'noatime': MS_NOATIME,
  'nodiratime': MS_NODIRATIME,
  'relatime': MS_RELATIME,
  'strictatime': MS_STRICTATIME,
}
_HIDDEN = ('/run', '/var/tmp', '/dev/shm')


def mount_namespace(workers, disk_mib):
  """Everything read-only; /tmp, /run, /var/tmp and /dev/shm empty; the interpreter reachable;
  a private tmpfs per worker under /tmp. Returns the per-worker directories."""
  _make_mounts_private()
  prefixes = _interpreter_prefixes()
  _cover_scratch_places(prefixes)
  _expose(prefixes)
  _remount_read_only()
  return _worker_tmpfs(workers, disk_mib)


def blocked_ancestor(path):
  """The first directory above `path` that other users cannot enter (None if there is none)."""
  parts = path.strip('/').split('/')
  for i in range(1, len(parts)):
    ancestor = '/' + '/'.join(parts[:i])
    if not os.stat(ancestor).st_mode & 0o001:
      return ancestor
  return None


def _make_mounts_private():
  """Stops mounts made here from propagating back to the host."""
  _libc.mount(None, '/', None, MS_REC | MS_PRIVATE)


def _venv_root():
  """The virtualenv the interpreter was started from (under -S, sys.prefix does not say), or
  the directory of the executable: programs and commands run `sys.executable` by that path."""
  bin_dir = os.path.realpath(os.path.dirname(os.path.abspath(sys.executable)))
  root = os.path.dirname(bin_dir)
  return root if os.path.isfile(os.path.join(root, 'pyvenv.cfg')) else bin_dir


def _interpreter_prefixes():
  """The directories the interpreter and its standard library live in (resolved, sorted)."""
  return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, _venv_root())})


def _cover_scratch_places(prefixes):
  """An empty tmpfs over /tmp and over the host's other scratch places and daemons' sockets; an
  interpreter inside one of them (a virtualenv under /tmp) is bound back in at its own path."""
  covered = ['/tmp', *(d for d in _HIDDEN if os.path.isdir(d) and not os.path.islink(d))]
  # Such an interpreter is held by a file descriptor while the tmpfs goes on.
  held = {
    path: os.open(path, os.O_PATH | os.O_DIRECTORY)
    for path in prefixes
    if any(path.startswith(directory + '/') for directory in covered)
  }
  _libc.mount('tmpfs', '/tmp', 'tmpfs', MS_NOSUID | MS_NODEV, 'mode=0755,size=1m')
  for shared in covered[1:]:
    _libc.mount('tmpfs', shared, 'tmpfs', MS_NOSUID | MS_NODEV, 'mode=0755,size=64k')
  for path, fd in held.items():
    os.makedirs(path, 0o755, exist_ok=True)
    _libc.mount(f'/proc/self/fd/{fd}', path, None, MS_BIND | MS_REC)
    os.close(fd)


def _expose(paths):
  """Makes each of `paths` reachable by any uid: a tmpfs covers its first ancestor that others
  cannot enter (hiding the rest of it, e.g. /root), and the path is bound back in below it."""
  by_ancestor = {}
  for path in paths:
    ancestor = blocked_ancestor(path)
    if ancestor is not None:
      by_ancestor.setdefault(ancestor, []).append(path)
  count = 0
  for ancestor, targets in by_ancestor.items():
    staged = []
    for target in targets:
      stage = f'/tmp/.stage{count}'
      count += 1
      os.mkdir(stage, 0o700)
      _libc.mount(target, stage, None, MS_BIND | MS_REC)
      staged.append((stage, target))
    _libc.mount('tmpfs', ancestor, 'tmpfs', MS_NOSUID | MS_NODEV, 'mode=0755,size=1m')
    for stage, target in staged:
      os.makedirs(target, 0o755, exist_ok=True)
      _libc.mount(stage, target, None, MS_MOVE)
      os.rmdir(stage)


def _remount_read_only():
  """Remounts every mount read-only (keeping its options) but /proc and the private /tmp."""
  with open('/proc/self/mountinfo') as f:
    lines = f.read().splitlines()
  for line in lines:
    fields = line.split()
    target = re.sub(r'\\([0-7]{3})', lambda m: chr(int(m.group(1), 8)), fields[4])
    if target in ('/proc', '/tmp') or target.startswith('/proc/'):
      continue
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for option in fields[5].split(','):
      flags |= _MOUNT_FLAGS.get(option, 0)
    try:
      _libc.mount(None, target, None, flags)
    except OSError as e:
      if e.errno not in (errno.ENOENT, errno.EACCES) or target == '/':
        raise


def _worker_tmpfs(workers, disk_mib):
  """A private tmpfs of `disk_mib` per worker, /tmp/w<slot>; returns their paths."""
  dirs = []
  for slot in range(workers):
    path = f'/tmp/w{slot}'
    os.mkdir(path, 0o711)
    _libc.mount('tmpfs', path, 'tmpfs', MS_NOSUID | MS_NODEV, f'mode=0711,size={disk_mib}m')
    dirs.append(path)
  return dirs
