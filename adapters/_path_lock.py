"""One save to a checkpoint path at a time, across threads and processes.

Two saves to one path at once each remove what they take for the other's
leftovers: the checkpoint the pointer names could lose its files. A save
holds its path's lock exclusively, a restore shares it, so a restore never
reads files a save is removing.
"""

import contextlib
import fcntl
import os
import threading

import tensorflow as tf

_LOCK_SUFFIX = ".tfspmd.lock"
_guard = threading.Lock()
_remote_locks = {}


@contextlib.contextmanager
def holding(path, *, shared=False):
  """Holds the lock of the checkpoint `path` while the block runs.

  On a local filesystem the lock is `flock` on `<path>.tfspmd.lock`: it
  holds between threads as between processes, and a process that dies
  releases it. A `scheme://` path (an object store) has no such lock: there
  the lock holds between the threads of this process only.

  Args:
    path: The checkpoint's path.
    shared: True for a read, which other reads may share; False for a save.
  """
  if "://" in path:
    with _remote_lock(path):
      yield
    return
  directory = os.path.dirname(path) or "."
  if not shared:
    tf.io.gfile.makedirs(directory)
  try:
    descriptor = os.open(path + _LOCK_SUFFIX,
                         os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT,
                         0o644)
  except FileNotFoundError:
    if not shared:
      raise
    # No save to this path ever took the lock: none to wait for.
    yield
    return
  try:
    fcntl.flock(descriptor, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    yield
  finally:
    os.close(descriptor)


def _remote_lock(path):
  with _guard:
    return _remote_locks.setdefault(path, threading.Lock())
