"""The launcher's pool of workers: starts them, routes jobs to idle ones and results back,
replaces a worker that dies (its job answered as a crash), and stops them all at the end."""

import collections
import contextlib
import os
import select
import shutil
import signal
import tempfile
import time

import _mounts
import _processes
import _wire
import _worker


class WorkerPool:
  """One worker per slot, fed from the parent's channel (`channel_in`), answering on
  `channel_out`."""

  def __init__(self, config, channel_in, channel_out):
    self.config = config
    self.channel_in = channel_in
    self.channel_out = channel_out
    self.workers = int(config['workers'])
    self.uids = [None] * self.workers
    if config['uid_base'] is not None and os.geteuid() == 0:
      self.uids = [int(config['uid_base']) + slot for slot in range(self.workers)]
    self.base_dirs = []
    self.private_base = None
    self.slots = {}  # slot -> dict(pid, pidfd, job_w, reader, job, jobs_done)
    self.queue = collections.deque()
    self.failed_starts = 0

  def setup(self):
    """Makes each worker's directory (a private tmpfs with namespaces) and starts the workers."""
    if self.config['namespaces']:
      self.base_dirs = _mounts.mount_namespace(self.workers, int(self.config['disk_mib']))
    else:
      self.private_base = tempfile.mkdtemp(prefix='earl-sandbox-')
      os.chmod(self.private_base, 0o711)
      self.base_dirs = [os.path.join(self.private_base, f'w{s}') for s in range(self.workers)]
    for slot in range(self.workers):
      self._start_worker(slot)

  def loop(self):
    """Routes jobs to idle workers and their results back until the parent's channel closes."""
    jobs_in = _wire.FrameReader(self.channel_in)
    os.set_blocking(self.channel_in, False)
    while True:
      poller, by_fd = self._poller()
      events = poller.poll(1000)
      if not events:
        _reap_all_but(self.slots)
        continue
      dead = set()
      for fd, _ in events:
        if fd == self.channel_in:
          frames, eof = jobs_in.read()
          self.queue.extend(frames)
          if eof:
            return
          continue
        slot, what = by_fd[fd]
        if what == 'exit' or self._forward_results(self.slots[slot]):
          dead.add(slot)
      for slot in dead:
        self._worker_died(slot)
      self._dispatch()

  def shutdown(self):
    """Stops every worker (SIGKILL after 2 s), then every process of theirs."""
    for worker in self.slots.values():
      os.close(worker['job_w'])  # the worker kills its program's leftovers and exits
    deadline = time.monotonic() + 2.0
    for worker in self.slots.values():
      while time.monotonic() < deadline:
        done, _ = os.waitpid(worker['pid'], os.WNOHANG)
        if done:
          break
        time.sleep(0.01)
      else:
        with contextlib.suppress(ProcessLookupError):
          os.kill(worker['pid'], signal.SIGKILL)
    for uid in self.uids:
      if uid is not None:
        _processes.kill_uid(uid)
    _processes.kill_leftovers(None)
    if self.private_base is not None:
      shutil.rmtree(self.private_base, ignore_errors=True)

  def _start_worker(self, slot, replacement=False):
    """Forks the worker of `slot`, with a job pipe to it and a result pipe from it."""
    job_r, job_w = os.pipe()
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:
      try:
        self._close_other_channels(job_w, result_r, keep={job_r, result_w})
        _worker.worker_main(
          slot, self.uids[slot], self.base_dirs[slot], self.config, job_r, result_w, replacement
        )
      except BaseException as e:
        os.write(2, f'sandbox worker {slot}: {e!r}\n'.encode())
      os._exit(1)
    os.close(job_r)
    os.close(result_w)
    os.set_blocking(result_r, False)
    self.slots[slot] = {
      'pid': pid,
      'pidfd': os.pidfd_open(pid),
      'job_w': job_w,
      'reader': _wire.FrameReader(result_r),
      'job': None,
      'jobs_done': 0,
    }

  def _close_other_channels(self, job_w, result_r, keep):
    """In a new worker: closes the parent's channel, the pool's ends of its own pipes and the
    other workers' pipes."""
    os.close(job_w)
    os.close(result_r)
    for fd in [self.channel_in, self.channel_out]:
      os.close(fd)
    for other in self.slots.values():
      for fd in (other['job_w'], other['reader'].fd, other['pidfd']):
        if fd not in keep:
          os.close(fd)

  def _poller(self):
    """A poll object over the parent's channel and every worker's results and exit; and
    fd -> (slot, 'result' or 'exit')."""
    poller = select.poll()
    poller.register(self.channel_in, select.POLLIN)
    by_fd = {}
    for slot, worker in self.slots.items():
      poller.register(worker['reader'].fd, select.POLLIN)
      poller.register(worker['pidfd'], select.POLLIN)
      by_fd[worker['reader'].fd] = (slot, 'result')
      by_fd[worker['pidfd']] = (slot, 'exit')
    return poller, by_fd

  def _forward_results(self, worker):
    """Sends the parent every result `worker` has written; True at the end of its pipe."""
    frames, eof = worker['reader'].read()
    self._forward(worker, frames)
    return eof

  def _forward(self, worker, frames):
    for frame in frames:
      _wire.write_frame(self.channel_out, frame)
      worker['job'] = None
      worker['jobs_done'] += 1

  def _dispatch(self):
    """Hands queued jobs to idle workers."""
    for _slot, worker in self.slots.items():
      if not self.queue:
        return
      if worker['job'] is None:
        job = self.queue.popleft()
        worker['job'] = job
        # If it died, its pidfd reports it and the job is answered as a crash.
        with contextlib.suppress(OSError):
          _wire.write_frame(worker['job_w'], job)

  def _worker_died(self, slot):
    """Answers a dead worker's job as a crash (after any result it did write) and replaces it;
    RuntimeError when workers keep dying at start."""
    worker = self.slots.pop(slot)
    how = self._reap_worker(worker)
    if worker['job'] is not None:
      _wire.write_frame(self.channel_out, {'id': worker['job']['id'], 'worker_died': how})
    if worker['jobs_done'] == 0 and worker['job'] is None:
      self.failed_starts += 1
      if self.failed_starts >= 3:
        raise RuntimeError(f'sandbox worker {slot} keeps dying at start ({how})')
    else:
      self.failed_starts = 0
    self._kill_orphans()
    self._start_worker(slot, replacement=True)

  def _reap_worker(self, worker):
    """Kills and reaps `worker`, forwards the results it wrote, closes its pipes; returns how it
    ended."""
    with contextlib.suppress(ProcessLookupError):
      os.kill(worker['pid'], signal.SIGKILL)
    _, status = os.waitpid(worker['pid'], 0)
    frames, eof = [], False
    while not eof:  # a result it wrote before dying still counts
      more, eof = worker['reader'].read()
      frames += more
      eof = eof or not more
    self._forward(worker, frames)
    for fd in (worker['job_w'], worker['reader'].fd, worker['pidfd']):
      os.close(fd)
    if os.WIFSIGNALED(status):
      return f'killed by signal {os.WTERMSIG(status)}'
    return f'exited with code {os.WEXITSTATUS(status)}'

  def _kill_orphans(self):
    """Orphans of a dead worker reparent to us (PID 1 or a subreaper): kill and reap them."""
    workers = {w['pid'] for w in self.slots.values()}
    for pid in _processes.children(os.getpid()):
      if pid not in workers:
        try:
          os.kill(pid, signal.SIGKILL)
          os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
          pass


def _reap_all_but(slots):
  """Reaps the exited children of the launcher that are not workers."""
  workers = {w['pid'] for w in slots.values()}
  for pid in _processes.children(os.getpid()):
    if pid not in workers:
      with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
