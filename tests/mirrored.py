"""One tf.distribute.MirroredStrategy per test process, over the local CPUs.

Every MirroredStrategy numbers its collectives from the same start: a second
one in a process met the first one's collective instances with other shapes
("Shape mismatch in the collective instance 100"), and TensorFlow then
aborted every later collective of the process, DTensor's included.
"""

import contextlib
import functools

import tensorflow as tf
from tensorflow.python.data.ops import debug_mode

import tfspmd


@functools.cache
def strategy():
  """The process's MirroredStrategy over every local device."""
  return tf.distribute.MirroredStrategy(
      [f"/cpu:{k}" for k in range(len(tfspmd.devices()))])


@contextlib.contextmanager
def inputs_without_autotuning():
  """tf.data's autotuning off for the iterators the strategy makes inside.

  The strategy feeds each of its devices from an iterator of its own, whose
  dataset takes no options. Destroying one waits for its autotuning thread
  (TF 2.21): beside another busy process on 2 cores, a fit of 2 epochs took
  18-274 s instead of 10 s. tf.data's debug mode turns autotuning off for
  every iterator made while it is on; the values are the same.
  """
  before = debug_mode.DEBUG_MODE
  debug_mode.DEBUG_MODE = True
  try:
    yield
  finally:
    debug_mode.DEBUG_MODE = before
