"""A small thread-safe least-recently-used table for compiled programs an object owns.

Objects that compile programs per layout, shape or plan (the resharder's moves, the
dispatcher's kernels) keep them in one of these, so that what they hold is bounded and lives
exactly as long as they do; nothing is cached at module level.

  cache = LRUCache(max_entries=64)
  fn = cache.get(key)
  if fn is None:
    fn = cache.put(key, build())
"""

import collections
import threading
from typing import Generic, TypeVar

K = TypeVar('K')
V = TypeVar('V')


class LRUCache(Generic[K, V]):
  """At most `max_entries` values; a `get` or `put` makes its key the most recent."""

  def __init__(self, max_entries: int):
    if not isinstance(max_entries, int) or max_entries < 1:
      raise ValueError(f'LRUCache.max_entries must be an int >= 1, got {max_entries!r}.')
    self.max_entries = max_entries
    self._lock = threading.Lock()
    self._items: collections.OrderedDict[K, V] = collections.OrderedDict()
    self.evictions = 0

  def get(self, key: K) -> V | None:
    with self._lock:
      value = self._items.get(key)
      if value is not None:
        self._items.move_to_end(key)
      return value

  def put(self, key: K, value: V) -> V:
    """Stores `value` (evicting the least recently used beyond the bound); returns it."""
    with self._lock:
      self._items[key] = value
      self._items.move_to_end(key)
      while len(self._items) > self.max_entries:
        self._items.popitem(last=False)
        self.evictions += 1
    return value

  def __contains__(self, key: K) -> bool:
    with self._lock:
      return key in self._items

  def __len__(self) -> int:
    with self._lock:
      return len(self._items)
