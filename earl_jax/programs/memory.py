"""Per-device memory of a compiled program: XLA's own numbers, measured runs, and the budget.

One unit, bytes per device:

* `xla_memory(compiled)`: `compiled.memory_analysis()` of an AOT-compiled SPMD program, i.e. what
  one device holds: arguments + outputs - aliased (donated) + temporaries. This is the source of
  truth for anything that can be compiled here; a program over budget is refused before it runs.
* `measure_run_peak(fn, args)`: what a run really held, from the process's resident memory (CPU
  devices), to check the above against running.
* the budget: on a GPU the device's own limit (`memory_stats()['bytes_limit']`); on CPU, where
  nothing runs out of memory, an emulated figure that must be given (a flag), so that "does not
  fit" is real and testable here.

The analytic model for shapes too large to compile here is `earl_jax.profiling.analytic`;
`compiled_peak` extrapolates XLA's peak of a model too large to compile whole from two smaller
layer counts.
"""

import contextlib
import ctypes
import dataclasses
import functools
from typing import Any

import jax

# The budget itself (what a device may hold, whether a need fits) sits below the selector and
# these programs, in `earl_jax.memory_budget`; its names are re-exported here.
from earl_jax.memory_budget import (  # noqa: F401
  GiB,
  InfeasibleError,
  MiB,
  _local_stats,
  device_budget,
  fits,
  free_memory,
  resolve_budget,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryUse:
  """Bytes per device of one compiled program (from `compiled.memory_analysis()`)."""

  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int = 0

  @property
  def peak(self) -> int:
    """arguments + outputs - aliased + temporaries: everything live at once, at worst."""
    return self.arguments + self.outputs - self.aliased + self.temporaries

  def as_dict(self) -> dict[str, int]:
    return {**dataclasses.asdict(self), 'peak': self.peak}


def xla_memory(compiled: Any) -> MemoryUse:
  """Per-device memory of an AOT-compiled program (`jit(...).lower(...).compile()`)."""
  m = compiled.memory_analysis()
  if m is None:
    raise RuntimeError('This backend gives no memory_analysis() for compiled programs.')
  return MemoryUse(
    arguments=int(m.argument_size_in_bytes),
    outputs=int(m.output_size_in_bytes),
    aliased=int(m.alias_size_in_bytes),
    temporaries=int(m.temp_size_in_bytes),
    code=int(getattr(m, 'generated_code_size_in_bytes', 0) or 0),
  )


def compiled_peak(exes, layers: int):
  """(stage, layout, context) -> XLA's per-device peak in bytes of the program there, compiled
  only: with `exes` one `Executables` of the whole model, its own; with two, of k - 1 and k
  layers, extrapolated linearly from k to `layers` (experiments/context_fit.py `--xla_layers`)."""

  def peak(exe, stage, p, context) -> int:
    return exe.get(exe.key(stage, p, context, p.batch_shards)).memory.peak

  if len(exes) == 1:
    return lambda stage, p, context: peak(exes[0], stage, p, context)
  fewer, more = exes
  k = more.model.num_layers

  def extrapolated(stage, p, context) -> int:
    below, at = peak(fewer, stage, p, context), peak(more, stage, p, context)
    return at + (layers - k) * (at - below)

  return extrapolated


def resident_bytes_per_device(tree: Any, device: Any | None = None) -> int:
  """Bytes of the arrays of `tree` that live on `device` (default: the first canonical one)."""
  leaves = jax.tree.leaves(tree)
  if device is None:
    device = min((d for x in leaves for d in x.sharding.device_set), key=lambda d: d.id)
  total = 0
  for x in leaves:
    for shard in x.addressable_shards:
      if shard.device == device:
        total += shard.data.nbytes
  return total


def _proc_status_bytes(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f'/proc/self/status has no {field}.')


def host_rss_bytes() -> int | None:
  """This process's resident memory (Linux /proc), None elsewhere."""
  try:
    return _proc_status_bytes('VmRSS')
  except (OSError, RuntimeError):
    return None


@functools.cache
def _malloc_trim() -> Any:
  try:
    return ctypes.CDLL('libc.so.6').malloc_trim
  except (OSError, AttributeError):
    return None


def release_host_memory() -> None:
  """Hands the heap that freed programs and buffers left behind back to the OS (glibc's
  `malloc_trim`; a no-op elsewhere). XLA's CPU compiles free most of what they allocate, but
  glibc keeps it in its arenas: without this, resident memory grows with every compile even
  when the executable cache is bounded (docs/results/from-docstrings.md, "Host memory handed
  back after compiles")."""
  trim = _malloc_trim()
  if trim is not None:
    trim(0)


def measure_run_peak(fn: Any, args: tuple[Any, ...]) -> tuple[int, Any]:
  """Runs `fn(*args)` once and measures its real per-device peak on host-platform devices.

  On CPU the fake devices share this process's memory, so the program's extra memory is the
  rise of the process's resident set: freed heap is returned to the OS first (glibc
  `malloc_trim`), the peak-RSS mark is reset (`/proc/self/clear_refs`), and the rise of the
  mark during the run, split over the devices, is added to the bytes the arguments already hold
  on one device. Linux only; call it with nothing else running in the process.

  Returns:
    (per-device peak bytes, the outputs).
  """
  import ctypes

  leaves = jax.tree.leaves(args)
  devices = {d for x in leaves for d in x.sharding.device_set}
  if any(d.platform != 'cpu' for d in devices):
    raise RuntimeError('measure_run_peak measures host memory: CPU devices only.')
  jax.block_until_ready(args)
  resident = resident_bytes_per_device(args)
  with contextlib.suppress(OSError):
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  base = _proc_status_bytes('VmRSS')
  with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # resets VmHWM to the current RSS
  out = jax.block_until_ready(fn(*args))
  rise = max(0, _proc_status_bytes('VmHWM') - base)
  return resident + rise // len(devices), out
