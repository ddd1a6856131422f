"""axis_index and axis_size: where a device sits along named axes."""

from __future__ import annotations

from collections.abc import Hashable

import tensorflow as tf

from tfspmd._src.runtime import axis_env


def axis_index(axis_name: Hashable) -> tf.Tensor:
  """This device's position along the named axis, as an int32 scalar.

  Args:
    axis_name: A bound axis name, or a tuple of names: then the linear index
      over those axes, the first one major.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = tfspmd.pmap(lambda x: tfspmd.lax.axis_index('i'), axis_name='i')
    >>> print(f(tf.zeros(4)))
    [0 1 2 3]
  """
  frames = axis_env.normalize_axis_names(axis_name, "axis_index")
  index = None
  for frame in frames:
    index = frame.index if index is None else (
        index * frame.size + frame.index)
  return tf.identity(index)


def axis_size(axis_name: Hashable) -> int:
  """The number of devices along the named axis (or the product for a tuple).

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = tfspmd.pmap(lambda x: x * tfspmd.lax.axis_size('i'), axis_name='i')
    >>> print(f(tf.ones(4)))
    [4. 4. 4. 4.]
  """
  frames = axis_env.normalize_axis_names(axis_name, "axis_size")
  size = 1
  for frame in frames:
    size *= frame.size
  return size
