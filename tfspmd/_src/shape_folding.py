"""Gradient shape computations folded to constants.

Some gradients compute which axes to sum over from the operands' shapes at
run time (`BroadcastGradientArgs`, in the gradient of a batched matmul
such as `(K, B, F) @ (F, F)`), so the sum that follows has a shape
TensorFlow cannot infer. Every per-device shape is static in a mapped
function, so those axes are known when it is traced: each such op is
defined, for the vectorizer, as the constants it would compute, and the
program keeps static shapes, which DTensor needs. The rewrites of ops
DTensor cannot place read their static arguments the same way
(`static_value`).
"""

import tensorflow as tf

from tfspmd._src import tf_internal


def fold(conversion, operations):
  """Defines each foldable op among `operations` as its constant outputs."""
  for operation in operations:
    if operation.type != "BroadcastGradientArgs":
      continue
    shapes = [static_value(t) for t in operation.inputs]
    if any(shape is None for shape in shapes):
      continue
    with tf.init_scope():
      reductions = tf.raw_ops.BroadcastGradientArgs(s0=shapes[0],
                                                    s1=shapes[1])
      reductions = [r.numpy() for r in reductions]
    for output, value in zip(operation.outputs, reductions):
      conversion.define(output, tf_internal.ConvertedValue(
          tf.constant(value, output.dtype), False))


def static_value(tensor):
  """The value of `tensor` where it is known at trace time, else None.

  Beyond `tf.get_static_value`: the negation of a constant (the gradient of
  `tf.roll` shifts by `-shift`) and a constant slice of a static shape.
  """
  value = tf.get_static_value(tensor)
  operation = tensor.op
  if value is not None or operation.type not in ("Neg", "StridedSlice"):
    return value
  inputs = [static_value(t) for t in operation.inputs]
  if any(v is None for v in inputs):
    return None
  if operation.type == "Neg":
    return -inputs[0]
  attributes = {name: operation.get_attr(name) for name in (
      "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
      "shrink_axis_mask")}
  with tf.init_scope():
    return tf.raw_ops.StridedSlice(
        input=inputs[0], begin=inputs[1], end=inputs[2], strides=inputs[3],
        **attributes).numpy()
