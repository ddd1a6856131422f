"""DTensor's device for tfspmd's programs: replaced after a failure.

When a program fails while it runs (an op's kernel raises on some device:
`tf.debugging.check_numerics` on a NaN, a `tf.gather` index out of range),
DTensor's device (TF 2.21, 8 CPU devices) cancels its cancellation manager
and never makes a new one. Every later program on it is cancelled before it
starts, and under DTensor's multi-device expansion the next one crashes the
process (a double free or a segfault). A new device is the only way back.

DTensor runs programs asynchronously, so a failure would surface only at a
later fetch, after the next call had already crashed: a program that may
fail is waited on at its call (`run_errors.may_fail`), and tfspmd
`replace`s the device there. A `ShardedArray` placed before stays readable,
and moves to the new device the first time it is used (`current`). A traced
program that ran on a replaced device cannot run on the new one (the
functions DTensor made of it keep their names there): `generation` tells the
caches to trace again.

DTensor's device is not safe to enter from two threads at once (TF 2.21): a
program's first call while another thread placed batches on the devices
corrupted a mutex and aborted the process. Every call tfspmd makes into it,
in whichever thread, holds `entry`.
"""

import threading

from tensorflow.experimental import dtensor

from tfspmd._src.core import tf_internal

_lock = threading.Lock()
entry = threading.RLock()
_generation = 0
_replaced = {}  # device name -> replaced DTensorDevice, to read its values.


def generation():
  """How many times the device was replaced; programs of another are stale."""
  return _generation


def replace():
  """Gives DTensor a new device after a program failed on the current one."""
  global _generation
  with _lock:
    old = tf_internal.dtensor_device()
    if old is not None:
      _replaced[old.name] = old
    tf_internal.new_dtensor_device()
    _generation += 1


def current(value):
  """The DTensor `value` on the current device: moved if it was replaced.

  Each device keeps its block, so moving copies no data between devices.
  """
  old = _replaced.get(value.device) if _replaced else None
  if old is None:
    return value
  with entry:
    return dtensor.pack(old.unpack(value), old.fetch_layout(value))
