"""all_gather and psum_scatter, each other's transpose.

Lowering: all_gather moves the stacked axis (split over the mesh dimension)
to the gathered position and leaves the converter unstacked, relaid out
whole on each device, so DTensor gathers it there; psum_scatter sums over
the stacked axis and moves the scattered dimension to the front, where the
result is split over the mesh dimension again (see docs/collectives.md for what DTensor made of
each).
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.collectives import checks
from tfspmd._src.collectives import groups as groups_lib
from tfspmd._src.collectives import marker
from tfspmd._src.collectives import pin
from tfspmd._src.collectives import resplit
from tfspmd._src.core import stacking
from tfspmd._src.runtime import axis_env


def _gather_step(axis, tiled):
  def step(tensor, stacked, frame, batch_dims):
    position = batch_dims + axis
    if stacked:
      gathered = stacking.move_front_axis_to(tensor, position)
    else:
      gathered = stacking.repeat_along_new_axis(tensor, position, frame.size)
    if tiled:
      gathered = _merge_with_next(gathered, position)
    return gathered, False
  return step


def _merge_with_next(tensor, axis):
  shape = stacking.sizes(tensor)
  merged = shape[:axis] + [shape[axis] * shape[axis + 1]] + shape[axis + 2:]
  return tf.reshape(tensor, merged)


def _scatter_step(dimension, tiled):
  def step(tensor, stacked, frame, batch_dims):
    position = batch_dims + dimension
    resplitter = stacked and resplit.for_frame(frame, tensor.dtype)
    if resplitter:
      return _reduce_scatter(tensor, 1 + position, tiled, resplitter), True
    total = (tf.reduce_sum(tensor, axis=0) if stacked else
             tensor * tf.cast(frame.size, tensor.dtype))
    if tiled:
      total = _split_axis(total, position, frame.size)
    if not pin.applies(frame, batch_dims):
      return stacking.move_axis_to_front(total, position), True
    return _scatter_blocks(total, position, frame.mesh_dim), True
  return step


def _scatter_blocks(total, position, mesh_dim):
  """The blocks along `position` of `total`, block i to device i.

  The sum is split over the mesh dimension along the blocks before they
  move to the front and after: a consumer of the result split another way
  (an all_gather's value, still split where the gather left it) then makes
  DTensor relayout the result, where it can move data, not transpose it.
  """
  spec = [dtensor.UNSHARDED] * total.shape.rank
  spec[position] = mesh_dim
  split = pin.pin(total, spec)
  fronted = stacking.move_axis_to_front(split, position)
  return pin.pin(fronted, [mesh_dim] + [dtensor.UNSHARDED] * (
      total.shape.rank - 1))


def _split_axis(tensor, axis, count):
  """`axis` of size k*count becomes [count, k] (count major)."""
  shape = stacking.sizes(tensor)
  return tf.reshape(tensor, shape[:axis] + [count, shape[axis] // count] +
                    shape[axis + 1:])


def _reduce_scatter(tensor, axis, tiled, resplitter):
  """Sum over the stacked axis of the blocks of `axis`, block i to device i.

  An all-to-all sends block i of every device to device i, which sums them:
  (n-1)/n of the value sent per device, a reduce-scatter's ideal.
  """
  if tiled:
    tensor = _split_axis(tensor, axis, resplitter.size)
  blocks = stacking.move_axis(tensor, axis, 1)
  return tf.reduce_sum(resplitter.split_along(blocks, 1), axis=0)


def _all_gather_leaf(value, targets, groups, axis, tiled):
  rank = value.shape.rank
  if tiled and rank == 0:
    raise ValueError(
        "all_gather: tiled=True concatenates along an existing axis, so it "
        "needs a per-device value of rank >= 1, but got a scalar; gather "
        "scalars with tiled=False.")
  axis = checks.normalize_axis(
      axis, rank + (0 if tiled else 1), argument="axis", function="all_gather",
      of=None if tiled else (f"the gathered result of rank {rank + 1} (a "
                             f"per-device value of rank {rank} and the new "
                             f"axis)"))

  size = groups_lib.size(targets, groups)
  shape = value.shape.as_list()
  if tiled:
    shape[axis] = None if shape[axis] is None else shape[axis] * size
  else:
    shape.insert(axis, size)
  gathered = marker.with_transpose(
      value, targets,
      groups_lib.within(_gather_step(axis, tiled), groups), "all_gather",
      lambda cotangent: _psum_scatter_leaf(cotangent, targets, groups, axis,
                                           tiled),
      # Each group gathers its own values: the result varies between them.
      result_shape=shape, joint=True, varies=groups is not None)
  return pin.whole_on_each_device(gathered)


def _psum_scatter_leaf(value, targets, groups, dimension, tiled):
  rank = value.shape.rank
  dimension = checks.normalize_axis(dimension, rank,
                                    argument="scatter_dimension",
                                    function="psum_scatter")
  size = groups_lib.size(targets, groups)
  checks.check_divisible(value.shape[dimension], size,
                         argument="scatter_dimension", function="psum_scatter",
                         tiled=tiled, groups=groups is not None)

  shape = value.shape.as_list()
  if tiled:
    shape[dimension] //= size
  else:
    del shape[dimension]
  merged = marker.merged_around(value, (dimension,))
  if merged is not None:
    value, positions = merged
    return tf.reshape(_psum_scatter_leaf(value, targets, groups,
                                         positions[dimension], tiled), shape)
  return marker.with_transpose(
      value, targets,
      groups_lib.within(_scatter_step(dimension, tiled), groups),
      "psum_scatter",
      lambda cotangent: _all_gather_leaf(cotangent, targets, groups,
                                         dimension, tiled),
      result_shape=shape, joint=True)


def all_gather(x: Any, axis_name: Hashable, *,
               axis_index_groups: Sequence[Sequence[int]] | None = None,
               axis: int = 0, tiled: bool = False) -> Any:
  """Gathers `x` from every device of the named axis.

  Args:
    x: A tensor or pytree of tensors.
    axis_name: A bound axis name, or a tuple of names: then the devices of
      all of them, ordered by their linear index (the first name major).
    axis_index_groups: Optional groups of axis indices (see `psum`): each
      device gathers from the devices of its group only, in the order the
      group lists them, and the gathered axis has the group's size.
    axis: Where the new axis of the devices goes in the result (negative
      counts from the end of the result).
    tiled: If True, concatenate along `axis` instead of stacking a new axis.

  Returns:
    The same value on every device: shape `x.shape` with the axis size
    inserted at `axis` (or `x.shape[axis]` multiplied by it when tiled).

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = tfspmd.pmap(lambda x: tfspmd.lax.all_gather(x, 'i'), 'i')
    >>> print(f(tf.range(3))[1])
    tf.Tensor([0 1 2], shape=(3,), dtype=int32)
    >>> g = lambda x: tfspmd.lax.all_gather(x, 'i',
    ...                                     axis_index_groups=[[0, 2], [3, 1]])
    >>> print(tfspmd.pmap(g, 'i')(tf.range(4)))
    [[0 2]
     [3 1]
     [0 2]
     [3 1]]
  """
  targets = axis_env.normalize_axis_names(axis_name, "all_gather")
  groups = groups_lib.resolve(axis_index_groups, targets, "all_gather")
  return checks.leafwise(
      lambda v: _all_gather_leaf(v, targets, groups, axis, tiled), x,
      collective="all_gather")


def psum_scatter(x: Any, axis_name: Hashable, *, scatter_dimension: int = 0,
                 axis_index_groups: Sequence[Sequence[int]] | None = None,
                 tiled: bool = False) -> Any:
  """Sums `x` over the named axis and gives each device one block of the sum.

  Args:
    x: A tensor or pytree of tensors.
    axis_name: A bound axis name, or a tuple of names: then device k of
      their linear index (the first name major) gets block k.
    scatter_dimension: The dimension split between the devices; its size must
      equal the axis size (or divide by it when tiled).
    axis_index_groups: Optional groups of axis indices (see `psum`): each
      group sums on its own, and the k-th device its group lists gets block
      k; the dimension's size is then that of a group.
    tiled: If True, keep the dimension (with size divided by the axis size)
      instead of removing it.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> f = tfspmd.pmap(lambda x: tfspmd.lax.psum_scatter(x, 'i'), 'i')
    >>> print(f(tf.reshape(tf.range(4.), (2, 2))))
    [2. 4.]
  """
  targets = axis_env.normalize_axis_names(axis_name, "psum_scatter")
  groups = groups_lib.resolve(axis_index_groups, targets, "psum_scatter")
  return checks.leafwise(
      lambda v: _psum_scatter_leaf(v, targets, groups, scatter_dimension,
                                   tiled), x,
      collective="psum_scatter", accepts=checks.NUMBERS)
