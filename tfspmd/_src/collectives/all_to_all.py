"""all_to_all and pswapaxes: each device sends one block to every device.

Lowering: on a 1-D mesh, a transpose of the stacked axis with the split
axis, which DTensor turns into an all-to-all over the mesh dimension; where
DTensor gets that wrong, a gather (see `_exchange`). Transpose: all_to_all
with the split and concat axes swapped.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.collectives import checks
from tfspmd._src.collectives import groups as groups_lib
from tfspmd._src.collectives import marker
from tfspmd._src.collectives import pin
from tfspmd._src.collectives import resplit
from tfspmd._src.core import stacking
from tfspmd._src.runtime import axis_env


def _all_to_all_step(split_axis, concat_axis, tiled):
  def step(tensor, stacked, frame, batch_dims):
    size = frame.size
    if not stacked:
      tensor = stacking.repeat_along_new_axis(tensor, 0, size)
    # tensor: [source j, batch dims, per-device dims].
    split = 1 + batch_dims + split_axis
    concat = 1 + batch_dims + concat_axis
    if tiled:
      shape = stacking.sizes(tensor)
      tensor = tf.reshape(tensor, shape[:split] + [size, shape[split] // size] +
                          shape[split + 1:])
    moved = stacking.move_axis(_exchange(tensor, split, frame, batch_dims), 1,
                               concat)
    if not tiled:
      return moved, True
    # Concatenate the senders j into the concat axis that follows them.
    shape = stacking.sizes(moved)
    return tf.reshape(moved, shape[:concat] + [shape[concat] * shape[concat + 1]]
                      + shape[concat + 2:]), True
  return step


def _exchange(tensor, split, frame, batch_dims):
  """[sender j, ..., block i at `split`, ...] -> [i, j, ...]: the all-to-all.

  A transpose of the stacked axis with the split axis is DTensor's
  all-to-all, the ideal (n-1)/n of the data, and right on a 1-D mesh. DTensor
  gets it wrong elsewhere (TF 2.21): on meshes of several dimensions its
  all-to-all relayout moves the wrong blocks (8 to 10 of 150 random
  relayouts of a rank-4 tensor on 2x4, 4x2 and 2x2x2 meshes, such as
  [-, -, -, c] -> [-, -, c, -]); and its all-to-all takes only floats and
  32/64-bit signed integers. There a `gather_nd` that keeps the sender axis
  in place is right: DTensor gathers the value to every device and each
  keeps its block, moving n times the data (docs/collectives.md). Its
  result is pinned split along the receivers, for the same reason as below.

  The transpose's result is laid out with the sender axis split, where it
  went, and then relaid out with the receiver axis split: DTensor's
  Transpose expander does no communication ("needs communication is not
  supported yet" when layout propagation asks it for the final layout, as
  after an all_gather or when a GradientTape's backward pass reuses the
  result), and left to itself propagation may keep the exchanged value
  whole on every device, where ops such as TopKV2 expand wrong. So the
  all-to-all is that relayout, and what follows sees every device's own
  blocks.
  """
  resplitter = resplit.for_frame(frame, tensor.dtype)
  if resplitter is not None:
    moved = stacking.move_axis_to_front(tensor, split)
    return resplitter.move_split(moved, 1, 0)
  size = tensor.shape[0]
  blocks_second = stacking.move_axis(tensor, split, 1)
  pairs = np.stack(np.meshgrid(np.arange(size), np.arange(size),
                               indexing="ij")[::-1], axis=-1)
  exchanged = tf.gather_nd(blocks_second, pairs.astype(np.int32))
  if not pin.applies(frame, batch_dims):
    return exchanged
  return pin.pin(exchanged, [frame.mesh_dim] + [dtensor.UNSHARDED] * (
      exchanged.shape.rank - 1))


def _all_to_all_leaf(value, targets, groups, split_axis, concat_axis, tiled,
                     function, names=("split_axis", "concat_axis")):
  """One leaf's all_to_all; `names` are the user's names of the two axes."""
  rank = value.shape.rank
  split_axis = checks.normalize_axis(split_axis, rank, argument=names[0],
                                     function=function)
  concat_axis = checks.normalize_axis(concat_axis, rank, argument=names[1],
                                      function=function)
  size = groups_lib.size(targets, groups)
  checks.check_divisible(value.shape[split_axis], size,
                         argument=names[0], function=function,
                         tiled=tiled, groups=groups is not None)

  shape = value.shape.as_list()
  if tiled:
    shape[split_axis] //= size
    if shape[concat_axis] is not None:
      shape[concat_axis] *= size
  else:
    del shape[split_axis]
    shape.insert(concat_axis, size)
  # An untiled exchange between two axes would not map back.
  merged = (marker.merged_around(value, (split_axis, concat_axis))
            if tiled or split_axis == concat_axis else None)
  if merged is not None:
    value, positions = merged
    return tf.reshape(_all_to_all_leaf(
        value, targets, groups, positions[split_axis],
        positions[concat_axis], tiled, function, names), shape)
  return marker.with_transpose(
      value, targets,
      groups_lib.within(_all_to_all_step(split_axis, concat_axis, tiled),
                        groups),
      function,
      lambda cotangent: _all_to_all_leaf(cotangent, targets, groups,
                                         concat_axis, split_axis, tiled,
                                         function, names[::-1]),
      result_shape=shape, joint=True)


def all_to_all(x: Any, axis_name: Hashable, split_axis: int, concat_axis: int,
               *, axis_index_groups: Sequence[Sequence[int]] | None = None,
               tiled: bool = False) -> Any:
  """Splits `x` along `split_axis`, sends block i to device i, joins at `concat_axis`.

  Without `tiled`, `x.shape[split_axis]` must equal the axis size; the split
  axis disappears and a new axis of the senders appears at `concat_axis`.
  With `tiled`, the split axis shrinks by the axis size and `concat_axis`
  grows by it.

  With `axis_index_groups` (see `psum`), the exchange runs within each group:
  the group's size takes the place of the axis size, and the k-th device a
  group lists sends and receives block k.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = lambda x: tfspmd.lax.all_to_all(x, 'i', 0, 0)
    >>> print(tfspmd.pmap(f, 'i')(tf.reshape(tf.range(4), (2, 2))))
    [[0 2]
     [1 3]]
  """
  targets = axis_env.normalize_axis_names(axis_name, "all_to_all")
  groups = groups_lib.resolve(axis_index_groups, targets, "all_to_all")
  return checks.leafwise(
      lambda v: _all_to_all_leaf(v, targets, groups, split_axis, concat_axis,
                                 tiled, "all_to_all"), x,
      collective="all_to_all")


def pswapaxes(x: Any, axis_name: Hashable, axis: int, *,
              axis_index_groups: Sequence[Sequence[int]] | None = None) -> Any:
  """Swaps the mapped axis with the per-device axis `axis` (same size).

  With `axis_index_groups` (see `psum`), it swaps within each group, whose
  size `axis` then has.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = lambda x: tfspmd.lax.pswapaxes(x, 'i', 0)
    >>> print(tfspmd.pmap(f, 'i')(tf.reshape(tf.range(4), (2, 2))))
    [[0 2]
     [1 3]]
  """
  targets = axis_env.normalize_axis_names(axis_name, "pswapaxes")
  groups = groups_lib.resolve(axis_index_groups, targets, "pswapaxes")
  return checks.leafwise(
      lambda v: _all_to_all_leaf(v, targets, groups, axis, axis, False,
                                 "pswapaxes", ("axis", "axis")), x,
      collective="pswapaxes")
