"""Values stacked along the mapped axis: moving that axis, repeating along it."""

import tensorflow as tf

from tfspmd._src.core import merged_dims


def sizes(value):
  """The sizes of `value`'s dimensions: ints where known, else scalar tensors.

  A program traced for a serving signature may leave a per-device size open
  (None); reshapes built from these take it when the program runs.
  """
  known = value.shape.as_list()
  if None not in known:
    return known
  dynamic = tf.shape(value)
  return [dynamic[k] if size is None else size for k, size in enumerate(known)]


def repeat_along_new_axis(value, axis, size):
  """`value` repeated `size` times along a new axis at `axis`.

  A broadcasting multiply rather than `tf.tile`: DTensor's SPMD expansion of
  Tile gives wrong values when the tiled axis is then split over a mesh
  dimension another tensor axis was split over (TF 2.21, a 2 x 4 mesh).
  """
  expanded = tf.expand_dims(value, axis)
  shape = [1] * expanded.shape.rank
  shape[axis] = size
  return broadcast(expanded, shape)


def broadcast(value, shape):
  """`value` broadcast with a tensor of static `shape`, by a multiply by ones.

  Not `tf.broadcast_to` or `tf.tile`: DTensor (TF 2.21) crashes on
  `broadcast_to` of a slice with a new axis and expands some tiles wrong.
  Above the rank TensorFlow's broadcasting kernels take, the multiply runs
  on merged dimensions.
  """
  if merged_dims.fully_defined(value):
    result = tf.broadcast_static_shape(value.shape, tf.TensorShape(shape))
    if result.as_list() == value.shape.as_list() and all(
        d == 1 for d in shape):
      return value
    if result.rank > merged_dims.MAX_KERNEL_RANK:
      result = result.as_list()
      runs = merged_dims.runs_of_alike_dims(
          [tuple(value.shape.as_list()), tuple(shape)], tuple(result),
          merged_dims.split_leading_dims())
      if len(runs) < len(result):
        merged = tf.reshape(value, merged_dims.merged_shape(
            value.shape.as_list(), runs, len(result)))
        return tf.reshape(_broadcast(merged, merged_dims.merged_shape(
            shape, runs, len(result))), result)
  return _broadcast(value, shape)


def _broadcast(value, shape):
  if value.dtype == tf.bool:
    return tf.logical_and(tf.ones(shape, tf.bool), value)
  if value.dtype == tf.uint64:
    # The multiply may be where DTensor gathers `value`, and its collectives
    # refuse uint64 (TF 2.21): multiply the same bits as int64.
    repeated = tf.ones(shape, tf.int64) * tf.cast(value, tf.int64)
    return tf.cast(repeated, tf.uint64)
  return tf.ones(shape, value.dtype) * value


def move_axis_to_front(value, axis):
  if axis == 0:
    return value
  rank = value.shape.rank
  return tf.transpose(value, [axis] + [a for a in range(rank) if a != axis])


def move_front_axis_to(value, axis):
  if axis == 0:
    return value
  rank = value.shape.rank
  order = list(range(1, rank))
  order.insert(axis, 0)
  return tf.transpose(value, order)


def move_axis(value, source, destination):
  """`value` with axis `source` moved to `destination`, the others in order."""
  if source == destination:
    return value
  order = list(range(value.shape.rank))
  order.insert(destination, order.pop(source))
  return tf.transpose(value, order)
