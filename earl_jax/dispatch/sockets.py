"""Raw TCP between the processes of a `jax.distributed` group: the transport's floor.

A dispatch cannot be faster than sending its bytes over plain sockets between the same
processes, so the benchmarks measure that floor beside the strategies:

  ring = SocketRing()                       # every process at once (ports are all-gathered)
  seconds = ring.exchange(nbytes)           # send nbytes to the next process, receive from the previous
  ring.close()

`exchange` sends and receives at once (a thread each way), from and into preallocated buffers,
so it times the kernel's TCP path alone: no serialization, no copies in Python.
"""

import socket
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

_CHUNK = 4 << 20  # bytes per send / recv call


class SocketRing:
  """A TCP connection from every process to the next one (process p sends to p + 1 mod N)."""

  def __init__(self, timeout_s: float = 120.0):
    n, p = jax.process_count(), jax.process_index()
    if n < 2:
      raise ValueError('SocketRing needs at least two processes.')
    self.n, self.p = n, p
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(('127.0.0.1', 0))
    server.listen(1)
    # Every process's port, on every process (a collective: all construct the ring together).
    ports = np.asarray(
      multihost_utils.process_allgather(np.array([server.getsockname()[1]], np.int64))
    ).reshape(-1)
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
    got = 0
    while got < nbytes:
      k = self.recv_sock.recv_into(view_in[got:], min(_CHUNK, nbytes - got))
      if k == 0:
        raise RuntimeError('SocketRing: the previous process closed its connection.')
      got += k
    sender.join()
    return time.perf_counter() - t0

  def close(self) -> None:
    for s in (self.send_sock, self.recv_sock):
      s.close()
