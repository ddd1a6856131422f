"""Indexing with new axes (`x[None]`, `x[:, tf.newaxis]`) that DTensor can place.

DTensor's layout propagation of a `StridedSlice` with `new_axis_mask` reads
past its own buffers when the slice leaves input axes to the right of the
new axis implicit (`x[None]`, `x[1:3, None]`, `x[None, ...]`; TF 2.21, any
layout): it fails with undecodable bytes in the message or crashes the
process with a segmentation fault. The same slice without its new axes
followed by a reshape is the same value and is placed fine, so the pfor
converter here computes it that way for a per-device value, and
`check_program` turns any such slice that is left (on a value that is the
same on every device, which pfor keeps as it is) into an error naming the
line that made it.
"""

import os

import numpy as np
import tensorflow as tf

from tfspmd._src.core import tf_internal

# Frames from these directories are library code, not the line to blame.
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                 os.path.dirname(os.path.abspath(tf.__file__)))

_do_not_convert = tf.autograph.experimental.do_not_convert


def applies(operation):
  """Whether a StridedSlice or its gradient takes this route: new axes."""
  return bool(operation.get_attr("new_axis_mask"))


@_do_not_convert
def convert(op_inputs):
  """pfor's StridedSlice conversion, with the new axes made by a reshape."""
  op = op_inputs.op
  out_shape = op.outputs[0].shape
  if any(op_inputs.input(k).stacked for k in (1, 2, 3)):
    return tf_internal.default_pfor_converter("StridedSlice")(op_inputs)
  spec = [tf.get_static_value(op_inputs.unstacked_input(k))
          for k in (1, 2, 3)]
  if not out_shape.is_fully_defined() or any(s is None for s in spec):
    return tf_internal.default_pfor_converter("StridedSlice")(op_inputs)
  new_axis = op.get_attr("new_axis_mask")
  kept = [k for k in range(len(spec[0])) if not new_axis >> k & 1]
  masks = {name: _compact(op.get_attr(name), kept)
           for name in ("begin_mask", "end_mask", "ellipsis_mask",
                        "shrink_axis_mask")}
  stacked = op_inputs.stacked_input(0)
  loop_len = stacked.shape[0]
  if loop_len is None:
    return tf_internal.default_pfor_converter("StridedSlice")(op_inputs)
  # The loop's own axis goes in front, whole: as pfor's converter does.
  sliced = tf.strided_slice(
      stacked, [0] + [int(spec[0][k]) for k in kept],
      [0] + [int(spec[1][k]) for k in kept],
      [1] + [int(spec[2][k]) for k in kept],
      begin_mask=masks["begin_mask"] << 1 | 1,
      end_mask=masks["end_mask"] << 1 | 1,
      ellipsis_mask=masks["ellipsis_mask"] << 1,
      shrink_axis_mask=masks["shrink_axis_mask"] << 1)
  return tf_internal.wrap_converted(
      tf.reshape(sliced, [loop_len] + out_shape.as_list()), True)


@_do_not_convert
def convert_gradient(op_inputs):
  """pfor's StridedSliceGrad conversion, of the slice without its new axes.

  The gradient of a slice with new axes reads the same slice spec in
  DTensor's layout propagation; the incoming gradient, reshaped to drop the
  new axes (each of size 1), is the gradient of the slice without them.
  """
  op = op_inputs.op
  default = tf_internal.default_pfor_converter("StridedSliceGrad")
  if (any(op_inputs.input(k).stacked for k in (0, 1, 2, 3)) or
      not op_inputs.input(4).stacked):
    return default(op_inputs)
  shape, begin, end, strides = [
      tf.get_static_value(op_inputs.unstacked_input(k)) for k in range(4)]
  dy = op_inputs.stacked_input(4)
  if (any(v is None for v in (shape, begin, end, strides)) or
      dy.shape[0] is None):
    return default(op_inputs)
  new_axis = op.get_attr("new_axis_mask")
  kept = [k for k in range(len(begin)) if not new_axis >> k & 1]
  masks = {name: _compact(op.get_attr(name), kept)
           for name in ("begin_mask", "end_mask", "ellipsis_mask",
                        "shrink_axis_mask")}
  spec = [np.array([v[k] for k in kept], np.int32)
          for v in (begin, end, strides)]
  with tf.Graph().as_default():
    sliced_shape = tf.strided_slice(tf.zeros(shape), *spec, **masks).shape
  loop_len = dy.shape[0]
  # The loop's own axis goes in front, whole: as pfor's converter does.
  grad = tf.raw_ops.StridedSliceGrad(
      shape=np.array([loop_len, *shape], np.int32),
      begin=np.array([0, *spec[0]], np.int32),
      end=np.array([0, *spec[1]], np.int32),
      strides=np.array([1, *spec[2]], np.int32),
      dy=tf.reshape(dy, [loop_len] + sliced_shape.as_list()),
      begin_mask=masks["begin_mask"] << 1 | 1,
      end_mask=masks["end_mask"] << 1 | 1,
      ellipsis_mask=masks["ellipsis_mask"] << 1,
      shrink_axis_mask=masks["shrink_axis_mask"] << 1)
  return tf_internal.wrap_converted(grad, True)


def check_program(outputs, axis_name):
  """Raises for a slice with new axes that would crash DTensor.

  Looks at the ops `outputs` depend on (pfor leaves the per-iteration ops
  it converted in the graph, unused), for the slices our converter did not
  rewrite: those of values that are the same on every device.

  Raises:
    ValueError: Naming the line of the user's code that made the slice.
  """
  seen = set()
  pending = [t.op for t in outputs]
  while pending:
    op = pending.pop()
    if op in seen:
      continue
    seen.add(op)
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
    if op.type == "StridedSlice" and _crashes_dtensor(op):
      raise ValueError(
          f"the function mapped over axis {axis_name!r} indexes a value that "
          f"is the same on every device with a new axis (x[None], "
          f"x[:, tf.newaxis], ...) at {_user_frame(op)}; DTensor (TF "
          f"{tf.__version__}) crashes on that slice unless every axis of x "
          f"is indexed. Write tf.expand_dims(x, axis) instead, or index "
          f"every axis (x[None, :, :] for a matrix).")


def _crashes_dtensor(op):
  """Whether DTensor mishandles this slice (measured cases, TF 2.21).

  With new axes and no shrunk axis, DTensor fails when input axes are left
  implicit after the spec or the spec ends with an ellipsis (`x[None]`,
  `x[:, :, None]` of a rank-3 x, `x[None, ...]`); a spec that names every
  axis, or has an ellipsis before its last entry, is placed fine.
  """
  if not op.get_attr("new_axis_mask") or op.get_attr("shrink_axis_mask"):
    return False
  entries = op.inputs[1].shape[0]
  rank = op.inputs[0].shape.rank
  if entries is None or rank is None:
    return True
  ellipsis = op.get_attr("ellipsis_mask")
  if ellipsis:
    return ellipsis >> (entries - 1) & 1 == 1
  named = entries - bin(op.get_attr("new_axis_mask")).count("1")
  return named < rank


def _user_frame(op):
  """The first frame of `op`'s creation outside TensorFlow and tfspmd."""
  for frame in reversed(op.traceback):
    if not os.path.abspath(frame.filename).startswith(_LIBRARY_DIRS):
      return f"{frame.filename}:{frame.lineno}"
  return op.name


def _compact(mask, kept):
  """`mask` with only the bits at positions `kept`, renumbered from 0."""
  return sum(1 << j for j, k in enumerate(kept) if mask >> k & 1)
