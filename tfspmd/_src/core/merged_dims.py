"""Ops of high rank computed on fewer dimensions, by merging adjacent ones.

Every mapped axis adds a dimension to each tensor of the vectorized
program, and TensorFlow's CPU kernels of broadcasting ops and slices stop
at rank 8 (`MAX_KERNEL_RANK`). A broadcast treats adjacent dimensions
alike when every operand either has them whole or has them of size 1; such
runs merge into one dimension, by a reshape that moves no data, and the op
runs on the merged shapes.

>>> runs_of_alike_dims([(2, 3, 4), (1, 1, 4)], (2, 3, 4))
[(0, 2), (2, 3)]
"""

import math

import tensorflow as tf

MAX_KERNEL_RANK = 8


def _no_split_dims():
  return 0


# How many leading dimensions of a value traced now lie split over the
# devices (none merges into the dimension before it: that would move data
# between them).
# The runtime layer, which knows the axes bound while a program is traced,
# sets it (`axis_env.split_leading_dims`).
split_leading_dims = _no_split_dims

_EITHER, _WHOLE, _BROADCAST = 0, 1, 2


def runs_of_alike_dims(operand_shapes, result_shape, split=0):
  """`(start, stop)` runs of result dimensions every operand treats alike.

  Args:
    operand_shapes: Static shapes (tuples of ints), each broadcasting to
      `result_shape` (lower ranks are padded with 1 on the left).
    result_shape: The static shape of the result.
    split: How many leading dimensions are split over the devices: each
      starts a run (merging two of them, or one into the dimension before
      it, would move data between devices); a run may go on after one, as
      the devices' blocks stay whole.

  Returns:
    Runs covering `range(len(result_shape))` in order.
  """
  rank = len(result_shape)
  padded = [(1,) * (rank - len(s)) + tuple(s) for s in operand_shapes]
  runs = []
  states = None
  for dim, size in enumerate(result_shape):
    dim_states = [_EITHER if size == 1 else
                  _WHOLE if shape[dim] == size else _BROADCAST
                  for shape in padded]
    if states is not None and dim >= split and all(
        a == _EITHER or b == _EITHER or a == b
        for a, b in zip(states, dim_states)):
      runs[-1] = (runs[-1][0], dim + 1)
      states = [b if a == _EITHER else a for a, b in zip(states, dim_states)]
      continue
    runs.append((dim, dim + 1))
    states = dim_states
  return runs


def merged_shape(shape, runs, rank):
  """`shape` (padded on the left to `rank`) with each run merged."""
  padded = (1,) * (rank - len(shape)) + tuple(shape)
  return [math.prod(padded[start:stop]) for start, stop in runs]


def broadcast_on_merged_dims(function, operands, result_shape, split=0):
  """`function(*operands)`, a broadcasting op, computed on merged dimensions.

  Args:
    function: `function(merged_operands, merged_result_shape)` returns the
      op's result on the merged dimensions.
    operands: Tensors of static shapes that broadcast to `result_shape`.
    result_shape: The static result shape (a list of ints).
    split: See `runs_of_alike_dims`.

  Returns:
    The result, of `result_shape`; None if no two dimensions merge.
  """
  shapes = [tuple(t.shape.as_list()) for t in operands]
  runs = runs_of_alike_dims(shapes, tuple(result_shape), split)
  if len(runs) == len(result_shape):
    return None
  rank = len(result_shape)
  merged = [tf.reshape(t, merged_shape(s, runs, rank))
            for t, s in zip(operands, shapes)]
  return tf.reshape(function(merged, merged_shape(result_shape, runs, rank)),
                    result_shape)


def fully_defined(*tensors):
  """Whether every tensor's static shape is fully known."""
  return all(t.shape.is_fully_defined() for t in tensors)
