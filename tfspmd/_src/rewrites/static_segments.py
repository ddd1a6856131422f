"""Sorted segment reductions over segment ids known when tracing.

`tf.math.segment_sum(x, ids)` has as many rows as `ids[-1] + 1`, a size
TensorFlow leaves unknown when tracing even where `ids` is a constant, and
a mapped function needs static shapes. With constant ids the size is
known, as `jax.ops.segment_sum` infers it from concrete ids: the op is
traced as the unsorted reduction with that many segments, and the rows of
segments no id names take the values the sorted op gives them (0, or 1 for
a product).
"""

import numpy as np
import tensorflow as tf

_UNSORTED = {
    "SegmentSum": tf.math.unsorted_segment_sum,
    "SegmentProd": tf.math.unsorted_segment_prod,
    "SegmentMax": tf.math.unsorted_segment_max,
    "SegmentMin": tf.math.unsorted_segment_min,
    "SegmentMean": tf.math.unsorted_segment_sum,
}
SEGMENT_TYPES = frozenset(_UNSORTED)


def rewrite(op_type, inputs, outputs, name):
  """The op with static segment ids as its unsorted form; None to keep it."""
  del outputs
  data, segment_ids = inputs
  ids = tf.get_static_value(segment_ids)
  if ids is None or data.shape.rank is None or ids.ndim != 1 or (ids.size and (
      ids.min() < 0 or np.any(np.diff(ids) < 0))):
    return None
  count = int(ids[-1]) + 1 if ids.size else 0
  result = _UNSORTED[op_type](data, segment_ids, count, name=name)
  rows = np.bincount(ids, minlength=count)
  if op_type == "SegmentMean":
    divisor = np.maximum(rows, 1).reshape([-1] + [1] * (data.shape.rank - 1))
    return [result / tf.constant(divisor, result.dtype)]
  if op_type in ("SegmentMax", "SegmentMin") and not rows.all():
    named = tf.constant(
        (rows > 0).reshape([-1] + [1] * (data.shape.rank - 1)))
    named = tf.logical_and(named, tf.ones(tf.shape(result), tf.bool))
    return [tf.where(named, result, tf.zeros_like(result))]
  return [result]
