"""Reductions of host constants, known while the program traces.

A Python number or NumPy value given to a reduction is the same on every
device, so its sum is the axis size times it, and its maximum is itself. As
JAX does, the result is then a host value of the operand's own type, not a
tensor: `psum(1, 'i')` is the Python int axis size, usable in `range(...)`
or as a shape. A constant of a dtype the reduction refuses (bool; complex
for pmax and pmin) goes the tensor route and meets that route's error.
"""

import numpy as np
import tensorflow as tf

_PYTHON_DTYPES = ((bool, tf.bool), (int, tf.int64), (float, tf.float64),
                  (complex, tf.complex128))


def host_dtype(leaf):
  """The dtype of `leaf` if it is a Python number or NumPy value, else None.

  Python ints are not converted, so one too large for int64 still counts.
  """
  for python_type, dtype in _PYTHON_DTYPES:
    if isinstance(leaf, python_type):
      return dtype
  if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype.kind in "biufc":
    try:
      return tf.as_dtype(leaf.dtype)
    except TypeError:
      return None
  return None


def scaled(leaf, size):
  """`size * leaf` in `leaf`'s own type: what JAX's psum gives a constant.

  An int `size` times a Python number has the number's type already; a
  NumPy value keeps its dtype by meeting `size` in that dtype.
  """
  if isinstance(leaf, (np.ndarray, np.generic)):
    return np.asarray(size, leaf.dtype) * leaf
  return size * leaf
