"""The per-device memory budget: what a device may hold, and whether a need fits in it.

Below both the selector (which ranks layouts against the budget) and the stage programs (which
refuse a compiled program over it); `earl_jax.programs.memory` re-exports every name here.

  budget = resolve_budget(emulated=128 * MiB)     # the device's limit, or the emulated figure
  fits(need_bytes, budget, margin=0.05)           # need x (1 + margin) <= budget
"""

from typing import Any

import jax

from earl_jax import distributed
from earl_jax.errors import UserError

MiB = 1 << 20
GiB = 1 << 30


class InfeasibleError(UserError):
  """No candidate layout fits the per-device memory budget."""


def device_budget(devices: list[Any] | None = None, *, emulated: int | None = None) -> int:
  """Per-device memory budget in bytes, the same on every process.

  Args:
    devices: the stage's devices (default: all).
    emulated: the figure to use when the devices report no limit (CPU): required there.

  Returns:
    The smallest `bytes_limit` over the devices (GPU/TPU), or `emulated`. When both exist the
    smaller one wins, so an emulated budget can also shrink a real device. Each process reads
    its own devices (only they report memory) and the processes agree on the minimum.

  Raises:
    ValueError: CPU devices and no emulated budget.
  """
  devices = list(jax.devices() if devices is None else devices)
  limits = [s['bytes_limit'] for s in _local_stats(devices) if s and s.get('bytes_limit')]
  limit = distributed.process_min(min(limits) if limits else None)
  if limit is not None:
    return min([int(limit), *([emulated] if emulated else [])])
  if emulated is None or emulated <= 0:
    raise ValueError(
      f'Devices of platform {devices[0].platform!r} report no memory limit; give an emulated '
      f'per-device budget in bytes (got {emulated!r}).'
    )
  return int(emulated)


def _local_stats(devices: list[Any]) -> list[dict | None]:
  """`memory_stats()` of the devices this process addresses (None where a device has none)."""
  mine = [d for d in devices if d.process_index == jax.process_index()]
  return [d.memory_stats() if hasattr(d, 'memory_stats') else None for d in mine]


def free_memory(devices: list[Any] | None = None) -> int | None:
  """The least free bytes on any device (limit - in use), agreed by every process; None when
  the devices report no memory (CPU)."""
  devices = list(jax.devices() if devices is None else devices)
  free = [
    int(s['bytes_limit']) - int(s.get('bytes_in_use', 0))
    for s in _local_stats(devices)
    if s and s.get('bytes_limit')
  ]
  return distributed.process_min(min(free) if free else None)


def resolve_budget(emulated: int | None = None, devices: list[Any] | None = None) -> int | None:
  """The per-device budget a selector uses: `device_budget`, or None (unlimited) on CPU with none.

  On a GPU the device's own limit (or `emulated` when smaller); on CPU the emulated figure when
  given, otherwise None, and nothing is ever refused for memory.
  """
  try:
    return device_budget(devices, emulated=emulated)
  except ValueError:
    return None


def fits(need: int, budget: int, *, margin: float = 0.0) -> bool:
  """need x (1 + margin) <= budget."""
  return need * (1.0 + margin) <= budget
