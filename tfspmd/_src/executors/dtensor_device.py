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

The new device does not undo everything (TF 2.21): the eager executor's
wait raises the failure again at every later wait (`wait_for_programs`
leaves it to the values waited on), and a later program DTensor runs as one
function per device is cancelled with it, so on CPUs programs traced after
a failure run under DTensor's multi-device expansion
(`dtensor_settings.for_program`).

DTensor's device is not safe to enter from two threads at once (TF 2.21).
Every call tfspmd makes into it, in whichever thread, holds `entry`, the
lock under which tfspmd also changes the C environment DTensor reads
(`dtensor_settings.lock`).

The wait for the programs in flight waits on every thread's eager executor
(TF 2.21): one that another thread frees meanwhile is used after it is freed
(the process aborts with "Mutex corrupt", segfaults or hangs). A `for` loop
over a `tf.data.Dataset` makes and frees one per element, so tfspmd's own
threads read datasets with `tfspmd.adapters.tf_data.dataset_elements`,
which makes none, and a read of a value split over the devices does not
use that wait (`components`).
"""

import contextlib
import threading

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import tf_internal
from tfspmd._src.executors import dtensor_settings

_lock = threading.Lock()
# Held by every call into DTensor's device; the C environment's lock too.
entry = dtensor_settings.lock
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


def wait_for_programs():
  """Waits for the programs called so far; other Python threads run meanwhile.

  Once a failure replaced the device, the eager executor's wait raises that
  failure again at every later wait (the replaced device's executors keep
  it, TF 2.21), whatever ran since. From then on an error of this wait is
  not taken as the caller's: it is returned (None if the wait was clean),
  and the caller's own values tell (`components`).
  """
  try:
    # DTensor's device makes a new cancellation manager when it waits
    # (AsyncWait), which a program another thread starts meanwhile may be
    # using: the wait enters the device as any call.
    with entry:
      tf_internal.wait_for_pending_ops()
  except tf.errors.OpError as e:
    if not _generation:
      raise
    return e
  return None


def components(values):
  """The per-device tensors of each DTensor of `values`, once computed.

  DTensor's unpack waits for a value still being computed holding the GIL
  (TF 2.21): every other Python thread would stop for as long. So each
  value is awaited first in a way that releases it:

  - A value split over the devices (a small result is held split too,
    `small_values`) is asked for whole on the host, which DTensor refuses
    once its blocks are computed (`_read_once_computed`). That wait
    reads only the value: it waits for the program that makes it and what
    runs before that program on its devices, not for programs started
    later or in other threads, and it leaves DTensor's device free for the
    other threads' calls meanwhile.
  - Where a value is whole on every device, the eager executor's wait goes
    first (`wait_for_programs`): it waits for every program in flight, in
    every thread, holding `entry`. It does not cover the programs DTensor
    runs under its multi-device expansion (`dtensor_settings`), whose
    values are then read on the host as above; DTensor gives a replicated
    one as its first device's block, shared, not copied.

  A program that failed on some devices is cancelled on the others: a
  value's unpack may report the cancellation where the executor's wait
  reports the failure itself, which is then the error raised.
  """
  with entry:
    all_split = bool(values) and all(
        not dtensor.fetch_layout(value).is_fully_replicated()
        for value in values)
  # DTensor reads a replicated value only after waiting for every program,
  # which must not overlap another thread's call: that read holds `entry`.
  waited = None if all_split else wait_for_programs()
  try:
    with contextlib.nullcontext() if all_split else entry:
      for value in values:
        _read_once_computed(value)
    with entry:
      return [dtensor.unpack(value) for value in values]
  except tf.errors.OpError as error:
    if all_split:
      waited = wait_for_programs()
    if isinstance(error, tf.errors.CancelledError) and waited is not None:
      raise waited from None
    raise


def _read_once_computed(value):
  """Waits, without the GIL, until the DTensor `value` is computed.

  Reads it on the host, which waits with the GIL released, as every read
  of a tensor does. DTensor refuses to read a value split over its devices,
  and its error shows the value's blocks (TF 2.21), so the refusal comes
  once they are computed; that read touches nothing of DTensor's device but
  the value. A replicated value is read as its first device's block, shared,
  once DTensor has waited for every program (so under `entry`). An error of
  the value (a failed program) is left to unpack to raise.
  """
  try:
    tf_internal.host_view(value)
  except tf.errors.OpError:
    pass


def current(value):
  """The DTensor `value` on the current device: moved if it was replaced.

  Each device keeps its block, so moving copies no data between devices.
  """
  old = _replaced.get(value.device) if _replaced else None
  if old is None:
    return value
  with entry:
    return dtensor.pack(old.unpack(value), old.fetch_layout(value))
