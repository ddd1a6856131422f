"""Values known when tracing that TensorFlow's constant folding misses.

`tf.get_static_value` folds constants and shapes, but not a comparison of
them: the predicate of the `tf.cond` inside `tf.math.is_non_decreasing`
(`tf.size(x) < 2`) is known from the static shape of `x`, and the size
`tf.math.bincount` computes is pinned by its minlength and maxlength. The
routes that need such a value read it here.
"""

import numpy as np
import tensorflow as tf

from tfspmd._src.core import tf_internal

_BINARY = {
    "Less": np.less, "LessEqual": np.less_equal, "Greater": np.greater,
    "GreaterEqual": np.greater_equal, "Equal": np.equal,
    "NotEqual": np.not_equal, "LogicalAnd": np.logical_and,
    "LogicalOr": np.logical_or, "AddV2": np.add, "Sub": np.subtract,
    "Mul": np.multiply, "Maximum": np.maximum, "Minimum": np.minimum,
    "FloorMod": np.mod, "FloorDiv": np.floor_divide,
}


# Ops on small integer tensors (shapes, offsets) that are run eagerly once
# their inputs are known.
_INDEX_OPS = frozenset({
    "ConcatOffset", "ConcatV2", "ExpandDims", "OnesLike", "GatherV2", "Max", "Min", "Neg", "Pack",
    "Prod", "Range", "Reshape", "Slice", "Squeeze", "StridedSlice", "Sum",
})


def value(tensor, depth=8):
  """The NumPy value of `tensor` if it is known when tracing, else None.

  >>> import tensorflow as tf
  >>> graph = tf.Graph()
  >>> with graph.as_default():
  ...   x = tf.compat.v1.placeholder(tf.float32, [6])
  ...   print(value(tf.size(x) < 2))
  False
  """
  known = tf.get_static_value(tensor)
  if known is not None or depth == 0:
    return known
  operation = tensor.op
  kind = operation.type
  if kind in _BINARY:
    a, b = (value(t, depth - 1) for t in operation.inputs)
    if a is None or b is None:
      return None
    return np.asarray(_BINARY[kind](a, b))
  if kind == "LogicalNot":
    inner = value(operation.inputs[0], depth - 1)
    return None if inner is None else np.logical_not(inner)
  if kind in ("All", "Any"):
    inner, axes = (value(t, depth - 1) for t in operation.inputs)
    if inner is None or axes is None:
      return None
    reduce = np.all if kind == "All" else np.any
    return np.asarray(reduce(inner, axis=tuple(np.atleast_1d(axes).tolist()),
                             keepdims=operation.get_attr("keep_dims")))
  if kind in ("Identity", "Cast"):
    inner = value(operation.inputs[0], depth - 1)
    if inner is None:
      return None
    return np.asarray(inner).astype(tensor.dtype.as_numpy_dtype)
  if kind == "Size" and operation.inputs[0].shape.is_fully_defined():
    return np.asarray(operation.inputs[0].shape.num_elements(),
                      tensor.dtype.as_numpy_dtype)
  if kind == "ShapeN":
    shape = operation.inputs[tensor.value_index].shape
    if shape.is_fully_defined():
      return np.asarray(shape.as_list(), tensor.dtype.as_numpy_dtype)
    return None
  if kind in _INDEX_OPS and tensor.dtype.is_integer:
    inputs = [value(t, depth - 1) for t in operation.inputs]
    if any(v is None for v in inputs):
      return None
    with tf.init_scope():
      outputs = tf_internal.recreate_op_eagerly(operation, inputs)
    return outputs[tensor.value_index].numpy()
  return None


def bounds(tensor):
  """Bounds `(low, high)` of an integer scalar known when tracing.

  Either is None where unknown. Follows `tf.maximum` and `tf.minimum`
  with constants, which is how `tf.math.bincount` bounds its size.
  """
  known = value(tensor)
  if known is not None and np.size(known) == 1:
    return int(np.reshape(known, ())), int(np.reshape(known, ()))
  operation = tensor.op
  if operation.type in ("Identity", "Cast") and operation.inputs:
    return bounds(operation.inputs[0])
  if operation.type in ("Maximum", "Minimum"):
    (low_a, high_a), (low_b, high_b) = (bounds(t) for t in operation.inputs)
    if operation.type == "Maximum":
      return (_extreme(max, low_a, low_b, either=True),
              _extreme(max, high_a, high_b, either=False))
    return (_extreme(min, low_a, low_b, either=False),
            _extreme(min, high_a, high_b, either=True))
  return None, None


def _extreme(pick, a, b, either):
  """`pick(a, b)` of two bounds; with `either`, one known bound is enough."""
  if a is None or b is None:
    return (b if a is None else a) if either else None
  return pick(a, b)
