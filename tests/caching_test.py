"""The bounded LRU table that owns compiled programs."""

import threading

import pytest

from earl_jax.caching import LRUCache


def test_keeps_the_most_recent_entries():
  cache = LRUCache(max_entries=2)
  cache.put('a', 1)
  cache.put('b', 2)
  assert cache.get('a') == 1  # 'a' is now the most recent
  cache.put('c', 3)
  assert 'b' not in cache and cache.get('a') == 1 and cache.get('c') == 3
  assert len(cache) == 2 and cache.evictions == 1
  assert cache.get('missing') is None
  with pytest.raises(ValueError, match='max_entries must be an int >= 1, got 0'):
    LRUCache(0)


def test_is_safe_across_threads():
  cache = LRUCache(max_entries=8)

  def work(t):
    for i in range(500):
      cache.put((t, i % 16), i)
      cache.get((t, (i + 1) % 16))

  threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(cache) == 8
