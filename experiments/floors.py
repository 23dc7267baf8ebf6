"""The transport floors of experiments/dispatch_latency.py: raw TCP between the processes of a
`jax.distributed` group.

A dispatch cannot be faster than sending its bytes over plain sockets between the same
processes, so the benchmarks measure that floor beside the strategies:

  ring = SocketRing()                       # every process at once (ports are all-gathered)
  seconds = ring.exchange(nbytes)           # send nbytes to the next process, receive from the previous
  ring.close()

`exchange` sends and receives at once (a thread each way), from and into preallocated buffers,
so it times the kernel's TCP path alone: no serialization, no copies in Python. `SocketMesh`
does the same between every pair of processes, for movements whose bytes go to many peers.
"""

import socket
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

_CHUNK = 4 << 20  # bytes per send / recv call


def _listen(name: str, backlog: int) -> tuple[int, int, socket.socket, np.ndarray]:
  """(process count, this process's index, a listening loopback server, every process's port):
  a collective, so every process of the group calls it together."""
  n, p = jax.process_count(), jax.process_index()
  if n < 2:
    raise ValueError(f'{name} needs at least two processes.')
  server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  server.bind(('127.0.0.1', 0))
  server.listen(backlog)
  ports = np.asarray(
    multihost_utils.process_allgather(np.array([server.getsockname()[1]], np.int64))
  ).reshape(-1)
  return n, p, server, ports


def _recv_into(sock: socket.socket, view: memoryview, what: str) -> None:
  got, nbytes = 0, len(view)
  while got < nbytes:
    k = sock.recv_into(view[got:], min(_CHUNK, nbytes - got))
    if k == 0:
      raise RuntimeError(f'{what}: the peer closed its connection.')
    got += k


class SocketRing:
  """A TCP connection from every process to the next one (process p sends to p + 1 mod N)."""

  def __init__(self, timeout_s: float = 120.0):
    n, p, server, ports = _listen('SocketRing', 1)
    self.n, self.p = n, p
    port = int(ports[(p + 1) % n])
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(server.accept()[0]))
    acceptor.start()
    self.send_sock = socket.create_connection(('127.0.0.1', port), timeout=timeout_s)
    acceptor.join(timeout_s)
    server.close()
    if not accepted:
      raise RuntimeError(f'process {p}: no connection from process {(p - 1) % n}.')
    self.recv_sock = accepted[0]
    for s in (self.send_sock, self.recv_sock):
      s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    self._buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}

  def exchange(self, nbytes: int) -> float:
    """Sends `nbytes` to the next process while receiving as many from the previous one;
    returns this process's seconds."""
    if nbytes not in self._buffers:
      self._buffers = {nbytes: (np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8))}
    out, into = self._buffers[nbytes]
    view_out, view_in = memoryview(out), memoryview(into)

    def send():
      for i in range(0, nbytes, _CHUNK):
        self.send_sock.sendall(view_out[i : i + _CHUNK])

    t0 = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    _recv_into(self.recv_sock, view_in, 'SocketRing')
    sender.join()
    return time.perf_counter() - t0

  def close(self) -> None:
    for s in (self.send_sock, self.recv_sock):
      s.close()


class SocketMesh:
  """A TCP connection from every process to every other one: the floor of a movement whose
  bytes go between many pairs (a random permutation, a change of sequence split), where a ring
  to the next process carries the same bytes over a cheaper pattern.

    mesh = SocketMesh()                     # every process at once
    seconds = mesh.exchange(matrix)         # [N, N] bytes process i sends to process j
    mesh.close()

  `exchange` sends this process's row of the matrix and receives its column at once, a thread
  per peer and direction, from and into preallocated buffers. Each process sends the byte value
  `process_index + 1`, so a receiver can check where its bytes came from (`received`).
  """

  def __init__(self, timeout_s: float = 120.0):
    n, p, server, ports = _listen('SocketMesh', jax.process_count())
    self.n, self.p = n, p
    accepted: dict[int, socket.socket] = {}

    def accept_all():
      for _ in range(n - 1):
        conn, _ = server.accept()
        peer = np.empty(1, np.int32)
        _recv_into(conn, memoryview(peer).cast('B'), f'process {p}')
        accepted[int(peer[0])] = conn

    acceptor = threading.Thread(target=accept_all)
    acceptor.start()
    self.send_socks: dict[int, socket.socket] = {}
    for q in range(n):
      if q != p:
        s = socket.create_connection(('127.0.0.1', int(ports[q])), timeout=timeout_s)
        s.sendall(np.array([p], np.int32).tobytes())  # who is calling
        self.send_socks[q] = s
    acceptor.join(timeout_s)
    server.close()
    if len(accepted) != n - 1:
      missing = sorted(set(range(n)) - {p} - set(accepted))
      raise RuntimeError(f'process {p}: no connection from processes {missing}.')
    self.recv_socks = accepted
    for s in (*self.send_socks.values(), *self.recv_socks.values()):
      s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    self._key: bytes | None = None
    self.received: dict[int, np.ndarray] = {}

  def exchange(self, matrix: np.ndarray) -> float:
    """Sends matrix[p, q] bytes to every other process q while receiving matrix[q, p] from it;
    returns this process's seconds."""
    m = np.asarray(matrix, np.int64)
    if m.shape != (self.n, self.n):
      raise ValueError(f'SocketMesh.exchange: matrix {m.shape}, expected {(self.n, self.n)}.')
    p = self.p
    if self._key != m.tobytes():
      self._key = m.tobytes()
      self._out = np.full(max(int(m[p].max()), 1), p + 1, np.uint8)
      self.received = {q: np.empty(int(m[q, p]), np.uint8) for q in self.recv_socks}
    out = memoryview(self._out)

    errors: list[BaseException] = []

    def send(q):
      try:
        nbytes = int(m[p, q])
        for i in range(0, nbytes, _CHUNK):
          self.send_socks[q].sendall(out[i : min(nbytes, i + _CHUNK)])
      except BaseException as e:  # re-raised below, in the calling thread
        errors.append(e)

    def recv(q):
      try:
        _recv_into(self.recv_socks[q], memoryview(self.received[q]), f'process {p}')
      except BaseException as e:
        errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=send, args=(q,)) for q in self.send_socks if m[p, q]]
    threads += [threading.Thread(target=recv, args=(q,)) for q in self.recv_socks if m[q, p]]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    seconds = time.perf_counter() - t0
    if errors:
      raise errors[0]
    return seconds

  def close(self) -> None:
    for s in (*self.send_socks.values(), *self.recv_socks.values()):
      s.close()
