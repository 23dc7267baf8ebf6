"""Compiled stage programs, one per `ProgramKey`, built ahead of time and cached.

Each executable is `jit(...).lower(abstract args).compile()`: compile time and per-device memory
are known before anything runs, and an executable that does not fit the budget is refused
before it runs. `precompile` builds the next one in a background thread while the current step
runs (the mesh context of `jax.set_mesh` is per thread, so this does not disturb the caller).
Entry points enable the persistent compilation cache (`earl_jax.runtime.setup`), so a later
process gets most compiles from disk.

One `Executables` serves one run: the rollout engine, the trainer and the profiler take their
programs from it, so each stage has one compile path. It owns what its programs need and
nothing outlives it: the layouts' parameter shardings, the abstract train states, and the
device-to-device moves between layouts (a `sharding.reshard.Resharder`).

  exe = Executables(cfg, spec=StageSpec(sampling=SamplingConfig(max_new_tokens=8)))
  key = exe.key(Stage.ROLLOUT, ParallelConfig(dp=2, tp=4), bucket=1024, rows=16)
  rollout = exe.get(key)                                   # compiled once per key
  exe.precompile(exe.key(Stage.ROLLOUT, ParallelConfig(tp=8), 2048, 16))   # a Future
  params, rollout, record = switch(Stage.ROLLOUT, params, exe, ParallelConfig(tp=8), 2048, 16)
  record.stall_ms          # what the step waited: executable (if still compiling) + reshard
"""

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import jax
from absl import logging

from earl_jax.caching import LRUCache
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.programs import builders
from earl_jax.programs import memory as memory_lib
from earl_jax.rl import train_step as train_lib
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding import reshard as reshard_lib
from earl_jax.stage import Stage

# The nice value of background compile threads (Linux: per thread; lowering needs no privilege).
BACKGROUND_NICE = 10


def _lower_priority() -> None:
  """Lowers the calling thread's CPU priority (where the OS allows it per thread)."""
  with contextlib.suppress(AttributeError, OSError):  # elsewhere: the process's priority
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def background_pool(workers: int, name: str) -> futures.ThreadPoolExecutor:
  """Threads for compiles nothing waits on yet (next buckets, profile cells), run at a lower
  CPU priority than the step: on a machine with few cores they take what the step leaves, and
  the step is not slowed by a program it may never run. A compile the step then waits for
  gets the idle cores all the same."""
  return futures.ThreadPoolExecutor(
    max_workers=workers, thread_name_prefix=name, initializer=_lower_priority
  )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Executable:
  """A compiled stage program and what it cost.

  Attributes:
    program: the program (mesh, abstract args, tokens per call).
    compiled: the `jax.stages.Compiled`; call it with concrete args on `program.mesh`.
    memory: XLA's per-device memory of the program.
    lower_ms: tracing and lowering time.
    compile_ms: XLA compile time (a persistent-cache hit makes it small).
    background: built by `precompile` in the background thread.
  """

  program: builders.Program
  compiled: Any
  memory: memory_lib.MemoryUse
  lower_ms: float
  compile_ms: float
  background: bool

  @property
  def key(self) -> builders.ProgramKey:
    return self.program.key

  def __call__(self, *args: Any) -> Any:
    return self.compiled(*args)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchRecord:
  """One layout switch before a stage, as the step saw it.

  Attributes:
    stage, source, target, bucket, rows: what switched (source is None for the first layout).
    step: the trainer's step index, if given.
    reshard_ms: moving the weights (and optimizer state) device to device.
    compile_ms: the executable's lower + compile time, wherever it happened.
    wait_ms: time the step waited for the executable (0 when precompiled and finished).
    stall_ms: wait_ms + reshard_ms: the delay the step actually saw.
    precompiled: the executable was requested by `precompile` before the step needed it.
  """

  stage: Stage
  step: int | None
  source: str | None
  target: str
  bucket: int
  rows: int
  reshard_ms: float
  compile_ms: float
  wait_ms: float
  stall_ms: float
  precompiled: bool

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), 'stage': str(self.stage)}


class Executables:
  """The executable cache of one model and one set of stage settings: compile once per key.

  Thread-safe: `get` from the step thread and `precompile` into one background worker. A key is
  compiled at most once; asking for a key that is being precompiled waits for that compile.
  """

  def __init__(
    self,
    model: ModelConfig,
    *,
    spec: builders.StageSpec | None = None,
    devices: Sequence[jax.Device] | None = None,
    background_workers: int = 1,
    max_moves: int = 64,
    max_programs: int = 32,
  ):
    """Args:
    model: the model config.
    spec: static stage settings (sampling, micro-batches, optimizer, loss).
    devices: the devices every stage runs on (default: all), in canonical order.
    background_workers: threads for `precompile`.
    max_moves: compiled layout-to-layout moves kept by the resharder.
    max_programs: compiled programs kept (least recently used go first; one asked for again is
      compiled again, from the persistent compilation cache). On CPU each holds its machine
      code, so an unbounded table grows with every (stage, layout, bucket, rows) a run visits.
    """
    self.model = model
    self.spec = spec or builders.StageSpec()
    self.devices = mesh_lib.canonical_devices(devices)
    self._meshes: dict[ParallelConfig, jax.sharding.Mesh] = {}
    self.resharder = reshard_lib.Resharder(max_entries=max_moves)
    self._lock = threading.Lock()
    self._entries: LRUCache[builders.ProgramKey, Executable] = LRUCache(max_programs)
    self._pending: dict[builders.ProgramKey, futures.Future] = {}
    # Every key ever asked for. Decisions read this, not what the LRU still holds: eviction
    # order depends on when background compiles finish, which differs between processes, and
    # every process must take the same decisions.
    self._requested: set[builders.ProgramKey] = set()
    self._param_shardings: dict[ParallelConfig, Any] = {}
    self._train_states: dict[ParallelConfig, train_lib.TrainState] = {}
    self._pool = background_pool(background_workers, 'earl-precompile')
    self._background: list[futures.Future] = []  # what `precompile` queued: builds and moves
    # The gate of that queue (`hold`): a queued build or move starts only while it is open.
    self._open = threading.Event()
    self._open.set()
    self._started = 0  # queued builds and moves past the gate, not done yet
    self.log: list[dict[str, Any]] = []
    self.hits = 0
    self.compiles = 0

  # -- keys and layouts ----------------------------------------------------------------------------

  def key(
    self,
    stage: Stage | str,
    config: ParallelConfig,
    bucket: int,
    rows: int,
    *,
    chunk: int | None = None,
    greedy: bool = False,
    objective: str = 'rl',
  ) -> builders.ProgramKey:
    """The key of a program (`builders.ProgramKey`); a rollout program without a chunk gets
    `spec.chunk`."""
    stage = Stage.parse(stage)
    if stage == Stage.ROLLOUT and chunk is None:
      chunk = self.spec.chunk
    return builders.ProgramKey(
      stage=stage,
      config=config,
      bucket=bucket,
      rows=rows,
      chunk=chunk or 0,
      greedy=greedy,
      objective=objective,
    )

  def mesh(self, config: ParallelConfig) -> jax.sharding.Mesh:
    """The mesh of a layout over this cache's devices (one per layout)."""
    with self._lock:
      if config not in self._meshes:
        self._meshes[config] = mesh_lib.make_mesh(config, self.devices)
      return self._meshes[config]

  def param_shardings(self, config: ParallelConfig) -> Any:
    """The parameters' shardings on a layout (built once per layout: it traces the model)."""
    with self._lock:
      found = self._param_shardings.get(config)
    if found is None:
      found = builders.param_shardings(self.model, self.mesh(config))
      with self._lock:
        self._param_shardings[config] = found
    return found

  def abstract_train_state(self, config: ParallelConfig) -> train_lib.TrainState:
    """The train state's ShapeDtypeStructs on a layout (moments sharded like their parameters)."""
    with self._lock:
      found = self._train_states.get(config)
    if found is None:
      found = builders.abstract_train_state(self.model, self.mesh(config), self.spec.optim)
      with self._lock:
        self._train_states[config] = found
    return found

  def __contains__(self, key: builders.ProgramKey) -> bool:
    with self._lock:
      return key in self._entries

  def __len__(self) -> int:
    with self._lock:
      return len(self._entries)

  # -- compile ------------------------------------------------------------------------------------

  def _build(self, key: builders.ProgramKey, background: bool) -> Executable:
    t0 = time.perf_counter()
    program = builders.build(key, self.model, self.spec, self.mesh(key.config))
    lowered = program.lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    del lowered
    memory_lib.release_host_memory()  # what the compile freed goes back to the OS
    t2 = time.perf_counter()
    entry = Executable(
      program=program,
      compiled=compiled,
      memory=memory_lib.xla_memory(compiled),
      lower_ms=1e3 * (t1 - t0),
      compile_ms=1e3 * (t2 - t1),
      background=background,
    )
    record = {
      'key': str(key),
      'lower_ms': entry.lower_ms,
      'compile_ms': entry.compile_ms,
      'peak_mib': entry.memory.peak / memory_lib.MiB,
      'background': background,
      'thread': threading.current_thread().name,
    }
    with self._lock:
      self._entries.put(key, entry)
      self._pending.pop(key, None)
      self.compiles += 1
      self.log.append(record)
    logging.info(
      'compiled %s in %.0f ms (lower %.0f ms)%s, %.1f MiB per device',
      key,
      entry.compile_ms,
      entry.lower_ms,
      ' in the background' if background else '',
      record['peak_mib'],
    )
    return entry

  def get(
    self, key: builders.ProgramKey, *, budget: int | None = None, margin: float = 0.0
  ) -> Executable:
    """The executable of `key` (see `key`): cached, finished by a precompile, or compiled now.

    Args:
      key: the program.
      budget: per-device bytes; when given, an executable whose peak x (1 + margin) exceeds it
        is refused (InfeasibleError) instead of being returned to run.
      margin: safety margin on the peak.

    Raises:
      memory.InfeasibleError: over budget, with the need and the budget in the message.
    """
    with self._lock:
      self._requested.add(key)
      entry = self._entries.get(key)
      pending = self._pending.get(key)
      if entry is not None:
        self.hits += 1
    if entry is None and pending is not None:
      if not self._open.is_set():
        logging.info('executables: %s is needed now: the held precompiles go on', key)
        self._open.set()  # the step needs it: what was held for a measurement waits no more
      t0 = time.perf_counter()
      entry = pending.result()
      self.log.append({'key': str(key), 'waited_ms': 1e3 * (time.perf_counter() - t0)})
    elif entry is None:
      entry = self._build(key, background=False)
    if budget is not None and not memory_lib.fits(entry.memory.peak, budget, margin=margin):
      raise memory_lib.InfeasibleError(
        f'{key} needs {entry.memory.peak / memory_lib.MiB:.1f} MiB per device'
        f'{f" (+{margin:.0%} margin)" if margin else ""}; the budget is '
        f'{budget / memory_lib.MiB:.1f} MiB. Refused before running.'
      )
    return entry

  def generate(
    self, config: ParallelConfig, bucket: int, rows: int, *, chunk: int, greedy: bool = False
  ) -> Executable:
    """The rollout program the engine runs for one turn (`get` of a rollout key)."""
    return self.get(self.key(Stage.ROLLOUT, config, bucket, rows, chunk=chunk, greedy=greedy))

  def precompile(self, key: builders.ProgramKey, *, tree: Any = None) -> futures.Future:
    """Starts compiling `key`'s program in the background (no-op if cached or in flight).

    Args:
      key: the program (see `key`).
      tree: the program's first argument as it is laid out now (the weights, or the train
        state); when given, the device-to-device move onto the new layout is compiled too, so
        that a later `switch` pays only for moving the bytes.
    """
    layout = None if tree is None else mesh_lib.abstract_arrays(tree)
    with self._lock:
      self._requested.add(key)
      entry = self._entries.get(key)
      if entry is None and key not in self._pending:
        self._pending[key] = self._pool.submit(self._when_open, self._build, key, True)
        self._background.append(self._pending[key])
      future = self._pending.get(key)
    if layout is not None:
      # Queued after the build (one worker, first in first out), so the build is done first.
      move = self._pool.submit(self._when_open, self._prepare_move, key, layout)
      with self._lock:
        self._background.append(move)
      return move
    if future is None:
      future = futures.Future()
      future.set_result(entry)
    return future

  def _when_open(self, build, *args):
    """Runs a queued `build(*args)` once the gate is open (`hold`)."""
    self._open.wait()
    with self._lock:
      self._started += 1
    try:
      return build(*args)
    finally:
      with self._lock:
        self._started -= 1

  def hold(self, held: bool) -> None:
    """Holds the precompiles queued (`precompile`) before they start, or lets them go on: while
    held, the one under way finishes and the others wait, so that the host's cores are free at
    the next step boundary (a profile measurement waits for one). A program the step then needs
    (`get`) lets them go on."""
    if held:
      self._open.clear()
    else:
      self._open.set()

  def _prepare_move(self, key: builders.ProgramKey, layout: Any) -> Executable:
    entry = self.get(key)
    self.resharder.prepare(layout, entry.program.tree_shardings)
    return entry

  def requested(self, key: builders.ProgramKey) -> bool:
    """Asked for before (by `get` or `precompile`), whether or not the LRU still holds it: the
    same answer on every process of a run (a program asked for again after its eviction loads
    from the persistent compilation cache)."""
    with self._lock:
      return key in self._requested

  def busy(self) -> bool:
    """Whether a background compile `precompile` queued (a program or a move) is under way, or
    waiting to start while they are not held (`hold`): a timing taken meanwhile shares the
    host's cores with it."""
    with self._lock:
      self._background = [f for f in self._background if not f.done()]
      return self._started > 0 or (self._open.is_set() and bool(self._background))

  def wait(self) -> None:
    """Waits for every background compile, held ones included (re-raising the first error)."""
    self._open.set()
    with self._lock:
      pending = list(self._pending.values())
    for f in pending:
      f.result()

  def close(self) -> None:
    self._open.set()
    self._pool.shutdown(wait=True)

  def __enter__(self) -> 'Executables':
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def switch(
  stage: Stage | str,
  tree: Any,
  executables: Executables,
  config: ParallelConfig,
  bucket: int,
  rows: int,
  *,
  source: ParallelConfig | None = None,
  step: int | None = None,
  budget: int | None = None,
  margin: float = 0.0,
) -> tuple[Any, Executable, SwitchRecord]:
  """Gets the stage's executable for the new layout and moves `tree` onto it.

  `tree` is the program's first argument: the parameters for rollout and experience, the whole
  TrainState (parameters and optimizer moments) for train. It is donated when it has to move.

  Returns:
    (tree on the new layout, the executable, the switch record with reshard/compile/stall ms).

  Raises:
    memory.InfeasibleError: the executable does not fit `budget` (checked before any move).
  """
  stage = Stage.parse(stage)
  key = executables.key(stage, config, bucket, rows)
  precompiled = executables.requested(key)
  t0 = time.perf_counter()
  entry = executables.get(
    executables.key(stage, config, bucket, rows), budget=budget, margin=margin
  )
  wait_ms = 1e3 * (time.perf_counter() - t0)
  tree, reshard_ms = executables.resharder.timed(tree, entry.program.tree_shardings)
  record = SwitchRecord(
    stage=stage,
    step=step,
    source=None if source is None else source.name,
    target=config.name,
    bucket=bucket,
    rows=rows,
    reshard_ms=reshard_ms,
    compile_ms=entry.lower_ms + entry.compile_ms,
    wait_ms=wait_ms,
    stall_ms=wait_ms + reshard_ms,
    precompiled=precompiled,
  )
  _log_switch(record)
  return tree, entry, record


def _log_switch(record: SwitchRecord) -> None:
  logging.info(
    'switch %s %s -> %s (S=%d, R=%d): reshard %.1f ms, compile %.0f ms, stall %.1f ms',
    record.stage,
    record.source,
    record.target,
    record.bucket,
    record.rows,
    record.reshard_ms,
    record.compile_ms,
    record.stall_ms,
  )
