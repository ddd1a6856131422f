"""pfor converters that write ops pfor or DTensor cannot handle with ops they can.

DTensor (TF 2.21) has no layout propagation for `ReverseV2`, `Roll`,
`ArgMin`, `MatrixBandPart` and `MatrixDiagPartV3`, and refuses an `Einsum`
whose equation has an ellipsis ("Broadcasting is unimplemented for
einsum"). Each has a static equivalent once the per-device shapes are
known: a reverse or a roll is a gather of permuted positions, an argmin the
argmax of the negated value, a band a mask, a diagonal a gather, and an
ellipsis stands for as many explicit axis letters as the operands' ranks
leave (a size-1 axis it broadcasts, a letter summed over), and a roll by a shift that differs between devices a gather of
each device's own positions. pfor's own converter of a depthwise
convolution needs a per-device filter; with a filter the same everywhere,
the devices fold into the batch, and so they do for the image resizes pfor
has no converter for. pfor has none for `L2Loss` either: half the sum of
squares. A variable read in a loop or a branch is made once before it (a
read and a collective in one loop share a rendezvous). An IdentityN in a
loop's body (a `tf.custom_gradient`'s) becomes
one Identity per value, which DTensor keeps with its value. And TensorFlow's CPU kernel of `SelectV2` (`tf.where`) refuses
results of rank 9 or more ("Broadcast between ... is not supported yet",
even between operands of one shape), which a per-device rank of 8 reaches
once stacked over the devices: there the operands are broadcast to the
result's shape and `Select` picks. A select with a scalar condition on
operands that are the same on every device crashes the process in DTensor's
layout propagation, and so does a `ScatterNd` with int64 indices; pfor
copies such ops as they are, with no converter, so they are rewritten as
the per-device function traces (`rewriting_traced_ops`).
"""

import contextlib
import string

import tensorflow as tf

from tfspmd._src.core import stacking
from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal
from tfspmd._src.core import trace_context
from tfspmd._src.rewrites import rank_limits
from tfspmd._src.rewrites import static_segments

_do_not_convert = tf.autograph.experimental.do_not_convert


def einsum_applies(operation):
  """Whether an Einsum takes this module's route: one with broadcast `...`."""
  return b"..." in operation.get_attr("equation")


@contextlib.contextmanager
def rewriting_traced_ops():
  """Within, ops DTensor mishandles are rewritten as they are traced.

  pfor copies an op whose inputs are the same on every device as it is,
  with no converter, so these are rewritten before pfor sees them (an op
  callback): a select with a scalar condition gets a full one, the
  scatters take int32 indices, an einsum's ellipsis is written out, sorted segment reductions over constant
  ids get their static size and transposes their permutation as a
  constant (`_REWRITES`); slices and broadcasts that the mapped axes would
  take past rank 8 run on merged dimensions (`rank_limits`). Nested pmaps
  trace within their enclosing one's: the rewrite is installed once, by
  the outermost.
  """
  context = trace_context.this_thread
  if context.rewriting_ops:
    yield
    return
  context.rewriting_ops = True
  try:
    with tf_internal.op_callback(_rewritten_op):
      yield
  finally:
    context.rewriting_ops = False


def _rewritten_op(op_type, inputs, attrs, outputs, op_name=None, graph=None):
  """An op callback: the outputs of the rewritten op, or None to keep it."""
  del attrs, graph
  if tf.executing_eagerly():
    return None
  rewrite = _REWRITES.get(op_type)
  rewritten = (None if rewrite is None else
               rewrite(op_type, inputs, outputs, op_name))
  if rewritten is None and op_type in rank_limits.REWRITTEN:
    rewritten = rank_limits.rewrite(op_type, inputs, outputs)
  return rewritten


def _full_condition_select(op_type, inputs, outputs, name):
  """A `Select` or `SelectV2` with a scalar condition, as one of a full one.

  DTensor's layout propagation crashes the process on the scalar condition
  (TF 2.21).
  """
  del op_type
  condition, on_true, on_false = inputs
  shape = outputs[0].shape
  if condition.shape.rank != 0 or shape.rank in (0, None):
    return None
  if shape.is_fully_defined():
    target = shape.as_list()
  else:
    target = tf.broadcast_dynamic_shape(tf.shape(on_true), tf.shape(on_false))
  return [tf.raw_ops.SelectV2(condition=tf.broadcast_to(condition, target),
                              t=on_true, e=on_false, name=name)]


_INT32_LIMIT = 2**31 - 1


def _int32_indices(op_type, inputs, outputs, name):
  """A scatter with int64 indices, as one with int32 indices.

  DTensor's expansion of `ScatterNd` with int64 indices aborts the process
  or fails as it runs, and pfor's converter of `TensorScatterUpdate` mixes
  int32 and int64 (TF 2.21). Sizes that fit in int32 lose nothing.
  """
  shape = outputs[0].shape
  if inputs[1 if op_type != "ScatterNd" else 0].dtype != tf.int64 or not (
      shape.is_fully_defined() and max(shape.as_list(), default=0) <=
      _INT32_LIMIT):
    return None
  if op_type == "ScatterNd":
    indices, updates, size = inputs
    return [tf.raw_ops.ScatterNd(
        indices=tf.cast(indices, tf.int32), updates=updates,
        shape=tf.cast(size, tf.int32), name=name)]
  tensor, indices, updates = inputs
  return [getattr(tf.raw_ops, op_type)(
      tensor=tensor, indices=tf.cast(indices, tf.int32), updates=updates,
      name=name)]


def _constant_permutation(op_type, inputs, outputs, name):
  """A transpose whose permutation is computed from shapes, with it constant.

  DTensor lays out a Transpose only with a constant permutation ("failed to
  extract constant value", TF 2.21); softmax's gradient on an inner axis
  computes it from the rank.
  """
  del op_type, outputs
  value, permutation = inputs
  if permutation.op.type == "Const":
    return None
  known = static_values.value(permutation)
  if known is None:
    return None
  return [tf.transpose(value, known.tolist(), name=name)]


def _read_before_control_flow(op_type, inputs, outputs, name):
  """A variable's read in a loop or a branch, as one read before it.

  Under `jit_compile` a loop stays a functional While, and every iteration's
  collective then shares one rendezvous with a variable read in it ("
  BufRendezvous::ProvideBuf already called", or a hang; TF 2.21). A
  variable keeps its value while a program runs (tfspmd refuses writes to
  it there), so the read moves out to the per-device program. Under a
  GradientTape the read stays where it is, where the tape watches it.
  """
  del op_type, name
  if tf_internal.tape_active():
    return None
  outside = tf_internal.outside_control_flow(inputs[0])
  if outside is None:
    return None
  graph, handle = outside
  with graph.as_default():
    return [tf.raw_ops.ReadVariableOp(resource=handle,
                                      dtype=outputs[0].dtype)]


def _explicit_einsum(op_type, inputs, outputs, name):
  """An `Einsum` with an ellipsis, as one with the axis letters written out.

  DTensor refuses an ellipsis ("Broadcasting is unimplemented for einsum",
  TF 2.21); pfor copies an einsum of values the same on every device as it
  is, so its converter (`_convert_einsum`) never sees it.
  """
  del op_type
  equation = outputs[0].op.get_attr("equation").decode()
  shapes = [value.shape for value in inputs]
  if ("..." not in equation or "->" not in equation or
      None in [shape.rank for shape in shapes]):
    return None
  explicit = explicit_equation(equation, shapes)
  if explicit is None:
    return None
  return [tf.raw_ops.Einsum(inputs=inputs, equation=explicit, name=name)]


_REWRITES = {
    "Einsum": _explicit_einsum,
    "ReadVariableOp": _read_before_control_flow,
    "Transpose": _constant_permutation,
    "Select": _full_condition_select,
    "SelectV2": _full_condition_select,
    "ScatterNd": _int32_indices,
    "TensorScatterUpdate": _int32_indices,
    "TensorScatterAdd": _int32_indices,
    "TensorScatterSub": _int32_indices,
    "TensorScatterMax": _int32_indices,
    "TensorScatterMin": _int32_indices,
}
_REWRITES.update(dict.fromkeys(static_segments.SEGMENT_TYPES,
                               static_segments.rewrite))


@_do_not_convert
def _convert_reverse(op_inputs):
  value, stacked = op_inputs.input(0)
  axes = tf.get_static_value(op_inputs.unstacked_input(1))
  rank = op_inputs.op.inputs[0].shape.rank
  if axes is None or rank is None or not value.shape.is_fully_defined():
    return tf_internal.default_pfor_converter("ReverseV2")(op_inputs)
  offset = 1 if stacked else 0
  for axis in {int(a) % rank for a in axes.reshape(-1)}:
    length = value.shape[axis + offset]
    value = tf.gather(value, tf.range(length - 1, -1, -1), axis=axis + offset)
  return [tf_internal.wrap_converted(value, stacked)]


def explicit_equation(equation, shapes):
  """`equation` with each `...` replaced by the axis letters it stands for.

  The ellipsis broadcasts as NumPy's does: an operand whose ellipsis covers
  fewer axes than another's takes the last letters (TensorFlow's einsum
  gradient writes `...` into an operand that covers none), and an axis of
  size 1 that broadcasts against a longer one takes a letter of its own,
  which the einsum sums over: a sum of one element, the element itself.

  Args:
    equation: An einsum equation with an explicit output (`->`).
    shapes: The static shape of each operand (`tf.TensorShape`s).

  Returns:
    The equation without ellipses, or None where a broadcasting axis's size
    is not known.

  >>> explicit_equation('...d,...d->...', [[2, 3, 4], [2, 3, 4]])
  'abd,abd->ab'
  >>> explicit_equation('...v,vd...->...d', [[4, 3, 8], [8, 2]])
  'abv,vd->abd'
  """
  inputs, output = equation.replace(" ", "").split("->")
  terms = inputs.split(",")
  unused = iter(c for c in string.ascii_letters if c not in equation)
  ellipses = {}  # operand -> the sizes its ellipsis covers
  for k, (term, shape) in enumerate(zip(terms, shapes)):
    if "..." in term:
      shape = list(tf.TensorShape(shape))
      count = len(shape) - len(term.replace("...", ""))
      ellipses[k] = shape[term.index("..."):][:count]
  width = max(len(sizes) for sizes in ellipses.values())
  letters = [next(unused) for _ in range(width)]
  broadcast = [1] * width
  for sizes in ellipses.values():
    for position, size in enumerate(sizes, width - len(sizes)):
      if size is None:
        if len({len(s) for s in ellipses.values()}) > 1:
          return None
        broadcast[position] = None
      elif size != 1 and broadcast[position] is not None:
        broadcast[position] = size
  for k, sizes in ellipses.items():
    own = "".join(
        next(unused) if size == 1 and broadcast[position] not in (1, None)
        else letters[position]
        for position, size in enumerate(sizes, width - len(sizes)))
    terms[k] = terms[k].replace("...", own)
  return ",".join(terms) + "->" + output.replace("...", "".join(letters))


@_do_not_convert
def _convert_einsum(op_inputs):
  equation = op_inputs.op.get_attr("equation").decode()
  shapes = [t.shape for t in op_inputs.op.inputs]
  explicit = None
  if "->" in equation and None not in [s.rank for s in shapes]:
    explicit = explicit_equation(equation, shapes)
  if explicit is None:
    raise ValueError(
        f"tf.einsum({equation!r}) in a mapped function: DTensor (TF 2.21) "
        f"cannot place an einsum with an ellipsis, and tfspmd writes the "
        f"ellipsis out only where the operands' ranks and the sizes of the "
        f"axes it broadcasts are known and the output is given with '->'. "
        f"Write the axes out, or give the operands static shapes.")
  batch = next(c for c in string.ascii_letters if c not in explicit)
  inputs, output = explicit.split("->")
  terms = inputs.split(",")
  values = []
  for k, term in enumerate(terms):
    value, stacked = op_inputs.input(k)
    if stacked:
      terms[k] = batch + term
    values.append(value)
  result = tf.einsum(",".join(terms) + "->" + batch + output, *values)
  return [tf_internal.wrap_converted(result, True)]


def _static_shapes(op_inputs):
  value, stacked = op_inputs.input(0)
  return value, stacked, value.shape.is_fully_defined()


@_do_not_convert
def _convert_roll(op_inputs):
  value, stacked, known = _static_shapes(op_inputs)
  if op_inputs.input(1).stacked:
    return _convert_roll_by_device(op_inputs)
  # The gradient of a roll shifts by -shift: known when shift is.
  shifts = static_values.value(op_inputs.unstacked_input(1))
  axes = static_values.value(op_inputs.unstacked_input(2))
  if not known or shifts is None or axes is None:
    return tf_internal.default_pfor_converter("Roll")(op_inputs)
  rank = op_inputs.op.inputs[0].shape.rank
  offset = 1 if stacked else 0
  shift_by_axis = {}
  for shift, axis in zip(shifts.reshape(-1), axes.reshape(-1)):
    axis = int(axis) % rank
    shift_by_axis[axis] = shift_by_axis.get(axis, 0) + int(shift)
  for axis, shift in shift_by_axis.items():
    length = value.shape[axis + offset]
    positions = [(k - shift) % length for k in range(length)]
    value = tf.gather(value, positions, axis=axis + offset)
  return [tf_internal.wrap_converted(value, stacked)]


def _convert_roll_by_device(op_inputs):
  """A roll whose shift differs between devices: a gather of each row."""
  value = op_inputs.stacked_input(0)
  shifts = op_inputs.stacked_input(1)
  axes = tf.get_static_value(op_inputs.unstacked_input(2))
  rank = op_inputs.op.inputs[0].shape.rank
  if (axes is None or rank is None or
      not value.shape[1:].is_fully_defined()):
    raise ValueError(
        f"tf.roll ({op_inputs.op.name.split('/pfor/')[0]}) with a shift "
        f"that differs between devices: tfspmd maps it only with static "
        f"axes and a value of static shape.")
  shifts = tf.reshape(shifts, [value.shape[0], -1])
  for k, axis in enumerate(axes.reshape(-1)):
    axis = int(axis) % rank
    length = value.shape[axis + 1]
    positions = (tf.range(length)[None, :] -
                 tf.cast(shifts[:, k:k + 1], tf.int32)) % length
    value = tf.gather(value, positions, axis=axis + 1, batch_dims=1)
  return [tf_internal.wrap_converted(value, True)]


@_do_not_convert
def _convert_argmin(op_inputs):
  value, stacked = op_inputs.input(0)
  if not (value.dtype.is_floating or (value.dtype.is_integer and
                                      not value.dtype.is_unsigned)):
    return tf_internal.default_pfor_converter("ArgMin")(op_inputs)
  axis = op_inputs.unstacked_input(1)
  rank = op_inputs.op.inputs[0].shape.rank
  if stacked:
    axis = tf.where(axis < 0, axis + rank, axis) + 1
  # -x reverses the order, ties keep the first position; for integers -min
  # overflows, so compare against the maximum instead.
  flipped = -value if value.dtype.is_floating else value.dtype.max - value
  result = tf.math.argmax(flipped, axis=axis,
                          output_type=op_inputs.get_attr("output_type"))
  return [tf_internal.wrap_converted(result, stacked)]


@_do_not_convert
def _convert_band_part(op_inputs):
  value, stacked, known = _static_shapes(op_inputs)
  lower = tf.get_static_value(op_inputs.unstacked_input(1))
  upper = tf.get_static_value(op_inputs.unstacked_input(2))
  if not known or lower is None or upper is None:
    return tf_internal.default_pfor_converter("MatrixBandPart")(op_inputs)
  rows, columns = value.shape[-2:]
  row = tf.range(rows)[:, None]
  column = tf.range(columns)[None, :]
  keep = tf.ones([rows, columns], tf.bool)
  if lower >= 0:
    keep = tf.logical_and(keep, row - column <= int(lower))
  if upper >= 0:
    keep = tf.logical_and(keep, column - row <= int(upper))
  result = select(keep, value, tf.zeros_like(value))
  return [tf_internal.wrap_converted(result, stacked)]


@_do_not_convert
def _convert_diag_part(op_inputs):
  value, stacked, known = _static_shapes(op_inputs)
  k = tf.get_static_value(op_inputs.unstacked_input(1))
  if not known or k is None or k.size != 1 or int(k) != 0:
    return tf_internal.default_pfor_converter("MatrixDiagPartV3")(op_inputs)
  rows, columns = value.shape[-2:]
  length = min(rows, columns)
  matrices = tf.reshape(value, [-1, rows * columns])
  diagonal = tf.gather(matrices, [d * columns + d for d in range(length)],
                       axis=1)
  result = tf.reshape(diagonal, value.shape[:-2].as_list() + [length])
  return [tf_internal.wrap_converted(result, stacked)]


@_do_not_convert
def _convert_depthwise(op_inputs):
  _, stacked, known = _static_shapes(op_inputs)
  if (op_inputs.input(1).stacked or not stacked or not known or
      op_inputs.get_attr("data_format") != b"NHWC"):
    return tf_internal.default_pfor_converter("DepthwiseConv2dNative")(
        op_inputs)
  return _on_folded_batch(op_inputs)


@_do_not_convert
def _convert_batch_folded(op_inputs):
  """An op on a batch of images, the devices folded into the batch."""
  _, stacked, known = _static_shapes(op_inputs)
  if not stacked or not known or any(
      op_inputs.input(k).stacked for k in range(1, op_inputs.num_inputs)):
    raise ValueError(
        f"the function mapped over the axis gives {op_inputs.op.type} "
        f"arguments other than the images that differ between devices; "
        f"tfspmd maps it only over images of a static shape, with the same "
        f"size and options on every device.")
  return _on_folded_batch(op_inputs)


def _on_folded_batch(op_inputs):
  """The op on its first input with the devices folded into its batch.

  The first input is stacked and of static shape; the others are the same
  on every device.
  """
  value = op_inputs.stacked_input(0)
  shape = value.shape.as_list()
  folded = tf.reshape(value, [shape[0] * shape[1]] + shape[2:])
  others = [op_inputs.unstacked_input(k)
            for k in range(1, op_inputs.num_inputs)]
  result = tf_internal.recreate_op(op_inputs.op, [folded] + others)[0]
  result = tf.reshape(result, shape[:2] + result.shape.as_list()[1:])
  return [tf_internal.wrap_converted(result, True)]


@_do_not_convert
def _convert_l2_loss(op_inputs):
  value = op_inputs.stacked_input(0)
  half_sum = tf.reduce_sum(tf.square(value),
                           axis=list(range(1, value.shape.rank))) / 2
  return [tf_internal.wrap_converted(half_sum, True)]


def identity_n_applies(operation):
  """Whether an IdentityN takes this module's route: one in a loop's body.

  DTensor (TF 2.21) may place a vectorized IdentityN of a loop's body (a
  `tf.custom_gradient`'s, as `tf.nn.silu`'s) apart from the values it
  passes on ("operand #0 does not dominate this use"); one Identity per
  value stays with its value. Elsewhere IdentityN keeps pfor's converter,
  under which DTensor lays out some collectives' custom gradients that
  separate identities would not. tfspmd's markers carry their converter.
  """
  return (not hasattr(operation, "pfor_converter") and
          tf_internal.in_loop_body(operation))


@_do_not_convert
def _convert_identity_n(op_inputs):
  return [tf_internal.wrap_converted(tf.identity(value), stacked)
          for value, stacked in (op_inputs.input(k)
                                 for k in range(op_inputs.num_inputs))]


# The highest rank SelectV2's CPU kernel takes (TF 2.21).
_SELECT_V2_MAX_RANK = 8


def select(condition, on_true, on_false):
  """`tf.where(condition, on_true, on_false)` at any rank.

  Above the rank SelectV2 takes, the operands are broadcast to the result's
  shape and `Select`, which takes operands of one shape at any rank, picks.
  """
  shape = tf.broadcast_static_shape(
      condition.shape,
      tf.broadcast_static_shape(on_true.shape, on_false.shape))
  if shape.rank is None or shape.rank <= _SELECT_V2_MAX_RANK or (
      not shape.is_fully_defined()):
    return tf.where(condition, on_true, on_false)
  full = shape.as_list()
  operands = [value if value.shape == shape else
              stacking.broadcast(value, full)
              for value in (condition, on_true, on_false)]
  return tf.raw_ops.Select(condition=operands[0], x=operands[1],
                           y=operands[2])


@_do_not_convert
def _convert_select(op_inputs):
  operation = op_inputs.op
  rank = operation.outputs[0].shape.rank
  if rank is None or rank + 1 <= _SELECT_V2_MAX_RANK or (
      operation.type == "Select" and operation.inputs[0].shape.rank != rank):
    return tf_internal.default_pfor_converter(operation.type)(op_inputs)
  condition, on_true, on_false = op_inputs.broadcast_inputs()
  return [tf_internal.wrap_converted(select(condition, on_true, on_false),
                                     True)]


CONVERTERS = {
    "ArgMin": _convert_argmin,
    "L2Loss": _convert_l2_loss,
    "ResizeArea": _convert_batch_folded,
    "ResizeBicubic": _convert_batch_folded,
    "ResizeBilinear": _convert_batch_folded,
    "ResizeNearestNeighbor": _convert_batch_folded,
    "DepthwiseConv2dNative": _convert_depthwise,
    "Einsum": _convert_einsum,
    "IdentityN": _convert_identity_n,
    "MatrixBandPart": _convert_band_part,
    "MatrixDiagPartV3": _convert_diag_part,
    "ReverseV2": _convert_reverse,
    "Roll": _convert_roll,
    "Select": _convert_select,
    "SelectV2": _convert_select,
}
