"""Holding the C heap's free blocks, so that new objects get new addresses.

DTensor (TF 2.21) remembers the names it gave ops by their addresses, and an
op made where a named one was freed gets the old name (`tf_internal`'s
`flat_caller`). The C allocator hands the most recently freed block of a
size out first: with the free blocks taken while a program is lowered again,
its ops are placed at addresses no earlier op had.

Under glibc, plain DTensor programs with a loop each, kept alive, meet taken
names, and without the blocks held some fail every try of the retry; under
jemalloc and tcmalloc none meet a taken name. `tests/test_dtensor_names.py` checks both and says when this
module can go: when DTensor stops naming ops by the addresses of freed ones.
"""

import contextlib
import ctypes

# Small sizes come back from per-size lists, larger ones from the best
# fitting free block: 16 of each small size, 2 of each larger one up to
# 16 KiB (a loop op with many carried values is a few KiB). About 8.5 MiB.
_BLOCKS = ([(size, 16) for size in range(16, 1024, 16)] +
           [(size, 2) for size in range(1024, 16385, 32)])


def _c_library():
  """The C library's malloc and free, or None where it cannot be loaded."""
  try:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
  except (OSError, AttributeError, TypeError):
    return None
  return libc


_libc = _c_library()


@contextlib.contextmanager
def freed_blocks_held():
  """Holds the heap's free blocks of up to 16 KiB while the block runs.

  Without a C `malloc` to call, nothing is held.

  Example:
    >>> with freed_blocks_held():
    ...   pass
  """
  blocks = []
  try:
    if _libc is not None:
      blocks = [_libc.malloc(size) for size, count in _BLOCKS
                for _ in range(count)]
    yield
  finally:
    for block in blocks:
      _libc.free(block)
