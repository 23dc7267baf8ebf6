"""Supervision of one running program or command, by its (trusted, single-threaded) worker.

The deadlines (per test, per program, per command), the memory of the whole process tree
(sampled every `MEMORY_SAMPLE_S`), the capped output, the program's result frames (accepted only
well-formed and in order), and at the end killing and reaping everything the program started.
"""

import contextlib
import os
import select
import signal
import time

import _processes
import _wire

MEMORY_SAMPLE_S = 0.1  # how often the resident memory of a running program's processes is summed
_SETUP_TIMEOUT_S = 10.0  # a command's program must report its setup frame within this


class CappedOutput:
  """Keeps the first and the last `cap // 2` bytes of a stream and counts the rest."""

  def __init__(self, cap):
    self.half = max(cap // 2, 1)
    self.head = bytearray()
    self.tail = bytearray()
    self.total = 0

  def add(self, chunk):
    self.total += len(chunk)
    room = self.half - len(self.head)
    if room > 0:
      self.head += chunk[:room]
      chunk = chunk[room:]
    if chunk:
      self.tail += chunk
      if len(self.tail) > 2 * self.half:
        del self.tail[: len(self.tail) - self.half]

  def text(self):
    tail = bytes(self.tail[-self.half :])
    omitted = self.total - len(self.head) - len(tail)
    middle = f'\n... [{omitted} bytes omitted] ...\n'.encode() if omitted > 0 else b''
    return (bytes(self.head) + middle + tail).decode('utf-8', errors='replace')


class _MemoryWatch:
  """Samples the resident memory of this worker's process tree against twice `memory_mib`
  (RLIMIT_AS binds one process only)."""

  def __init__(self, memory_mib, started):
    self.limit = 2 * (int(memory_mib) << 20)
    self.next_sample = started + MEMORY_SAMPLE_S

  def over(self, now):
    """Whether a sample is due at `now` and finds the tree over the limit."""
    if now < self.next_sample:
      return False
    self.next_sample = now + MEMORY_SAMPLE_S
    return _processes.tree_rss(os.getpid()) > self.limit


def _poller(*fds):
  """A poll object watching each of `fds` that is not None for input."""
  poller = select.poll()
  for fd in fds:
    if fd is not None:
      poller.register(fd, select.POLLIN)
  return poller


def _read_output(fd, output, poller):
  """Adds what `fd` holds to `output`; at its end, stops polling it and returns False."""
  chunk = os.read(fd, 1 << 16)
  if chunk:
    output.add(chunk)
    return True
  poller.unregister(fd)
  return False


def await_setup(res_r):
  """Waits for the program's setup frame (nothing untrusted has run before it); None if it came."""
  want = _wire.result_frame(_wire.INDEX_SETUP, _wire.KIND_SETUP)
  got = b''
  deadline = time.monotonic() + _SETUP_TIMEOUT_S
  while len(got) < len(want):
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([res_r], [], [], left)[0]:
      return f'no answer within {_SETUP_TIMEOUT_S:g} s'
    chunk = os.read(res_r, len(want) - len(got))
    if not chunk:
      return 'it exited before its limits were in place'
    got += chunk
  return None if got == want else 'a wrong setup frame'


def finish(pid, status, uid):
  """Kills the program's tree (whatever it did) and reaps it; returns (status, rusage, clean)."""
  # Before the leader is reaped, so that its pgid cannot have been reused.
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(pid, signal.SIGKILL)
  rusage = None
  if status is None:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)
    _, status, rusage = os.wait4(pid, 0)
  clean = _processes.kill_leftovers(uid)
  return status, rusage, clean


def status_fields(status, rusage, killed):
  """The reply's fields on how the program ended: its signal or exit code, and CPU seconds."""
  fields = {'killed_by_us': killed, 'signal': None, 'exit_code': None, 'cpu_s': None}
  if rusage is not None:
    fields['cpu_s'] = rusage.ru_utime + rusage.ru_stime
  if status is not None:
    if os.WIFSIGNALED(status):
      fields['signal'] = os.WTERMSIG(status)
    elif os.WIFEXITED(status):
      fields['exit_code'] = os.WEXITSTATUS(status)
  return fields


# ---------------------------------------------------------------------------------------------
# A command: its output until it exits.


def watch_command(job, pid, pidfd, out_r, started, config, uid):
  """Reads a command's output until it exits (and 0.5 s more for what it left running), its
  deadline passes or its processes hold too much memory; kills and reaps; returns the reply."""
  watch = _CommandWatch(job, config, pid, pidfd, out_r, started)
  watch.run()
  seconds = time.monotonic() - started
  status, rusage, clean = finish(pid, watch.status, uid)
  killed = watch.timed_out or watch.over_memory
  return {
    'op': 'command',
    'output': watch.output.text(),
    'timed_out': watch.timed_out,
    'seconds': seconds,
    'clean': clean,
    **status_fields(status, watch.rusage or rusage, killed),
  }


class _CommandWatch:
  """The state of one command's supervision loop."""

  def __init__(self, job, config, pid, pidfd, out_r, started):
    self.pid, self.pidfd, self.out_r = pid, pidfd, out_r
    self.output = CappedOutput(int(config['output_bytes']))
    self.memory = _MemoryWatch(config['memory_mib'], started)
    self.deadline = started + float(job['timeout_s'])
    self.poller = _poller(out_r, pidfd)
    self.status = self.rusage = None
    self.out_open = True
    self.timed_out = self.over_memory = False

  def run(self):
    """Watches until the command has exited and closed its output, or a limit is reached."""
    while True:
      self._reap_if_exited()
      if self.status is not None and not self.out_open:
        return
      now = time.monotonic()
      if now >= self.deadline:
        self.timed_out = self.status is None
        return
      if self.memory.over(now):
        self.over_memory = True
        note = f'\n[sandbox: killed: its processes held over {self.memory.limit >> 20} MiB]\n'
        self.output.add(note.encode())
        return
      wait_s = 0.05 if self.status is not None else MEMORY_SAMPLE_S
      events = self.poller.poll(max(0.0, min(self.deadline - now, wait_s)) * 1000)
      for fd, _ in events:
        if fd == self.out_r and self.out_open:
          self.out_open = _read_output(fd, self.output, self.poller)
        elif fd == self.pidfd:
          self.poller.unregister(fd)
      if self.status is not None and not events:
        return  # exited; a leftover holds the output open: stop reading

  def _reap_if_exited(self):
    """Reaps the command if it has exited; what it left behind then gets 0.5 s more."""
    if self.status is None:
      done, status, rusage = os.wait4(self.pid, os.WNOHANG)
      if done:
        self.status, self.rusage = status, rusage
        self.deadline = min(self.deadline, time.monotonic() + 0.5)


# ---------------------------------------------------------------------------------------------
# A program: its result frames, one per test call.


def watch_program(job, pid, pidfd, out_r, res_r, started, config, uid):
  """Reads the program's frames: setup, load, then one per call (it runs them back to back;
  each call's deadline runs from the arrival of the previous frame). Returns (problem, reply):
  a problem (not None) when the program never reached its setup frame."""
  watch = _ProgramWatch(job, config, out_r, res_r, pidfd, started)
  end, detail = watch.run()
  seconds = time.monotonic() - started
  frames = watch.frames
  if frames.expecting == _wire.INDEX_SETUP:
    return f'{end} before the setup frame {detail}'.strip(), None
  timed_out_index = frames.expecting if end == 'timeout' else None
  status, rusage, clean = finish(pid, None, uid)
  _drain_output(out_r, watch.output)
  killed = end in ('timeout', 'protocol', 'closed', 'memory')
  return None, {
    'op': 'check',
    'load': frames.load,
    'results': frames.results,
    'end': end,
    'detail': detail,
    'timed_out_index': timed_out_index,
    'output': watch.output.text(),
    'seconds': seconds,
    'clean': clean,
    **status_fields(status, rusage, killed),
  }


def _drain_output(out_r, output):
  """Adds the output the program left in the pipe (bounded: a pipe holds at most 64 KiB)."""
  try:
    os.set_blocking(out_r, False)
    while chunk := os.read(out_r, 1 << 16):
      output.add(chunk)
  except (BlockingIOError, OSError):
    pass


class ResultFrames:
  """A program's result frames, parsed as they arrive: setup, load, then one per test call, in
  order; anything else is a breach of the protocol."""

  def __init__(self, calls, cap):
    self.calls = calls  # how many test calls the program answers
    self.cap = cap  # the largest payload accepted
    self.buffer = bytearray()
    self.expecting = _wire.INDEX_SETUP  # the index of the frame we wait for
    self.load = None  # {'ok': bool, 'error': payload text | None}
    self.results = []  # [index, kind, payload text]
    self.test_started = None  # when the previous frame came: the call `expecting` started

  def parse(self):
    """Takes every complete frame off the buffer; returns (end, detail): end is 'done' after the
    last answer or a failed load, 'protocol' for a bad frame, None while more are due."""
    header = _wire.RESULT_HEADER
    while len(self.buffer) >= header.size:
      size, index, kind = header.unpack_from(self.buffer)
      if kind not in _wire.KINDS or index != self.expecting:
        return 'protocol', f'a malformed result frame (index {index}, kind {kind})'
      if size > self.cap:
        return 'protocol', f'a result of {size} bytes (at most {self.cap} are accepted)'
      if len(self.buffer) < header.size + size:
        break
      payload = bytes(self.buffer[header.size : header.size + size])
      del self.buffer[: header.size + size]
      try:
        text = payload.decode('utf-8')
      except UnicodeDecodeError:
        return 'protocol', 'a result that is not UTF-8'
      end = self._accept(kind, size, text)
      if end is not None:
        return end
    return None, ''

  def _accept(self, kind, size, text):
    """Takes one frame for the index expected; (end, detail) if it ends the program, else None."""
    if self.expecting == _wire.INDEX_SETUP:
      if kind != _wire.KIND_SETUP or size:
        return 'protocol', 'no setup frame'
    elif self.expecting == _wire.INDEX_LOAD:
      if kind == _wire.KIND_LOAD_ERROR:
        self.load = {'ok': False, 'error': text}
        return 'done', ''
      if kind != _wire.KIND_LOADED:
        return 'protocol', f'result kind {kind} before the module loaded'
      self.load = {'ok': True, 'error': None}
    elif kind in _wire.TEST_KINDS:
      self.results.append([self.expecting, kind, text])
    else:
      return 'protocol', f'result kind {kind} for a test'
    self.expecting += 1
    if self.expecting >= self.calls:
      return 'done', ''
    self.test_started = time.monotonic()
    return None


class _ProgramWatch:
  """The state of one program's supervision loop: its deadlines, memory, output and frames."""

  def __init__(self, job, config, out_r, res_r, pidfd, started):
    self.out_r, self.res_r, self.pidfd = out_r, res_r, pidfd
    self.output = CappedOutput(int(config['output_bytes']))
    self.frames = ResultFrames(len(job['calls']), int(config['result_bytes']))
    self.memory = _MemoryWatch(config['memory_mib'], started)
    self.program_deadline = started + float(job['program_timeout_s'])
    self.test_timeout = float(job['test_timeout_s'])
    self.poller = _poller(out_r, res_r, pidfd)

  def run(self):
    """Watches until the program ends; returns (end, detail), end one of done, timeout, exited,
    protocol, closed, memory."""
    while True:
      now = time.monotonic()
      deadline = self._deadline()
      if now >= deadline:
        return 'timeout', ''
      if self.memory.over(now):
        return 'memory', f'its processes together held over {self.memory.limit >> 20} MiB'
      events = self.poller.poll(max(0.0, min(deadline, self.memory.next_sample) - now) * 1000)
      exited, leader_exited = self._read(events)
      end, detail = self.frames.parse()
      if end is None and exited:
        end, detail = self._exit_reason(leader_exited)
      if end is not None:
        return end, detail

  def _deadline(self):
    """The program's deadline, or the running test call's when that comes first."""
    if self.frames.expecting < 0:
      return self.program_deadline
    return min(self.program_deadline, self.frames.test_started + self.test_timeout)

  def _read(self, events):
    """Reads what `events` announce; returns (exited, leader_exited): nothing more will come."""
    exited = leader_exited = False
    for fd, _ in events:
      if fd == self.out_r:
        _read_output(fd, self.output, self.poller)
      elif fd == self.pidfd:
        exited = leader_exited = True
      elif fd == self.res_r:
        chunk = os.read(fd, 1 << 16)
        if chunk:
          self.frames.buffer += chunk
        else:
          exited = True
    if exited:  # nothing more will come: take what is still in the pipe
      try:
        os.set_blocking(self.res_r, False)
        while chunk := os.read(self.res_r, 1 << 16):
          self.frames.buffer += chunk
      except OSError:
        pass
    return exited, leader_exited

  def _exit_reason(self, leader_exited):
    """(end, detail) of a program whose result channel is done without its last frame."""
    detail = 'a truncated result frame' if self.frames.buffer else ''
    if (
      not leader_exited
      and self.pidfd is not None
      and not select.select([self.pidfd], [], [], 0.2)[0]
    ):
      return 'closed', 'it closed its result channel'  # alive, without its result channel
    return 'exited', detail
