"""Slices and broadcasts that the mapped axes would take past rank 8.

Each axis a program is mapped over, a mesh axis of size 1 included, adds a
dimension to every tensor of the vectorized program, and TensorFlow's CPU
kernels of slices and broadcasting ops stop at rank 8
(`merged_dims.MAX_KERNEL_RANK`). As such an op is traced inside a mapped
function, where it would pass that rank once vectorized, it is rewritten
on fewer dimensions: adjacent dimensions a slice takes whole, or a
broadcast treats alike, merge into one by a reshape, which moves no data
(the mapped dimensions lie in front, untouched); a stack or concatenation
joins the dimensions before its axis and those from it on, each merged;
a softmax runs on `[rows, last]`, or from exponentials and sums where the
mapped axes leave no room even for that. The results are the
same; an op that still passes the limit is found before the program runs
(`exceeds_kernel_rank`).
"""

import functools
import math

import tensorflow as tf

from tfspmd._src.core import merged_dims
from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal
from tfspmd._src.runtime import axis_env

_do_not_convert = tf.autograph.experimental.do_not_convert

# Ops whose CPU kernels take at most MAX_KERNEL_RANK dimensions where
# their operands broadcast or they slice.
BROADCASTING = frozenset((
    "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "FloorDiv",
    "FloorMod", "TruncateDiv", "TruncateMod", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "Less", "LessEqual", "Greater", "GreaterEqual",
    "Equal", "NotEqual", "LogicalAnd", "LogicalOr", "BitwiseAnd",
    "BitwiseOr", "BitwiseXor", "Atan2", "Xdivy", "Xlogy", "MulNoNan",
    "SelectV2", "BroadcastTo",
))
SLICING = frozenset(("StridedSlice", "Slice"))
# Softmax's CPU kernel (oneDNN) takes at most rank 5; it acts on the last
# dimension alone, so the others merge into one.
_SOFTMAX_RANK = 5
SOFTMAX = frozenset(("Softmax", "LogSoftmax"))
# DTensor moves the operands of a stack or a concatenation between layouts
# (a Slice) at the result's rank.
JOINING = frozenset(("Pack", "ConcatV2"))
REWRITTEN = (BROADCASTING | SLICING | SOFTMAX | JOINING |
             {"Tile", "StridedSliceGrad"})
LIMITED = BROADCASTING | SLICING | SOFTMAX | frozenset((
    "Tile", "Pad", "PadV2", "MirrorPad", "ReverseV2", "StridedSliceGrad"))


def _room():
  """How many dimensions an op traced here may have once vectorized."""
  return merged_dims.MAX_KERNEL_RANK - len(axis_env.frames())


def rewrite(op_type, inputs, outputs):
  """The op on merged dimensions where it would pass the limit; else None."""
  if not outputs:
    return None
  result = outputs[0]
  if result.shape.rank is None:
    return None
  rank = max([result.shape.rank] + [t.shape.rank or 0 for t in inputs[:1]])
  if op_type in SOFTMAX:
    return _merged_softmax(op_type, inputs[0], rank)
  if rank <= _room() or not result.shape.is_fully_defined():
    return None
  if op_type in SLICING:
    return _merged_slice(op_type, inputs, outputs)
  if op_type == "Tile":
    return _merged_tile(inputs, outputs)
  if op_type == "StridedSliceGrad":
    return _merged_slice_gradient(inputs, outputs)
  if op_type in JOINING:
    return _merged_join(op_type, inputs, outputs)
  return _merged_broadcast(op_type, inputs, outputs)


def _merged_softmax(op_type, logits, rank):
  """A softmax of a rank its kernel would not take.

  Its leading dimensions merge into one (`[rows, last]`) where the mapped
  dimensions leave user dimensions to merge; otherwise it is written in
  elementwise ops and reductions, whose kernels go to rank 8.
  """
  split = axis_env.split_leading_dims()
  room = _SOFTMAX_RANK - len(axis_env.frames())
  if rank <= room:
    return None
  if rank <= split + 2 or not logits.shape.is_fully_defined():
    return [_elementwise_softmax(op_type, logits)]
  sizes = logits.shape.as_list()
  merged = tf.reshape(logits, sizes[:split] + [-1, sizes[-1]])
  function = tf.nn.softmax if op_type == "Softmax" else tf.nn.log_softmax
  return [tf.reshape(function(merged), sizes)]


def _elementwise_softmax(op_type, logits):
  """Softmax or LogSoftmax over the last dimension, from Exp, Max and Sum."""
  shifted = logits - tf.stop_gradient(
      tf.reduce_max(logits, axis=-1, keepdims=True))
  if op_type == "LogSoftmax":
    return shifted - tf.math.log(
        tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True))
  exponentials = tf.exp(shifted)
  return exponentials / tf.reduce_sum(exponentials, axis=-1, keepdims=True)


def _merged_join(op_type, inputs, outputs):
  """A stack or concatenation on `[before, from the axis on]` merged.

  In row-major order, joining along an axis joins the blocks of all the
  dimensions from that axis on, at each position of those before it.
  """
  if op_type == "Pack":
    values, axis = inputs, outputs[0].op.get_attr("axis")
  else:
    values, axis = inputs[:-1], static_values.value(inputs[-1])
  if axis is None or not merged_dims.fully_defined(*values):
    return None
  rank = values[0].shape.rank
  axis = int(axis) + (rank + (op_type == "Pack") if axis < 0 else 0)
  split = axis_env.split_leading_dims()
  if axis < split:
    return None
  shapes = [value.shape.as_list() for value in values]
  merged_shapes = [shape[:split] + (
      [math.prod(shape[split:axis])] if axis > split else []) + (
          [math.prod(shape[axis:])] if axis < rank else [])
                   for shape in shapes]
  if len(merged_shapes[0]) == rank:
    return None
  merged = [tf.reshape(value, shape)
            for value, shape in zip(values, merged_shapes)]
  position = min(axis, split + 1)
  joined = (tf.stack(merged, axis=position) if op_type == "Pack" else
            tf.concat(merged, axis=position))
  return [tf.reshape(joined, outputs[0].shape.as_list())]


def _merged_tile(inputs, outputs):
  """A tile on merged runs of the dimensions it does not repeat."""
  value, multiples = inputs
  multiples = static_values.value(multiples)
  if multiples is None or not merged_dims.fully_defined(value):
    return None
  merged_shape, merged_multiples = [], []
  split = axis_env.split_leading_dims()
  for dim, (size, times) in enumerate(zip(value.shape.as_list(), multiples)):
    if (dim >= split and times == 1 and merged_multiples and
        merged_multiples[-1] == 1):
      merged_shape[-1] *= size
      continue
    merged_shape.append(size)
    merged_multiples.append(int(times))
  if len(merged_shape) == value.shape.rank:
    return None
  tiled = tf.tile(tf.reshape(value, merged_shape), merged_multiples)
  return [tf.reshape(tiled, outputs[0].shape.as_list())]


def _merged_broadcast(op_type, inputs, outputs):
  operands = list(inputs[:1] if op_type == "BroadcastTo" else inputs)
  result_shape = outputs[0].shape.as_list()
  if not merged_dims.fully_defined(*operands) or all(
      t.shape.as_list() == result_shape for t in operands):
    # Operands of the result's shape need no broadcast, at any rank.
    return None
  merged = merged_dims.broadcast_on_merged_dims(
      functools.partial(_on_merged_dims, op_type), operands, result_shape,
      axis_env.split_leading_dims())
  return None if merged is None else [merged]


def _on_merged_dims(op_type, operands, result_shape):
  """The broadcasting op `op_type` on merged `operands`, of `result_shape`."""
  if op_type == "BroadcastTo":
    return tf.broadcast_to(operands[0], result_shape)
  names = _ARGUMENT_NAMES.get(op_type, ("x", "y"))
  return getattr(tf.raw_ops, op_type)(**dict(zip(names, operands)))


_ARGUMENT_NAMES = {"SelectV2": ("condition", "t", "e"), "Atan2": ("y", "x")}


BINARY = BROADCASTING - {"SelectV2", "BroadcastTo"}


@_do_not_convert
def convert_binary(op_inputs):
  """The converter of a binary broadcasting op (`converters`).

  pfor broadcasts a value the same on every position against a stacked
  one over the loop's dimension too; where that passes the kernels' rank,
  the op runs on merged dimensions.
  """
  default = tf_internal.default_pfor_converter(op_inputs.op.type)
  values = op_inputs.inputs()
  if not merged_dims.fully_defined(*[v.tensor for v in values]):
    return default(op_inputs)
  size = op_inputs.loop_size
  own_rank = max(v.tensor.shape.rank - v.stacked for v in values)
  shapes = []
  for value in values:
    shape = value.tensor.shape.as_list()
    own = shape[1:] if value.stacked else shape
    shapes.append([size if value.stacked else 1] +
                  [1] * (own_rank - len(own)) + own)
  result = [max(sizes) for sizes in zip(*shapes)]
  if len(result) + len(axis_env.frames()) <= merged_dims.MAX_KERNEL_RANK or (
      all(shape == result for shape in shapes)):
    return default(op_inputs)
  operands = [tf.reshape(v.tensor, shape) for v, shape in zip(values, shapes)]
  merged = merged_dims.broadcast_on_merged_dims(
      functools.partial(_on_merged_dims, op_inputs.op.type), operands, result,
      axis_env.split_leading_dims())
  if merged is None:
    return default(op_inputs)
  return [tf_internal.wrap_converted(merged, True)]


# Elementwise gradients of activations: their operands have one shape (no
# broadcasting), so pfor tiles an operand the same on every position to
# the stacked one's shape, at the full rank.
SAME_SHAPE_GRADIENTS = frozenset((
    "EluGrad", "LeakyReluGrad", "ReciprocalGrad", "Relu6Grad", "ReluGrad",
    "RsqrtGrad", "SeluGrad", "SigmoidGrad", "SoftplusGrad", "SoftsignGrad",
    "SqrtGrad", "TanhGrad"))


@_do_not_convert
def convert_same_shape_gradient(op_inputs):
  """The converter of an activation's gradient (`TanhGrad`, ...).

  Where an operand the same on every position would be tiled past the
  kernels' rank (DTensor moves the tile's result between layouts with
  slices of its rank), the op runs on the device's own dimensions merged
  into one, and the operand is tiled at that rank.
  """
  default = tf_internal.default_pfor_converter(op_inputs.op.type)
  values = op_inputs.inputs()
  if all(v.stacked for v in values) or not merged_dims.fully_defined(
      *[v.tensor for v in values]):
    return default(op_inputs)
  shape = next(v.tensor for v in values if v.stacked).shape.as_list()
  split = axis_env.split_leading_dims()
  if (len(shape) + len(axis_env.frames()) <= merged_dims.MAX_KERNEL_RANK or
      not 1 <= split < len(shape) - 1):
    return default(op_inputs)
  flat_shape = shape[:split] + [math.prod(shape[split:])]
  operands = []
  for value in values:
    if value.stacked:
      operands.append(tf.reshape(value.tensor, flat_shape))
    else:
      same = tf.reshape(value.tensor, [1] + flat_shape[1:])
      operands.append(tf.tile(same, [shape[0]] + [1] * split))
  return [tf_internal.wrap_converted(tf.reshape(result, shape), True)
          for result in tf_internal.recreate_op(op_inputs.op, operands)]


def _slice_of_each_dim(op_type, inputs, operation, shape):
  """Per input dimension: None (taken whole), an int (one index), or a slice.

  None if the slice's bounds are not constants.
  """
  if op_type == "Slice":
    begin, size = (static_values.value(t) for t in inputs[1:3])
    if begin is None or size is None:
      return None
    found = []
    for b, s, d in zip(begin, size, shape):
      stop = d if s == -1 else b + s
      found.append(None if (b, stop) == (0, d) else slice(int(b), int(stop)))
    return found
  begin, end, strides = (static_values.value(t) for t in inputs[1:4])
  if begin is None or end is None or strides is None:
    return None
  masks = {key: operation.get_attr(key) for key in (
      "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
      "shrink_axis_mask")}
  entries = len(begin)
  named = sum(1 for k in range(entries)
              if not (masks["ellipsis_mask"] >> k) & 1 and
              not (masks["new_axis_mask"] >> k) & 1)
  found = []
  for k in range(entries):
    if (masks["new_axis_mask"] >> k) & 1:
      continue
    if (masks["ellipsis_mask"] >> k) & 1:
      found += [None] * (len(shape) - named)
      continue
    if (masks["shrink_axis_mask"] >> k) & 1:
      index = int(begin[k])
      found.append(index + shape[len(found)] if index < 0 else index)
      continue
    size = shape[len(found)]
    taken = slice(None if (masks["begin_mask"] >> k) & 1 else int(begin[k]),
                  None if (masks["end_mask"] >> k) & 1 else int(end[k]),
                  int(strides[k]))
    whole = list(range(size)[taken]) == list(range(size))
    found.append(None if whole else taken)
  found += [None] * (len(shape) - len(found))
  return found


def _merged_spec(shape, per_dim):
  """`(shape, per-dimension slices)` with adjacent whole dimensions merged."""
  merged_shape, merged_slice = [], []
  split = axis_env.split_leading_dims()
  for dim, (size, taken) in enumerate(zip(shape, per_dim)):
    if (dim >= split and taken is None and merged_slice and
        merged_slice[-1] is None):
      merged_shape[-1] *= size
      continue
    merged_shape.append(size)
    merged_slice.append(taken)
  return merged_shape, merged_slice


def _merged_slice(op_type, inputs, outputs):
  value = inputs[0]
  if not merged_dims.fully_defined(value):
    return None
  shape = value.shape.as_list()
  per_dim = _slice_of_each_dim(op_type, inputs, outputs[0].op, shape)
  if per_dim is None:
    return None
  merged_shape, merged_slice = _merged_spec(shape, per_dim)
  if len(merged_shape) == len(shape):
    return None
  merged = tf.reshape(value, merged_shape)
  sliced = merged[tuple(slice(None) if t is None else t
                        for t in merged_slice)]
  return [tf.reshape(sliced, outputs[0].shape.as_list())]


def _merged_slice_gradient(inputs, outputs):
  """A strided slice's gradient on merged dimensions: `dy` put in zeros."""
  shape, dy = static_values.value(inputs[0]), inputs[4]
  if shape is None or not merged_dims.fully_defined(dy):
    return None
  shape = [int(d) for d in shape]
  per_dim = _slice_of_each_dim("StridedSlice", inputs, outputs[0].op, shape)
  if per_dim is None:
    return None
  merged_shape, merged_slice = _merged_spec(shape, per_dim)
  if len(merged_shape) == len(shape):
    return None
  begin, end, strides, sliced_shape = [], [], [], []
  masks = {"begin_mask": 0, "end_mask": 0, "shrink_axis_mask": 0}
  for k, (size, taken) in enumerate(zip(merged_shape, merged_slice)):
    if isinstance(taken, int):
      begin.append(taken)
      end.append(taken + 1)
      strides.append(1)
      masks["shrink_axis_mask"] |= 1 << k
      continue
    taken = taken or slice(None)
    begin.append(0 if taken.start is None else taken.start)
    end.append(0 if taken.stop is None else taken.stop)
    strides.append(1 if taken.step is None else taken.step)
    masks["begin_mask"] |= (taken.start is None) << k
    masks["end_mask"] |= (taken.stop is None) << k
    sliced_shape.append(len(range(size)[taken]))
  dtype = inputs[1].dtype
  gradient = tf.raw_ops.StridedSliceGrad(
      shape=tf.constant(merged_shape, dtype), begin=tf.constant(begin, dtype),
      end=tf.constant(end, dtype), strides=tf.constant(strides, dtype),
      dy=tf.reshape(dy, sliced_shape), **masks)
  return [tf.reshape(gradient, shape)]


def exceeds_kernel_rank(operation):
  """Whether a CPU kernel cannot run `operation` at its rank.

  Broadcasting ops whose operands all have the result's shape run at any
  rank; slices, pads, tiles and reversals do not above the limit.
  """
  if operation.type not in LIMITED or not operation.outputs:
    return False
  result = operation.outputs[0].shape
  ranks = [t.shape.rank for t in (operation.inputs[0], operation.outputs[0])]
  limit = (_SOFTMAX_RANK if operation.type in SOFTMAX else
           merged_dims.MAX_KERNEL_RANK)
  if None in ranks or max(ranks) <= limit:
    return False
  if operation.type in BROADCASTING and operation.type != "BroadcastTo":
    return not all(t.shape == result for t in operation.inputs)
  return True


def kernel_rank_error(operation, axis_name, mapped_axes):
  """The error for `operation`, of a rank no kernel takes, found by tracing."""
  rank = max(t.shape.rank for t in (operation.inputs[0],
                                    operation.outputs[0]))
  name = tf_internal.user_op_name(operation)
  return ValueError(
      f"the function mapped over axis {axis_name!r} computes the op "
      f"{operation.type} ({name}) on a tensor of rank {rank} once it is "
      f"vectorized: each of the {mapped_axes} mapped axes (mesh axes of size "
      f"1 included) adds a dimension to every tensor of the program, and "
      f"TensorFlow's CPU kernels of this op take at most "
      f"{_SOFTMAX_RANK if operation.type in SOFTMAX else merged_dims.MAX_KERNEL_RANK}. Dimensions it takes whole or "
      f"broadcasts alike are merged already; reshape the value to fewer "
      f"dimensions before the op (merging those it slices or broadcasts "
      f"differently), or map over fewer axes.")
