"""The host executor: a mesh of logical CPU devices runs as one XLA program.

Logical CPU devices are one process's split of the same cores and memory.
DTensor runs a program on them as one program per device, whose collectives
meet in a ring of per-device executors (TF 2.21's only CPU all-reduce):
eight executors taking turns on two cores. The vectorized program tfspmd
traces already holds the whole computation, every collective a reduction or
a reshuffle over the stacked axis of the devices. The host executor runs
that program once, on the host, compiled by XLA as a whole: its collectives
are memory moves inside one program, and XLA's kernels use every core.

An array lives as one tensor of its whole shape in host memory (the
buffer `ShardedArray` holds); its blocks are placed on the mesh's devices
only when asked for (`dtensor_value`, `addressable_shards`).

A program XLA cannot compile (an op with no XLA kernel, such as
`tf.py_function`, or a shape XLA needs as a constant) runs its graph op by
op through TensorFlow's kernels instead, and the compile log says so.
"""

import logging
import re
import time

import numpy as np
import tensorflow as tf

from tfspmd._src.core import tf_internal

logger = logging.getLogger("tfspmd")


class HostExecutable:
  """A traced program, run on the host device as one XLA computation.

  Args:
    concrete: The program's `tf.function(jit_compile=True)` concrete
      function, traced on `device` with the whole arrays' shapes.
    device: TensorFlow's name of the host device it runs on.
    name: The program as messages name it ('pmap of step').
    xla: False to run the program op by op from the start (a pmap's
      `jit_compile=False`).

  Attributes:
    compiled_by_xla: None before the first run, then whether XLA compiled
      the program (False: it runs op by op, `tf_internal.without_xla`).
  """

  def __init__(self, concrete, device, name, xla=True):
    self._concrete = concrete
    self._device = device
    self._name = name
    if xla:
      self._call = tf_internal.plain_caller(concrete)
      self.compiled_by_xla = None
    else:
      self._call = tf_internal.plain_caller(
          tf_internal.without_xla(concrete))
      self.compiled_by_xla = False

  @property
  def device(self):
    """TensorFlow's name of the device the program runs on."""
    return self._device

  def run(self, tensors):
    """The program's outputs on `tensors`, the inputs' whole arrays.

    Raises:
      tf.errors.OpError: If the program failed while it ran.
    """
    with tf.device(self._device):
      if self.compiled_by_xla is None:
        return self._first_run(tensors)
      return self._call(tensors)

  def _first_run(self, tensors):
    """Runs with XLA, or op by op where XLA refuses the program."""
    try:
      outputs = self._call(tensors)
    except (tf.errors.InvalidArgumentError,
            tf.errors.UnimplementedError) as error:
      if not tf_internal.xla_refused(error):
        raise
      start = time.perf_counter()
      self._call = tf_internal.plain_caller(
          tf_internal.without_xla(self._concrete))
      self.compiled_by_xla = False
      outputs = self._call(tensors)
      logger.warning(
          "tfspmd: XLA cannot compile %s: %s; it runs through TensorFlow's "
          "kernels op by op instead (%.3f s).", self._name,
          _refusal(error), time.perf_counter() - start)
      return outputs
    self.compiled_by_xla = True
    return outputs


def put(array, device):
  """The host array `array` (NumPy or a tensor) as a tensor on `device`."""
  if isinstance(array, tf.Tensor) and array.device == device:
    return array
  with tf.device(device):
    return tf.identity(array) if isinstance(array, tf.Tensor) else (
        tf.convert_to_tensor(array))


def get(tensor):
  """The tensor's values as a read-only NumPy array sharing its buffer.

  The read waits until the tensor is computed.
  """
  array = np.asarray(tf_internal.host_view(tensor))
  if array.flags.writeable:
    array.flags.writeable = False
  return array


_NO_KERNEL = re.compile(r"No registered '(\w+)' OpKernel for XLA")
_NOT_CONSTANT = re.compile(r"with op (\w+) must be a compile-time constant")


def _refusal(error):
  """Why XLA refused the program, in words naming the op."""
  message = str(error)
  found = _NO_KERNEL.search(message)
  if found:
    return f"it has no kernel for the op {found.group(1)}"
  found = _NOT_CONSTANT.search(message)
  if found:
    return (f"the op {found.group(1)} takes a size computed while the "
            f"program runs, which XLA needs when it compiles")
  return "XLA refused the program"
