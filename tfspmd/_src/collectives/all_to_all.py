"""all_to_all and pswapaxes: each device sends one block to every device.

Lowering: a transpose of the stacked axis with the split axis, which DTensor
turns into an all-to-all over the mesh dimension. Transpose: all_to_all with
the split and concat axes swapped.
"""

import numpy as np
import tensorflow as tf

from tfspmd._src import axis_env
from tfspmd._src import vectorize
from tfspmd._src.collectives import checks
from tfspmd._src.collectives import marker


def _all_to_all_step(split_axis, concat_axis, tiled):
  def step(tensor, stacked, frame, batch_dims):
    size = frame.size
    if not stacked:
      tensor = vectorize.repeat_along_new_axis(tensor, 0, size)
    # tensor: [source j, batch dims, per-device dims].
    split = 1 + batch_dims + split_axis
    concat = 1 + batch_dims + concat_axis
    if tiled:
      shape = tensor.shape.as_list()
      tensor = tf.reshape(tensor, shape[:split] + [size, shape[split] // size] +
                          shape[split + 1:])
    moved = _move_axis(_exchange(tensor, split), 1, concat)
    if not tiled:
      return moved, True
    # Concatenate the senders j into the concat axis that follows them.
    shape = moved.shape.as_list()
    return tf.reshape(moved, shape[:concat] + [shape[concat] * shape[concat + 1]]
                      + shape[concat + 2:]), True
  return step


def _exchange(tensor, split):
  """[sender j, ..., block i at `split`, ...] -> [i, j, ...]: the all-to-all.

  A transpose of the stacked axis with the split axis would be DTensor's
  all-to-all, but DTensor gets that wrong (TF 2.21): on meshes of several
  dimensions its all-to-all relayout moves the wrong blocks (8 to 10 of 150
  random relayouts of a rank-4 tensor on 2x4, 4x2 and 2x2x2 meshes, such as
  [-, -, -, c] -> [-, -, c, -]), and on a 1-D mesh a gradient that reuses
  the result asks its Transpose expander for a layout it refuses ("needs
  communication is not supported yet"). A `gather_nd` that keeps the sender
  axis in place is right in every case: DTensor gathers the value to every
  device and each keeps its block, moving n times the data instead of
  (n-1)/n of it (docs/collectives.md).
  """
  size = tensor.shape[0]
  blocks_second = _move_axis(tensor, split, 1)
  pairs = np.stack(np.meshgrid(np.arange(size), np.arange(size),
                               indexing="ij")[::-1], axis=-1)
  return tf.gather_nd(blocks_second, pairs.astype(np.int32))


def _move_axis(tensor, source, destination):
  order = list(range(tensor.shape.rank))
  order.insert(destination, order.pop(source))
  return tf.transpose(tensor, order)


def _all_to_all_leaf(value, targets, split_axis, concat_axis, tiled,
                     function):
  rank = value.shape.rank
  split_axis = checks.normalize_axis(split_axis, rank, argument="split_axis",
                                     function=function)
  concat_axis = checks.normalize_axis(concat_axis, rank, argument="concat_axis",
                                      function=function)
  size = checks.total_size(targets)
  checks.check_divisible(value.shape[split_axis], size,
                         argument="split_axis", function=function,
                         tiled=tiled)

  shape = value.shape.as_list()
  if tiled:
    shape[split_axis] //= size
    shape[concat_axis] *= size
  else:
    del shape[split_axis]
    shape.insert(concat_axis, size)
  return marker.with_transpose(
      value, targets, _all_to_all_step(split_axis, concat_axis, tiled),
      function,
      lambda cotangent: _all_to_all_leaf(cotangent, targets, concat_axis,
                                         split_axis, tiled, function),
      result_shape=shape, joint=True)


def all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=False):
  """Splits `x` along `split_axis`, sends block i to device i, joins at `concat_axis`.

  Without `tiled`, `x.shape[split_axis]` must equal the axis size; the split
  axis disappears and a new axis of the senders appears at `concat_axis`.
  With `tiled`, the split axis shrinks by the axis size and `concat_axis`
  grows by it.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = lambda x: tfspmd.lax.all_to_all(x, 'i', 0, 0)
    >>> print(tfspmd.pmap(f, 'i')(tf.reshape(tf.range(4), (2, 2))))
    [[0 2]
     [1 3]]
  """
  targets = axis_env.normalize_axis_names(axis_name, "all_to_all")
  return checks.leafwise(
      lambda v: _all_to_all_leaf(v, targets, split_axis, concat_axis, tiled,
                                 "all_to_all"), x)


def pswapaxes(x, axis_name, axis):
  """Swaps the mapped axis with the per-device axis `axis` (same size).

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = lambda x: tfspmd.lax.pswapaxes(x, 'i', 0)
    >>> print(tfspmd.pmap(f, 'i')(tf.reshape(tf.range(4), (2, 2))))
    [[0 2]
     [1 3]]
  """
  targets = axis_env.normalize_axis_names(axis_name, "pswapaxes")
  return checks.leafwise(
      lambda v: _all_to_all_leaf(v, targets, axis, axis, False, "pswapaxes"), x)
