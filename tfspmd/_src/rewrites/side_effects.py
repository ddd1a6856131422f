"""tf.print and assertions inside the per-device program, as in a tf.function.

pfor vectorizes only what the outputs need, and XLA compiles neither a print
nor an assertion, so neither may stay in the program. Each side effect of
the per-device function (a `PrintV2`, an `Assert`, a `CheckNumerics`) is
converted instead into a `Record`: its numeric inputs, stacked over the
devices, become extra outputs of the program, with a mask of the devices
that reached it (those whose `tf.cond` branch holds it). After the run the
effect happens again from those values, device by device in device order:
a print prints each device's text to the stream `tf.print` was given, and a
failed check raises `tf.errors.InvalidArgumentError` with the user's message
and the failing device.

A nested pmap (or vmap) hands its records to the level around it through a
carrier op, which that level stacks once more: a record's tensors have one
leading axis per level, outermost first.
"""

import contextlib
import dataclasses

import numpy as np
import tensorflow as tf

from tfspmd._src.core import static_values
from tfspmd._src.core import tf_internal
from tfspmd._src.core import trace_context
from tfspmd._src.runtime import axis_env

# This thread's traces (`trace_context`).
_context = trace_context.this_thread

_do_not_convert = tf.autograph.experimental.do_not_convert

# The ops whose effect happens again outside the program.
EFFECT_TYPES = frozenset(("PrintV2", "Assert", "CheckNumerics",
                          "CheckNumericsV2"))

# A carrier op (a nested level's record in the enclosing per-device graph)
# holds its `Record` in this attribute.
_CARRIER_ATTRIBUTE = "_tfspmd_effect"
# Ops traced under `ignored()` hold this attribute.
_IGNORED_ATTRIBUTE = "_tfspmd_effect_ignored"


@dataclasses.dataclass
class Record:
  """One side effect of the per-device program, over all devices.

  Attributes:
    operation: The user's op (`PrintV2`, `Assert`, `CheckNumerics`).
    format_operation: The `StringFormat` op a `PrintV2` prints, or None.
    key: Sorts records in the order the user's program has them.
    mask: A bool tensor of the leading (device) axes: which devices reached
      the effect; None if all did.
    tensors: The stacked numeric inputs, each with the leading axes first.
    slots: For each input of the op that runs again (the `StringFormat`'s
      for a print): `("tensor", k)` for `tensors[k]`, `("static", value)`
      for a value known when tracing (the strings among them).
    lead_shape: The sizes of the leading (device) axes.
  """
  operation: object
  format_operation: object
  key: tuple
  mask: object
  tensors: list
  slots: list
  lead_shape: tuple


class _Recorder:
  """The records of one vectorization, and the branches being converted."""

  def __init__(self):
    self.records = []
    self.scopes = [(None, ())]


@contextlib.contextmanager
def recording():
  """Collects the records of the effects pfor converts inside the block."""
  recorder = _Recorder()
  _context.recorders.append(recorder)
  try:
    yield recorder.records
  finally:
    _context.recorders.pop()


@contextlib.contextmanager
def branch(mask, key):
  """Marks effects converted inside the block as reached where `mask` holds.

  Args:
    mask: A bool tensor, one per device of the axis being converted, or a
      scalar for all of them.
    key: Where the branch lies in the user's program (for the order).
  """
  recorder = _context.recorders[-1]
  outer_mask, outer_key = recorder.scopes[-1]
  if outer_mask is not None:
    mask = tf.logical_and(outer_mask, mask)
  recorder.scopes.append((mask, outer_key + key))
  try:
    yield
  finally:
    recorder.scopes.pop()


@contextlib.contextmanager
def ignored():
  """Effects of the ops traced inside the block do not happen.

  The gradient of a pmap traces the function again; its prints and checks
  happened in the forward run already.
  """
  graph = tf.compat.v1.get_default_graph()
  first = len(graph.get_operations())
  try:
    yield
  finally:
    for operation in graph.get_operations()[first:]:
      setattr(operation, _IGNORED_ATTRIBUTE, True)


def is_effect(operation):
  """Whether `operation` is itself a side effect that must happen."""
  return (not getattr(operation, _IGNORED_ATTRIBUTE, False) and
          (operation.type in EFFECT_TYPES or
           hasattr(operation, _CARRIER_ATTRIBUTE)))


def is_ignored(operation):
  return getattr(operation, _IGNORED_ATTRIBUTE, False)




def prepare(conversion, operations):
  """Keeps the strings an effect reads out of the vectorized program.

  They are read when tracing (`Record.slots`); pfor would copy them into
  the program, where DTensor has no layout for strings.
  """
  for operation in operations:
    if operation.type not in EFFECT_TYPES or is_ignored(operation):
      continue
    for tensor in operation.inputs:
      if tensor.dtype == tf.string:
        conversion.define(tensor, tf_internal.ConvertedValue(tensor, False))


def anchor(effect_operations, index):
  """A tensor whose conversion makes pfor convert `effect_operations`.

  pfor converts only what the outputs need: the anchor, an extra output of
  the per-device function, needs the effects.
  """
  with tf.control_dependencies(effect_operations):
    return tf.identity(index)


@_do_not_convert
def convert_effect(op_inputs):
  operation = op_inputs.op
  size = op_inputs.loop_size
  if operation.type == "Assert" and _passes_when_traced(operation):
    # Known to hold from the shapes (the checks of the global batch size
    # in `tf.nn.compute_average_loss`): nothing can fail, nothing to carry.
    return tf.no_op()
  format_operation = None
  sources = list(operation.inputs)
  if operation.type == "PrintV2" and sources[0].op.type == "StringFormat":
    format_operation = sources[0].op
    sources = list(format_operation.inputs)
  tensors, slots = [], []
  for position, tensor in enumerate(sources):
    if tensor.dtype == tf.string:
      slots.append(("static", _static_string(tensor, operation)))
      continue
    # An assertion's condition and a checked value always travel: the
    # checks after the run read them as `tensors[0]`.
    checked = position == 0 and format_operation is None
    known = None if checked else tf.get_static_value(tensor)
    if known is not None:
      # Nothing to carry out of the program for a constant.
      slots.append(("static", known))
      continue
    converted = tf_internal.convert_in_loop(op_inputs, tensor)
    slots.append(("tensor", len(tensors)))
    tensors.append(tf_internal.stacked(converted, size))
  _record(Record(operation=operation, format_operation=format_operation,
                 key=(operation._id,),  # pylint: disable=protected-access
                 mask=None, tensors=tensors, slots=slots, lead_shape=(size,)))
  if operation.type.startswith("CheckNumerics"):
    # The check happens after the run; the value passes through.
    return [tf_internal.wrap_converted(*op_inputs.input(0))]
  return tf.no_op()


def _passes_when_traced(operation):
  """Whether the condition of the Assert `operation` holds when tracing."""
  known = static_values.value(operation.inputs[0])
  return known is not None and bool(np.all(known))


def _static_string(tensor, operation):
  value = tf.get_static_value(tensor)
  if value is None:
    kind = "tf.print" if operation.type == "PrintV2" else "an assertion"
    raise ValueError(
        f"{kind} inside a mapped function is given a string tensor computed "
        f"while it runs ({tensor.name}); a mapped function's prints and "
        f"assertions take strings known when it is traced (Python strings, "
        f"tf.constant) and numeric tensors. Pass the numbers and put the "
        f"text in the message, or run the pmap with debug=True.")
  # A scalar string comes back as a 0-d array of bytes.
  return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value


def _record(record):
  """Adds `record` to the recording, masked by the branches around it."""
  recorder = _context.recorders[-1]
  mask, key = recorder.scopes[-1]
  if mask is not None:
    lead_shape = record.lead_shape
    # A predicate the same on every device reaches all or none of them.
    mask = tf.logical_and(tf.ones(lead_shape[:1], tf.bool), mask)
    mask = tf.broadcast_to(
        tf.reshape(mask, lead_shape[:1] + (1,) * (len(lead_shape) - 1)),
        lead_shape)
    if record.mask is not None:
      mask = tf.logical_and(mask, record.mask)
    record.mask = mask
  record.key = key + record.key
  recorder.records.append(record)


def hand_outward(records):
  """Gives `records` of a nested level to the level around it, if any.

  Returns:
    The records the caller must make happen itself: `records` when no
    vectorized level encloses this one, else none.
  """
  frames = axis_env.frames()
  if not records or not frames or frames[-1].run_collective is not None:
    return records
  index = frames[-1].index
  for record in records:
    inputs = list(record.tensors)
    if record.mask is not None:
      inputs.append(record.mask)
    carrier = tf.raw_ops.IdentityN(input=inputs + [index])[0].op
    setattr(carrier, _CARRIER_ATTRIBUTE, record)
    tf_internal.set_pfor_converter(carrier, _convert_carrier)
  return []


@_do_not_convert
def _convert_carrier(op_inputs):
  inner = getattr(op_inputs.op, _CARRIER_ATTRIBUTE)
  size = op_inputs.loop_size
  count = len(inner.tensors)
  stacked = [op_inputs.stacked_input(k)
             for k in range(op_inputs.num_inputs - 1)]
  record = dataclasses.replace(
      inner, tensors=stacked[:count],
      mask=stacked[count] if inner.mask is not None else None,
      key=(op_inputs.op._id,) + inner.key,  # pylint: disable=protected-access
      lead_shape=(size,) + inner.lead_shape)
  _record(record)
  return [tf_internal.wrap_converted(*value) for value in op_inputs.inputs()]


def _device_name(position):
  return str(position[0]) if len(position) == 1 else str(position)


def _inputs_of(record, values, position):
  """The inputs the effect's op (or its StringFormat) takes on one device."""
  return [value if kind == "static" else values[value][position]
          for kind, value in record.slots]


def replay_on_host(records, values, axis_name):
  """Makes the effects of `records` happen, from their values after a run.

  Args:
    records: The program's `Record`s, in the user's order.
    values: For each record, `(mask, tensors)`: arrays NumPy can read (mask
      None where every device reached it). An assertion's data is read
      only where it failed.
    axis_name: The pmap's axis name, for messages.

  Raises:
    tf.errors.InvalidArgumentError: A check failed on a device.
  """
  for record, (mask, tensors) in zip(records, values):
    mask = None if mask is None else np.asarray(mask)
    if record.operation.type == "Assert":
      holds = np.asarray(tensors[0])
      if mask is not None:
        holds = holds | ~mask
      if holds.all():
        continue
    tensors = [np.asarray(value) for value in tensors]
    for position in np.ndindex(*record.lead_shape):
      if mask is not None and not mask[position]:
        continue
      inputs = _inputs_of(record, tensors, position)
      _happen(record, inputs, position, axis_name)


def _happen(record, inputs, position, axis_name):
  operation = record.operation
  if operation.type == "PrintV2":
    text = inputs[0] if record.format_operation is None else (
        tf_internal.recreate_op_eagerly(record.format_operation, inputs)[0])
    tf_internal.recreate_op_eagerly(operation, [text])
    return
  if operation.type == "Assert":
    failure = None if np.all(inputs[0]) else _assert_message(
        inputs[1:], operation.get_attr("summarize"))
  else:
    failure = _check_numerics_message(inputs[0],
                                      operation.get_attr("message"))
  if failure is not None:
    raise tf.errors.InvalidArgumentError(None, None, (
        f"{failure} (on device {_device_name(position)} of the function "
        f"mapped over axis {axis_name!r})"))


def _assert_message(data, summarize):
  """The message of TensorFlow's Assert kernel for `data`."""
  parts = []
  for value in data:
    if isinstance(value, bytes):
      parts.append(f"[{value.decode(errors='replace')}]")
      continue
    # tf.strings.format brackets arrays as the kernel does; not scalars.
    text = tf.strings.format("{}", tf.constant(value),
                             summarize=summarize).numpy().decode()
    parts.append(f"[{text}]" if np.ndim(value) == 0 else text)
  return "assertion failed: " + " ".join(parts)


def _check_numerics_message(value, message):
  """The message of TensorFlow's CheckNumerics kernel, or None if it passes."""
  problems = [name for name, found in (("Inf", np.isinf(value).any()),
                                       ("NaN", np.isnan(value).any()))
              if found]
  if not problems:
    return None
  if isinstance(message, bytes):
    message = message.decode(errors="replace")
  return f"{message} : Tensor had {' and '.join(problems)} values"


def replay_in_graph(records, values=None):
  """Makes the effects of `records` part of the graph being traced.

  For a program traced into a user's graph (a pmap or vmap inside the
  user's `tf.function`), whose ops run as the graph runs.

  Args:
    records: The `Record`s, in the user's order.
    values: For each record, `(mask, tensors)` in the graph being traced;
      None: the records' own.
  """
  if values is None:
    values = [(record.mask, record.tensors) for record in records]
  for record, (mask, tensors) in zip(records, values):
    lead = len(record.lead_shape)
    tensors = [_flatten_lead(t, lead) for t in tensors]
    mask = None if mask is None else _flatten_lead(mask, lead)
    operation = record.operation
    if operation.type == "PrintV2":
      _print_in_graph(record, tensors, mask)
      continue
    if operation.type.startswith("CheckNumerics"):
      checked = tensors[0]
      if mask is not None:
        checked = tf.where(_broadcast_mask(mask, checked), checked,
                           tf.zeros_like(checked))
      tf_internal.recreate_op(operation, [checked])
      continue
    holds = tensors[0]
    if mask is not None:
      holds = tf.logical_or(tf.logical_not(mask), holds)
    first_failure = tf.argmin(tf.cast(holds, tf.int32), output_type=tf.int32)
    inputs = [tf.reduce_all(holds)] + [
        tf.constant(value) if kind == "static" else
        tf.gather(tensors[value], first_failure)
        for kind, value in record.slots[1:]]
    tf_internal.recreate_op(operation, inputs)


def _print_in_graph(record, tensors, mask):
  for device in range(int(np.prod(record.lead_shape))):
    def emit(device=device):
      inputs = [tf.constant(value) if kind == "static" else
                tensors[value][device] for kind, value in record.slots]
      text = (inputs[0] if record.format_operation is None else
              tf_internal.recreate_op(record.format_operation, inputs)[0])
      tf_internal.recreate_op(record.operation, [text])
      return tf.constant(0)
    if mask is None:
      emit()
    else:
      tf.cond(mask[device], emit, lambda: tf.constant(0))


def _flatten_lead(tensor, lead):
  shape = tf.shape(tensor)
  return tf.reshape(tensor, tf.concat([[-1], shape[lead:]], 0))


def _broadcast_mask(mask, value):
  shape = [-1] + [1] * (value.shape.rank - 1)
  return tf.broadcast_to(tf.reshape(mask, shape), tf.shape(value))


def while_loop_error(construct, axis_name):
  return ValueError(
      f"tf.print or a tf.debugging assertion inside a {construct} in the "
      f"function mapped over axis {axis_name!r}: its effects cannot leave the "
      f"compiled loop. Move the print or assertion out of the loop (print or "
      f"check the values the loop returns), or run the pmap with debug=True, "
      f"where every device runs its loop eagerly.")


def steps_error(steps):
  return ValueError(
      f"tf.print or a tf.debugging assertion inside a pmap with "
      f"steps={steps}: its effects cannot leave the compiled loop over the "
      f"steps. Return the values to print or check from the step (as a "
      f"per-step output), or run the pmap without steps= or with "
      f"debug=True.")
