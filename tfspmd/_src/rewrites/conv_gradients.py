"""A pfor converter for Conv2DBackpropFilter that DTensor can expand.

pfor vectorizes the filter gradient of a convolution whose input varies
along the mapped axis with a `tf.while_loop` over a TensorList, and
DTensor cannot lay out TensorLists ("'tf.TensorListSetItem' op
ComputeLayoutForward error", TF 2.21), so a GradientTape around a conv layer
inside pmap failed. This converter computes every position's filter
gradient at once instead: for each filter tap, the input window the tap
sees (a strided slice of the padded input) contracted with the output
gradient over the batch and spatial axes, all in ops DTensor expands.
"""

import tensorflow as tf

from tfspmd._src.core import stacking
from tfspmd._src.core import tf_internal


def applies(operation):
  """Whether the Conv2DBackpropFilter `operation` takes this route: NHWC."""
  return operation.get_attr("data_format") == b"NHWC"


def convert(op_inputs):
  """The converter of an NHWC Conv2DBackpropFilter (`converters`)."""
  inputs, inputs_stacked = op_inputs.input(0)
  out_backprop, backprop_stacked = op_inputs.input(2)
  # With a filter that differs between devices the converted sizes are
  # computed from the stacked filter; the per-device op's are static.
  filter_sizes = _static_sizes(op_inputs.op.inputs[1])
  size = op_inputs.loop_size
  # Not tf.broadcast_to(x[None]): DTensor crashes on a new-axis slice.
  if not inputs_stacked:
    inputs = stacking.repeat_along_new_axis(inputs, 0, size)
  if not backprop_stacked:
    out_backprop = stacking.repeat_along_new_axis(out_backprop, 0, size)
  grads = _filter_gradient(
      inputs, out_backprop, filter_sizes,
      strides=op_inputs.get_attr("strides"),
      dilations=op_inputs.get_attr("dilations"),
      padding=op_inputs.get_attr("padding").decode(),
      explicit_paddings=op_inputs.get_attr("explicit_paddings"))
  return [tf_internal.wrap_converted(grads, True)]


def _static_sizes(sizes):
  """The value of a shape tensor known when tracing (a `tf.shape_n` too)."""
  known = tf.get_static_value(sizes)
  if known is None and sizes.op.type == "ShapeN":
    shape = sizes.op.inputs[sizes.value_index].shape
    if shape.is_fully_defined():
      known = shape.as_list()
  if known is None:
    raise ValueError(
        f"the gradient of a convolution inside a mapped function needs the "
        f"filter's shape when tracing, and {sizes.op.name} has none; give "
        f"the filter a static shape.")
  return [int(v) for v in known]


def _pads(length, out_length, kernel, stride, dilation):
  """TensorFlow's SAME padding of one spatial axis: (before, after)."""
  total = max((out_length - 1) * stride + (kernel - 1) * dilation + 1 - length, 0)
  return total // 2, total - total // 2


def _filter_gradient(inputs, out_backprop, filter_sizes, *, strides,
                     dilations, padding, explicit_paddings):
  """[n, b, h, w, c_in] x [n, b, h', w', c_out] -> [n, kh, kw, c_in, c_out]."""
  kernel_h, kernel_w = (int(v) for v in filter_sizes[:2])
  _, _, height, width, _ = inputs.shape.as_list()
  _, _, out_h, out_w, _ = out_backprop.shape.as_list()
  stride_h, stride_w = strides[1], strides[2]
  dilation_h, dilation_w = dilations[1], dilations[2]
  if padding == "SAME":
    pad_h = _pads(height, out_h, kernel_h, stride_h, dilation_h)
    pad_w = _pads(width, out_w, kernel_w, stride_w, dilation_w)
  elif padding == "EXPLICIT":
    pad_h = tuple(explicit_paddings[2:4])
    pad_w = tuple(explicit_paddings[4:6])
  else:
    pad_h = pad_w = (0, 0)
  padded = tf.pad(inputs, [[0, 0], [0, 0], list(pad_h), list(pad_w), [0, 0]])
  taps = []
  for i in range(kernel_h):
    row = []
    for j in range(kernel_w):
      top, left = i * dilation_h, j * dilation_w
      window = padded[:, :, top:top + (out_h - 1) * stride_h + 1:stride_h,
                      left:left + (out_w - 1) * stride_w + 1:stride_w, :]
      row.append(tf.einsum("nbhwi,nbhwo->nio", window, out_backprop))
    taps.append(tf.stack(row, axis=1))
  grads = tf.stack(taps, axis=1)
  return grads
