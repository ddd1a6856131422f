"""Whether pmaps run in debug mode here: a flag per Python thread.

The flag is on inside `debug_mode()` and in the thread of every device of a
pmap running in debug mode, so pmaps nested in one run in debug mode too.
Reading it is the only cost debug mode adds to a compiled call.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import threading


class _Flag(threading.local):
  on = False


_flag = _Flag()


def active() -> bool:
  """True where a pmap call, or a collective, runs in debug mode."""
  return _flag.on


@contextlib.contextmanager
def debug_mode() -> Iterator[None]:
  """Runs every pmap called in the body in debug mode, as if `debug=True`.

  Each device's program runs eagerly in its own Python thread; see
  `tfspmd.pmap` for what debug mode does. Use this to debug pmaps defined
  where passing `debug=True` is awkward. It holds for the calling thread only.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = tfspmd.pmap(lambda x: x * 2)
    >>> with tfspmd.debug_mode():
    ...   print(f(tf.range(4)))
    tf.Tensor([0 2 4 6], shape=(4,), dtype=int32)
  """
  saved = _flag.on
  _flag.on = True
  try:
    yield
  finally:
    _flag.on = saved
