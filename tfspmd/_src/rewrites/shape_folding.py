"""Shape computations of the per-device program, folded to constants.

The gradient of a broadcasting op (a batched `tf.matmul` by a matrix, an
add of a vector to a matrix) sums over the broadcast axes, which
`BroadcastGradientArgs` computes from the operands' shapes as a tensor of
unknown length. The per-device program has static shapes, so the axes are
known when tracing; DTensor lays out only static shapes and reduces only
over constant axes, so the ops here enter the program as constants.
"""

import tensorflow as tf

from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal

_FOLDED = ("BroadcastGradientArgs", "BroadcastArgs")


def fold(conversion, operations):
  """Defines the outputs of the shape ops among `operations` as constants.

  Args:
    conversion: The `tf_internal.Conversion` converting `operations`.
    operations: The ops of a per-device graph.
  """
  for operation in operations:
    if operation.type not in _FOLDED:
      continue
    inputs = [static_values.value(t) for t in operation.inputs]
    if any(value is None for value in inputs):
      continue
    with tf.init_scope():
      outputs = tf_internal.recreate_op_eagerly(operation, inputs)
    for output, value in zip(operation.outputs, outputs):
      conversion.define(output, tf_internal.ConvertedValue(
          tf.constant(value.numpy()), False))
