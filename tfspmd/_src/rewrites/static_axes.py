"""Reductions over axes known while tracing: the shifted axes stay constants.

pfor moves a reduction's axes past the devices' dimension with ops
(`axes + cast(axes >= 0)`), which TensorFlow's gradients cannot read: the
gradient of such a sum builds its shape with DynamicStitch, which DTensor
cannot lay out (TF 2.21: "'tf.DynamicStitch' op does not implement layout
propagation"), as when a tape outside the user's tf.function differentiates
a pmap inside it. Axes known while tracing are shifted here, into a
constant, and the gradient takes its static path (a reshape and a tile).
"""

import numpy as np
import tensorflow as tf

from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal
from tfspmd._src.rewrites import per_position

_do_not_convert = tf.autograph.experimental.do_not_convert

_REDUCTIONS = {
    "All": tf.math.reduce_all,
    "Any": tf.math.reduce_any,
    "Max": tf.math.reduce_max,
    "Mean": tf.math.reduce_mean,
    "Min": tf.math.reduce_min,
    "Prod": tf.math.reduce_prod,
    "Sum": tf.math.reduce_sum,
}
REDUCTION_TYPES = tuple(_REDUCTIONS)


@_do_not_convert
def convert_reduction(op_inputs):
  """The converter of the reductions (`converters`)."""
  axes_input = op_inputs.input(1)
  axes = None if axes_input.stacked else static_values.value(
      axes_input.tensor)
  if axes is None:
    return per_position.default_or_per_position(op_inputs)
  axes = np.asarray(axes)
  shifted = tf.constant(np.where(axes >= 0, axes + 1, axes),
                        dtype=axes_input.tensor.dtype)
  reduce = _REDUCTIONS[op_inputs.op.type]
  result = reduce(op_inputs.stacked_input(0), shifted,
                  keepdims=op_inputs.get_attr("keep_dims"))
  return [tf_internal.wrap_converted(result, True)]
