"""The route of last resort for an op pfor cannot map: one copy per position.

pfor vectorizes an op only through a converter written for its type, and
some converters need an input to be the same on every position (the begin
of a `StridedSlice`, the indices of a `ScatterNd`). For any other op, or
input that differs between positions, the converter here makes one copy of
the op per position of the mapped axis, on that position's inputs (a
`tf.gather` of the stacked ones), and stacks their results. Every device
then computes the op for every position and keeps its own row: right for
any op with a kernel, at the cost of `n` times the op's work and of
gathering its inputs onto every device. docs/ops.md lists the ops that take
this route.

The stacked result must have one static shape: an op whose output size
depends on the data it is given (`tf.unique`, `tf.where(condition)`) is an
error here, as it is under jit.
"""

import tensorflow as tf

from tfspmd._src.core import route_log
from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal

_do_not_convert = tf.autograph.experimental.do_not_convert

def give_fallback(operation):
  """Makes `operation` take this route when pfor cannot map it.

  An op whose type pfor has a converter for keeps it, and takes this route
  only if that converter refuses an input that differs between positions.
  A stateful op is left alone: computing it once per position would repeat
  its effect.
  """
  if operation.op_def.is_stateful:
    return
  if tf_internal.has_default_pfor_converter(operation.type):
    tf_internal.set_pfor_converter(operation, default_or_per_position)
  else:
    tf_internal.set_pfor_converter(operation, convert)


@_do_not_convert
def default_or_per_position(op_inputs):
  """pfor's converter, or this route where it refuses an input or has none."""
  if not tf_internal.has_default_pfor_converter(op_inputs.op.type):
    return convert(op_inputs)
  try:
    return tf_internal.default_pfor_converter(op_inputs.op.type)(op_inputs)
  except Exception as e:  # pylint: disable=broad-except
    if not tf_internal.refuses_input(e):
      raise
  return convert(op_inputs)


@_do_not_convert
def convert(op_inputs):
  """A pfor converter: the op once per position, the results stacked."""
  operation = op_inputs.op
  _check_stackable(operation)
  route_log.record(route_log.PER_POSITION, operation.type)
  size = op_inputs.loop_size
  values = op_inputs.inputs()
  # An output size computed from the data but bounded to one value (the
  # size of tf.math.bincount with minlength == maxlength) is that value.
  values = [_known_value(value, original)
            for value, original in zip(values, operation.inputs)]
  per_position = []
  for k in range(size):
    inputs = [_at_position(v, k) for v in values]
    outputs = tf_internal.recreate_op(operation, inputs)
    for output, first in zip(outputs, per_position[0] if per_position else
                             outputs):
      if not output.shape.is_fully_defined():
        raise _data_dependent_error(operation, output.shape)
      if output.shape != first.shape:
        raise _data_dependent_error(operation, operation.outputs[0].shape)
    per_position.append(outputs)
  return [tf_internal.wrap_converted(stack(outputs), True)
          for outputs in zip(*per_position)]


def _at_position(value, position):
  """The input of the op's copy at `position`.

  An integer input known when tracing (offsets or sizes computed from
  `axis_index`) enters as a constant: DTensor's expansion of an op whose
  sizes come from such an input reads only constants, and gives a wrong
  shape otherwise (a strided slice, TF 2.21).
  """
  if not value.stacked:
    return value.tensor
  if value.tensor.dtype.is_integer:
    known = tf.get_static_value(value.tensor)
    if known is not None:
      return tf.constant(known[position], value.tensor.dtype)
  return tf.gather(value.tensor, position)


def _known_value(value, original):
  """`value`, or the constant `original` always equals if bounds pin it."""
  if not value.stacked or not original.dtype.is_integer:
    return value
  low, high = static_values.bounds(original)
  if low is None or low != high:
    return value
  return tf_internal.ConvertedValue(
      tf.constant(low, original.dtype, shape=original.shape), False)


def _check_stackable(operation):
  for output in operation.outputs:
    if output.dtype in (tf.resource, tf.variant, tf.string):
      raise ValueError(
          f"the op {operation.type} ({tf_internal.user_op_name(operation)}) gets inputs "
          f"that differ between devices, and TensorFlow's vectorizer (pfor) "
          f"cannot map it over the mapped axis; tfspmd computes such an op "
          f"once per device and stacks the results, which it cannot do for "
          f"its {output.dtype.name} output. Compute it outside the mapped "
          f"function, or with ops on numeric tensors.")


def _data_dependent_error(operation, shape):
  return ValueError(
      f"the op {operation.type} ({tf_internal.user_op_name(operation)}) gets inputs that "
      f"differ between devices and gives a result of shape {shape}, whose "
      f"size depends on those inputs. A mapped function needs the same "
      f"static shapes on every device, as under jax.pmap: give the op a "
      f"fixed size (minlength and maxlength of tf.math.bincount, "
      f"tf.math.unsorted_segment_sum with num_segments instead of "
      f"segment_sum, tf.slice with a static size), or keep the full size "
      f"and mask (tf.where(condition, x, 0) instead of tf.boolean_mask or "
      f"tf.unique).")




def stack(values):
  """`tf.stack(values)` in ops DTensor expands right.

  DTensor's expansion of Pack (TF 2.21) with replicated inputs and an
  output split along the new axis keeps every row on every device (the
  program then fails its layout check), and it refuses a Concat along a
  split axis. A sum of each value placed in its own row by a one-hot mask
  expands right; it is exact, each element being one value plus zeros.
  """
  count = len(values)
  dtype = values[0].dtype
  exact = dtype if (dtype.is_floating or dtype.is_complex) else tf.int64
  total = None
  for k, value in enumerate(values):
    row = tf.reshape(tf.one_hot(k, count, dtype=exact),
                     [count] + [1] * value.shape.rank)
    term = row * tf.expand_dims(tf.cast(value, exact), 0)
    total = term if total is None else total + term
  return tf.cast(total, dtype)
