"""Small replicated arrays, held wide so that DTensor does not fold them.

DTensor (TF 2.21) turns a program's fully replicated input of fewer than 20
elements of int32, int64 or float32 into a constant of the program, and
keys its cache of lowered programs on that value. It stops folding an input
only after a call shows the value changed, so in a training loop each small
state leaf (a step count, a bias, a BatchNorm scale, a loss average) that
changes for the first time costs one more SPMD lowering and XLA compile:
seconds per step, at steps no one can predict.

Such an array crosses a program's boundary *wide*: flattened and padded
with zeros to `WIDTH` elements, which DTensor never folds. A program
narrows each wide input back to its shape as its first op and widens each
small replicated output as its last, so state that goes out of one call
and into the next stays wide with no op in between. Only the program's
signature changes: the per-device function sees the array's own shape.
"""

import math

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.executors import dtensor_device

# DTensor folds replicated inputs of fewer elements (kSmallTensorThreshold).
WIDTH = 20
# The widening and narrowing functions, by (kind, shape, dtype).
_CONVERTERS = {}
_FOLDED_DTYPES = frozenset((tf.float32, tf.int32, tf.int64))


def is_small(shape, dtype):
  """Whether a replicated array of `shape` and `dtype` would be folded.

  An empty array is left as it is: its value cannot change.
  """
  return (0 < math.prod(shape) < WIDTH and
          tf.as_dtype(dtype) in _FOLDED_DTYPES)


def is_small_replicated(spec, shape, dtype):
  """Whether an array laid out as `spec` (a `Placement.spec`) is held wide."""
  return not any(dim is not None for dim in spec) and is_small(shape, dtype)


def widen(value):
  """The tensor `value` flattened and padded to `WIDTH` elements, in a graph."""
  flat = tf.reshape(value, [-1])
  return tf.pad(flat, [[0, WIDTH - value.shape.num_elements()]])


def narrow(wide, shape):
  """The array of `shape` a `widen`ed tensor holds, in a graph."""
  return tf.reshape(wide[:math.prod(shape)], shape)


def widen_host(array):
  """The NumPy `array` as `widen` gives it."""
  flat = np.ravel(array)
  return np.concatenate([flat, np.zeros(WIDTH - flat.size, flat.dtype)])


def narrow_host(wide, shape):
  """The NumPy array of `shape` a wide NumPy array holds."""
  return np.asarray(wide)[:math.prod(shape)].reshape(shape)


def wide_layout(mesh):
  """The layout of a wide array on the DTensor `mesh`: whole on each device."""
  return dtensor.Layout.replicated(mesh, 1)


def widened(value):
  """The replicated DTensor `value` as a wide DTensor, on its devices.

  A function DTensor runs on the devices: no wait for `value`, no trip
  through the host. (DTensor folds `value` into its first lowering and
  lowers it once more the first time another value comes.)
  """
  return _converter("widen", tuple(value.shape), value.dtype)(value)


def narrowed(wide, shape):
  """The wide DTensor `wide` as a replicated DTensor of `shape`."""
  return _converter("narrow", tuple(shape), wide.dtype)(wide)


def _converter(kind, shape, dtype):
  """The `tf.function` widening or narrowing arrays of `shape` and `dtype`."""
  key = (kind, shape, dtype)
  converter = _CONVERTERS.get(key)
  if converter is None:
    # Traced here for its one signature: TensorFlow warns of retracing when
    # calls trace one Python function for many shapes, as these are.
    if kind == "widen":
      converter = tf.function(widen, autograph=False).get_concrete_function(
          tf.TensorSpec(shape, dtype))
    else:
      converter = tf.function(
          lambda t: narrow(t, list(shape)),
          autograph=False).get_concrete_function(tf.TensorSpec((WIDTH,),
                                                               dtype))
    _CONVERTERS[key] = converter
  return converter


def on_mesh(wide, mesh):
  """The wide DTensor `wide` on `mesh`, a mesh of the same devices.

  Each device keeps its copy.
  """
  layout = wide_layout(mesh)
  with dtensor_device.entry:
    if dtensor.fetch_layout(wide) == layout:
      return wide
    return dtensor.pack(dtensor.unpack(wide), layout)
