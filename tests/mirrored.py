"""One tf.distribute.MirroredStrategy per test process, over the local CPUs.

Every MirroredStrategy numbers its collectives from the same start: a second
one in a process met the first one's collective instances with other shapes
("Shape mismatch in the collective instance 100"), and TensorFlow then
aborted every later collective of the process, DTensor's included.
"""

import functools

import tensorflow as tf

import tfspmd


@functools.cache
def strategy():
  """The process's MirroredStrategy over every local device."""
  return tf.distribute.MirroredStrategy(
      [f"/cpu:{k}" for k in range(len(tfspmd.devices()))])
