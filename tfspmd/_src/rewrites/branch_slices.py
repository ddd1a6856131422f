"""Sparse gradients that branches of a per-device conditional return.

Under a tape, a conditional's gradient is another conditional whose
branches may return a variable's gradient as `IndexedSlices`: the rows a
gather read in one branch, every row in another, so the branches' values
differ in size and no select can pick between them per device. Where the
devices pick differently, each branch's slices are made dense (as
`tf.convert_to_tensor` of the slices would) and the dense gradients are
picked; the result is the slices of every row.
"""

import numpy as np
import tensorflow as tf

from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal


def slice_positions(graph):
  """`(values, indices, dense_shape)` output positions of each IndexedSlices.

  From the branch `graph`'s structured outputs; positions of slices whose
  dense shape is not a known constant are left out.
  """
  found = []
  for leaf in tf.nest.flatten(graph.structured_outputs):
    if not isinstance(leaf, tf.IndexedSlices) or leaf.dense_shape is None:
      continue
    positions = [_position(graph.outputs, t)
                 for t in (leaf.values, leaf.indices, leaf.dense_shape)]
    if None not in positions:
      found.append(tuple(positions))
  return found


def _position(outputs, tensor):
  for index, output in enumerate(outputs):
    if output is tensor:
      return index
  return None


def merge_ready(graphs, branch_outputs, size):
  """`branch_outputs`, with slices of sizes that differ between branches dense.

  Returns `branch_outputs` as they are where nothing needs it or the
  slices' dense shapes are not known when tracing.
  """
  positions = slice_positions(graphs[0])
  if any(slice_positions(graph) != positions for graph in graphs[1:]):
    return branch_outputs
  differ = [p for p in positions if len({
      outputs[p[0]].tensor.shape[int(outputs[p[0]].stacked):]
      for outputs in branch_outputs}) > 1]
  if not differ:
    return branch_outputs
  return densified(branch_outputs, differ, size) or branch_outputs


def densified(branch_outputs, positions, size):
  """`branch_outputs` with the slices at `positions` made dense rows.

  Args:
    branch_outputs: One list of `ConvertedValue`s per branch.
    positions: `(values, indices, dense_shape)` positions, the same in each
      branch (the branches of one conditional return one structure).
    size: The number of loop positions.

  Returns:
    New lists, where each slices' values hold every row (stacked), its
    indices are every row's and its dense shape is the constant one; None
    where a dense shape is not known when tracing.
  """
  branch_outputs = [list(outputs) for outputs in branch_outputs]
  for values_at, indices_at, shape_at in positions:
    shapes = [static_values.value(outputs[shape_at].tensor)
              for outputs in branch_outputs]
    if any(s is None or outputs[shape_at].stacked
           for s, outputs in zip(shapes, branch_outputs)):
      return None
    dense_shape = shapes[0]
    rows = int(dense_shape[0])
    for outputs in branch_outputs:
      outputs[values_at] = tf_internal.ConvertedValue(
          _dense_rows(outputs[values_at], outputs[indices_at], rows,
                      dense_shape, size), True)
      outputs[indices_at] = tf_internal.ConvertedValue(
          tf.range(rows, dtype=outputs[indices_at].tensor.dtype), False)
      outputs[shape_at] = tf_internal.ConvertedValue(
          tf.constant(dense_shape, outputs[shape_at].tensor.dtype), False)
  return branch_outputs


def _dense_rows(values, indices, rows, dense_shape, size):
  """Each position's slices as one dense tensor, stacked: a one-hot product.

  A product rather than a segment sum: DTensor splits it by the stacked
  axis with no communication.
  """
  values = tf_internal.stacked(values, size)
  indices = tf_internal.stacked(indices, size)
  row_size = int(np.prod(dense_shape[1:], dtype=np.int64))
  flat = tf.reshape(values, [size, -1, row_size])
  picks = tf.one_hot(indices, rows, dtype=values.dtype)
  dense = tf.einsum("nkr,nkc->nrc", picks, flat)
  return tf.reshape(dense, [size] + [int(d) for d in dense_shape])
