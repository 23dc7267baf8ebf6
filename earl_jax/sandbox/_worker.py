"""A worker: one per slot, trusted and single-threaded; it never runs untrusted code itself.

For each job from the launcher it makes a fresh private directory, forks the program
(`_program`), supervises it (`_supervise`), then kills and reaps everything the program started
and deletes the directory.
"""

import os
import shutil
import signal
import time

import _containment
import _libc
import _processes
import _program
import _supervise
import _wire


def worker_main(slot, uid, base_dir, config, job_r, result_w, replacement):
  """Answers the jobs on `job_r` one at a time on `result_w` until EOF. Never returns."""
  _libc.prctl(_libc.PR_SET_CHILD_SUBREAPER, 1)
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  os.makedirs(base_dir, mode=0o711, exist_ok=True)
  if uid is not None and replacement:
    _processes.kill_uid(uid)  # what the worker killed before us in this slot left running
  for name in os.listdir(base_dir):  # and the directory of the program it was running
    shutil.rmtree(os.path.join(base_dir, name), ignore_errors=True)
  worker = Worker(slot, uid, base_dir, config)
  while True:
    job = _wire.read_frame(job_r)
    if job is None:
      break
    reply = worker.run(job)
    reply.setdefault('id', job['id'])
    _wire.write_frame(result_w, reply)
    del job, reply
  _processes.kill_leftovers(uid)
  os._exit(0)


class Worker:
  """Runs one job at a time in slot `slot`: its programs run as `uid` in dirs under `base_dir`."""

  def __init__(self, slot, uid, base_dir, config):
    self.slot = slot
    self.uid = uid
    self.base_dir = base_dir
    self.config = config
    self.sequence = 0
    self.limits = _containment.rlimits(config, uid)

  def run(self, job):
    """Runs `job` (a check or a command) in a fresh directory; returns the reply."""
    started = time.monotonic()
    files = dict(job.get('files', {}))
    if job['op'] == 'check':
      files['main.py'] = job['source']
    try:
      workdir = self._make_dir(files)
    except OSError as e:
      return {'infra_error': f'worker {self.slot} could not make the program directory: {e}'}
    try:
      return self._supervise(job, workdir, started)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)

  def _make_dir(self, files):
    """A fresh private directory holding `files`, owned by the programs' uid."""
    self.sequence += 1
    workdir = os.path.join(self.base_dir, f'{os.getpid()}-{self.sequence}')
    os.mkdir(workdir, 0o700)
    for relative, content in files.items():
      path = os.path.join(workdir, relative)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, 'w', encoding='utf-8', errors='surrogatepass') as f:
        f.write(content)
    if self.uid is not None:
      for root, dirs, names in os.walk(workdir):
        for name in [*dirs, *names]:
          os.chown(os.path.join(root, name), self.uid, self.uid, follow_symlinks=False)
      os.chown(workdir, self.uid, self.uid)
    return workdir

  def _supervise(self, job, workdir, started):
    """Forks the program for `job` and watches it to its end; returns the reply."""
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    try:
      pid = os.fork()
    except OSError as e:
      for fd in (out_r, out_w, res_r, res_w):
        os.close(fd)
      return {'infra_error': f'worker {self.slot} could not fork a program: {e}'}
    if pid == 0:
      _redirect_program_fds(out_w, res_w)
      env = _containment.environment(workdir)
      _program.program_main(job, _containment.Confinement(workdir, self.uid, self.limits, env))
      os._exit(1)
    os.close(out_w)
    os.close(res_w)
    return self._watch(job, pid, out_r, res_r, started)

  def _watch(self, job, pid, out_r, res_r, started):
    """Supervises the forked program to its end, then closes its pipes; returns the reply."""
    try:
      pidfd = os.pidfd_open(pid)
    except OSError:
      pidfd = None
    try:
      if job['op'] == 'command':
        problem = _supervise.await_setup(res_r)
        if problem is None:
          reply = _supervise.watch_command(job, pid, pidfd, out_r, started, self.config, self.uid)
      else:
        problem, reply = _supervise.watch_program(
          job, pid, pidfd, out_r, res_r, started, self.config, self.uid
        )
      if problem is not None:
        _supervise.finish(pid, None, self.uid)
        return {'infra_error': f'worker {self.slot}: the program could not be set up ({problem})'}
    finally:
      for fd in (out_r, res_r, pidfd):
        if fd is not None:
          os.close(fd)
    reply['id'] = job['id']
    return reply


def _redirect_program_fds(out_w, res_w):
  """In the forked program: stdin from /dev/null, stdout and stderr to `out_w`, results to fd 3,
  nothing else open."""
  try:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.dup2(res_w, _wire.RESULT_FD)
    os.closerange(_wire.RESULT_FD + 1, 1 << 16)
  except BaseException:
    os._exit(1)
