"""Unsorted segment reductions whose data or ids differ between devices.

pfor reduces all devices' segments in one op over `n * num_segments`
segments and reshapes the result by sizes it computes while the program
runs. DTensor then sees a result of unknown size that it must split over
the devices, and cannot (TF 2.21): the gradient of a gather, made dense,
is such a reduction. With `num_segments` known when tracing, the sizes
here are static; a floating-point sum of small enough size is a one-hot
product instead, which DTensor computes on each device's own rows.

An id that is negative or not below `num_segments` drops its row, as in
`jax.ops.segment_sum` (TensorFlow on one device raises for one too large).
"""

import tensorflow as tf

from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal
from tfspmd._src.rewrites import per_position
from tfspmd._src.runtime import axis_env

_do_not_convert = tf.autograph.experimental.do_not_convert

_REDUCTIONS = {
    "UnsortedSegmentSum": tf.math.unsorted_segment_sum,
    "UnsortedSegmentProd": tf.math.unsorted_segment_prod,
    "UnsortedSegmentMax": tf.math.unsorted_segment_max,
    "UnsortedSegmentMin": tf.math.unsorted_segment_min,
}
SEGMENT_TYPES = tuple(_REDUCTIONS)

# The most elements of a one-hot matrix (ids x segments, per device) a sum
# takes as a product; past it, the reduction itself.
_ONE_HOT_LIMIT = 1 << 20


@_do_not_convert
def convert(op_inputs):
  """The converter of the unsorted segment reductions (`converters`)."""
  segments = static_values.value(op_inputs.input(2).tensor)
  if op_inputs.input(2).stacked or segments is None:
    return per_position.default_or_per_position(op_inputs)
  segments = int(segments)
  size = op_inputs.loop_size
  data = op_inputs.stacked_input(0)
  ids = op_inputs.stacked_input(1)
  id_rank = ids.shape.rank - 1
  row_shape = data.shape.as_list()[1 + id_rank:] if (
      data.shape.rank is not None) else [None]
  if not ids.shape.is_fully_defined() or None in row_shape:
    return per_position.default_or_per_position(op_inputs)
  id_count = ids.shape.num_elements() // size
  operation = op_inputs.op
  # The product merges the ids' dimensions: only where none of them is
  # split over the devices (an inner pmap's axis would be).
  if (operation.type == "UnsortedSegmentSum" and data.dtype.is_floating and
      id_count * segments <= _ONE_HOT_LIMIT and
      axis_env.split_leading_dims() <= 1):
    return [tf_internal.wrap_converted(
        _one_hot_sum(data, ids, size, id_count, segments, row_shape), True)]
  offsets = tf.reshape(tf.range(size, dtype=ids.dtype) * segments,
                       [size] + [1] * id_rank)
  # A negative id drops its row, as in the op; an id past the segments
  # drops it too, rather than reach the next position's segments.
  shifted = tf.where(tf.logical_and(ids >= 0, ids < segments), ids + offsets,
                     -tf.ones_like(ids))
  reduced = _REDUCTIONS[operation.type](data, shifted, size * segments)
  return [tf_internal.wrap_converted(
      tf.reshape(reduced, [size, segments] + row_shape), True)]


def _one_hot_sum(data, ids, size, id_count, segments, row_shape):
  """Each position's segment sums as a product with its ids' one-hot rows.

  An id out of range has an empty one-hot row: its data is dropped, as a
  negative id's is.
  """
  row_size = 1
  for d in row_shape:
    row_size *= d
  flat_data = tf.reshape(data, [size, id_count, row_size])
  picks = tf.one_hot(tf.reshape(ids, [size, id_count]), segments,
                     dtype=data.dtype)
  summed = tf.einsum("nks,nkc->nsc", picks, flat_data)
  return tf.reshape(summed, [size, segments] + row_shape)
