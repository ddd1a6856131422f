"""A bounded, thread-safe least-recently-used cache for traced programs.

A pmapped function traces one program per call signature (shapes, dtypes,
tree structure, static values). A training loop calls it with one signature,
but a program that feeds it ever-new shapes would keep every trace alive and
grow memory without bound; this cache keeps the `maxsize` most recently used
entries and drops the least recently used one when a new one comes in.
"""

import collections
import threading
import weakref

# How many traced programs (call signatures) each pmapped or vmapped function
# keeps. A steady training loop uses one; past this many, the least recently
# used program is dropped (and traced again if its signature comes back).
TRACE_CACHE_SIZE = 64

# Every cache alive, for `clear_caches`; held weakly, so that a dropped
# function's caches go with it.
_ALL = weakref.WeakSet()
_ALL_LOCK = threading.Lock()


def clear_caches() -> None:
  """Drops every traced and compiled program, as `jax.clear_caches`.

  Each pmapped, shard_mapped, vmapped and jitted function traces its
  programs anew at its next call; the pmaps and shard_maps shared between
  calls (`pmap(f)(x)` written in a loop) are made anew. Arrays the
  functions captured are freed once nothing else holds them; XLA keeps
  the programs it compiled for the host executor (with the constants
  inside them) for the rest of the process.

  Example:
    >>> import numpy as np, tfspmd
    >>> double = tfspmd.jit(lambda v: v * 2)
    >>> print(double(np.arange(3.)))
    [0. 2. 4.]
    >>> tfspmd.clear_caches()
    >>> print(double(np.arange(3.)))  # traced again
    [0. 2. 4.]
  """
  with _ALL_LOCK:
    caches = list(_ALL)
  for cache in caches:
    cache.clear()


class LRUCache:
  """A mapping of at most `maxsize` entries that evicts the least recently used.

  `get` of a present key marks it as the most recently used. Safe to use from
  several threads: each operation holds the cache's lock.

  Args:
    maxsize: The most entries kept, a positive int.

  Example:
    >>> from tfspmd._src.core import lru
    >>> cache = lru.LRUCache(2)
    >>> cache.put("a", 1); cache.put("b", 2)
    >>> cache.get("a")
    1
    >>> cache.put("c", 3)  # evicts "b", the least recently used
    >>> sorted(cache.keys())
    ['a', 'c']
  """

  def __init__(self, maxsize):
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
      raise ValueError(f"LRUCache: `maxsize` must be a positive int, got "
                       f"{maxsize!r}.")
    self.maxsize = maxsize
    self._entries = collections.OrderedDict()
    self._lock = threading.Lock()
    with _ALL_LOCK:
      _ALL.add(self)

  def get(self, key, default=None):
    """The value of `key` (now the most recently used), or `default`."""
    with self._lock:
      try:
        self._entries.move_to_end(key)
      except KeyError:
        return default
      return self._entries[key]

  def put(self, key, value):
    """Stores `value` as the most recently used; evicts beyond `maxsize`."""
    with self._lock:
      self._entries[key] = value
      self._entries.move_to_end(key)
      while len(self._entries) > self.maxsize:
        self._entries.popitem(last=False)

  def get_or_put(self, key, make):
    """The value of `key`, or `make()` stored under it if there is none.

    Example:
      >>> from tfspmd._src.core import lru
      >>> cache = lru.LRUCache(2)
      >>> cache.get_or_put("a", lambda: 1), cache.get_or_put("a", lambda: 2)
      (1, 1)
    """
    found = self.get(key)
    if found is None:
      found = make()
      self.put(key, found)
    return found

  def keys(self):
    """The keys, least recently used first (a snapshot)."""
    with self._lock:
      return list(self._entries)

  def values(self):
    """The values, least recently used first (a snapshot)."""
    with self._lock:
      return list(self._entries.values())

  def clear(self):
    """Drops every entry."""
    with self._lock:
      self._entries.clear()

  def __len__(self):
    return len(self._entries)

  def __contains__(self, key):
    with self._lock:
      return key in self._entries
