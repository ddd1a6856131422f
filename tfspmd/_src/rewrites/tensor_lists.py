"""TensorArrays in the per-device program, carried as dense tensors.

`tf.scan`, `tf.foldl`, `tf.map_fn` and `tf.TensorArray` keep their
elements in TensorLists, which DTensor cannot lay out (TF 2.21: "does not
implement layout propagation"). Every list these build has a length known
when tracing, so the per-device list here is a dense tensor
`[length, *element_shape]` (with the mapped axis in front where it differs
between devices): reading an element is a gather, writing one a select of
the written row, and stacking the list the tensor itself. The lists a
loop's gradient keeps (one element pushed per forward step, popped in
reverse by the backward loop) hold at most the loop's `maximum_iterations`
elements (given by tf.scan, tf.foldl and tf.map_fn): step t writes row t,
and backward step s reads row `steps - 1 - s`. pfor checks the
dtype of what a converter returns, so these ops are defined in the
conversion before pfor meets them, and so is each loop that carries a
list (its converter sees the dense tensors).
"""

import tensorflow as tf

from tfspmd._src.core import op_types
from tfspmd._src.core import stacking
from tfspmd._src.core import tf_internal
from tfspmd._src.rewrites import dtensor_rewrites

# Ops that take or make lists without "TensorList" in their name.
_LIST_ARITHMETIC = ("Identity", "ZerosLike", "AddN", "AddV2")


class LoopPosition:
  """Where the loop whose body is being converted is.

  Attributes:
    counter: The body's iteration counter (while_v2's first loop variable).
    steps: In a backward loop, the number of forward steps (its third loop
      variable); None in a forward loop.
  """

  def __init__(self, counter, steps=None):
    self.counter = counter
    self.steps = steps


class _Pending:
  """A reserved list whose element shape is set by its first write."""

  def __init__(self, length, dtype):
    self.length = length
    self.dtype = dtype

  def materialize(self, element_shape, dtype=None):
    return tf_internal.ConvertedValue(
        tf.zeros([self.length] + list(element_shape), dtype or self.dtype),
        False)


def densify(conversion, operations, convert_loop, position=None):
  """Defines, in `conversion`, every TensorList among `operations` as dense.

  Args:
    conversion: The `tf_internal.Conversion` of the graph of `operations`.
    operations: The graph's ops, in the order they were made.
    convert_loop: The converter of a While op (given dense list inputs).
    position: The `LoopPosition` where `operations` are a loop's body.
  """
  pending = {}
  for operation in _inputs_first(operations):
    kind = operation.type
    if kind in op_types.LOOPS:
      if any(t.dtype == tf.variant for t in operation.inputs):
        _define_loop(conversion, operation, pending, convert_loop)
      continue
    if not kind.startswith("TensorList") and kind != "EmptyTensorList" and not (
        kind in _LIST_ARITHMETIC and
        any(t.dtype == tf.variant for t in operation.inputs)):
      continue
    handler = _HANDLERS.get(kind)
    if kind in ("TensorListPushBack", "TensorListPopBack"):
      _push_or_pop(conversion, operation, position)
      continue
    if handler is None:
      raise ValueError(
          f"the mapped function uses {kind} on a TensorArray (a "
          f"tf.TensorArray, or inside tf.scan, tf.map_fn, ...); tfspmd "
          f"supports TensorArrays of fixed size read, written and stacked "
          f"(read, write, unstack, stack, size). Collect the values in a "
          f"Python list and tf.stack them, or use a fixed-size TensorArray.")
    handler(conversion, operation, pending)


def _inputs_first(operations):
  """`operations` ordered so that each comes after the ops it reads.

  Creation order is not enough: a loop's gradient adds the lists it
  accumulates into after the loop was made, as new inputs of it.
  """
  members = set(operations)
  order, seen = [], set()
  for root in operations:
    stack = [(root, False)]
    while stack:
      operation, expanded = stack.pop()
      if expanded:
        order.append(operation)
        continue
      if operation in seen:
        continue
      seen.add(operation)
      stack.append((operation, True))
      for before in [t.op for t in operation.inputs] + list(
          operation.control_inputs):
        if before in members and before not in seen:
          stack.append((before, False))
  return order


def _list(conversion, tensor, pending, element_shape=None):
  """The dense value of the list `tensor` (materializing a pending one)."""
  if tensor.ref() in pending:
    if element_shape is None:
      raise ValueError(
          "the mapped function reads a TensorArray element before any was "
          "written; write every element first (or build it with unstack).")
    conversion.define(tensor, pending.pop(tensor.ref()).materialize(element_shape))
  return conversion.convert(tensor)


def _known(conversion, tensor):
  """`tensor`'s value when tracing, from the graph or its conversion.

  A list's length or element shape read from the list (as gradients do)
  is known once the list is dense.
  """
  value = tf.get_static_value(tensor)
  if value is None:
    converted = conversion.convert(tensor)
    if not converted.stacked:
      value = tf.get_static_value(converted.tensor)
  return value


def _static(conversion, tensor, what):
  value = _known(conversion, tensor)
  if value is None:
    raise ValueError(
        f"the mapped function builds a TensorArray whose {what} is not known "
        f"when tracing; tfspmd carries TensorArrays as tensors of fixed "
        f"shape: give the TensorArray a size (and its element_shape) that "
        f"does not depend on the inputs' values.")
  return value


def _reserve(conversion, operation, pending):
  length = int(_static(conversion, operation.inputs[1], "size"))
  dtype = operation.get_attr("element_dtype")
  shape = _known(conversion, operation.inputs[0])
  if shape is not None and shape.ndim == 1 and all(d >= 0 for d in shape):
    conversion.define(operation.outputs[0],
                      _Pending(length, dtype).materialize(list(shape)))
  else:
    pending[operation.outputs[0].ref()] = _Pending(length, dtype)


def _from_tensor(conversion, operation, pending):
  del pending
  conversion.define(operation.outputs[0],
                    conversion.convert(operation.inputs[0]))


def _identity(conversion, operation, pending):
  if operation.inputs[0].ref() in pending:
    pending[operation.outputs[0].ref()] = pending[operation.inputs[0].ref()]
    return
  conversion.define(operation.outputs[0],
                    conversion.convert(operation.inputs[0]))


def _get_item(conversion, operation, pending):
  dense = _list(conversion, operation.inputs[0], pending)
  index = conversion.convert(operation.inputs[1])
  conversion.define(operation.outputs[0], _read(conversion, dense, index))


def _read(conversion, dense, index, in_range=False):
  """Row `index` of the dense list `dense` (both `ConvertedValue`s).

  `in_range`: whether the index is known to lie in the list (a backward
  step's pop), so that a per-device row may be read with a mask, which
  has no index to refuse.
  """
  rows_of_each = _row_of_each if in_range else _gathered_row_of_each
  if index.stacked:
    value = rows_of_each(_repeated(dense, True, conversion.size),
                         index.tensor)
  elif dense.stacked:
    value = tf.gather(dense.tensor, index.tensor, axis=1)
  else:
    value = tf.gather(dense.tensor, index.tensor, axis=0)
  return tf_internal.ConvertedValue(value, dense.stacked or index.stacked)


def _row_of_each(rows, index):
  """Row `index[k]` of position k's list `rows[k]`, for each position k.

  The row a mask keeps, summed over the list: a gather with the positions
  as its batch dimension is one DTensor cannot split (TF 2.21: "input and
  output layout do not agree on non-axis dim 0"), as a backward loop whose
  forward loop ran a different number of steps on each device reads.
  """
  if not (rows.dtype.is_bool or rows.dtype.is_floating or
          rows.dtype.is_complex or rows.dtype.is_integer):
    return _gathered_row_of_each(rows, index)
  at = tf.equal(tf.range(rows.shape[1]), index[:, None])
  mask = tf.reshape(at, at.shape.as_list() + [1] * (rows.shape.rank - 2))
  kept = dtensor_rewrites.select(mask, rows, tf.zeros_like(rows))
  if rows.dtype.is_bool:
    return tf.reduce_any(kept, axis=1)
  return tf.reduce_sum(kept, axis=1)


def _gathered_row_of_each(rows, index):
  """`_row_of_each` by a gather, which refuses an index outside the list."""
  return tf.gather(rows, index, axis=1, batch_dims=1)


def _set_item(conversion, operation, pending):
  item = conversion.convert(operation.inputs[2])
  element_shape = operation.inputs[2].shape
  dense = _list(conversion, operation.inputs[0], pending,
                element_shape.as_list())
  _write(conversion, operation.outputs[0], dense,
         conversion.convert(operation.inputs[1]), item, element_shape)


def _write(conversion, output, dense, index, item, element_shape):
  """Defines `output` as `dense` with row `index` set to `item`."""
  stacked = dense.stacked or item.stacked or index.stacked
  size = conversion.size
  rows = _repeated(dense, stacked, size)
  written = _repeated(item, stacked, size)
  length = rows.shape[1] if stacked else rows.shape[0]
  at = tf.equal(tf.range(length), index.tensor[:, None] if index.stacked
                else index.tensor)
  # Broadcast the row mask and the written element over the list.
  mask_shape = ([size] if stacked else []) + [length] + [1] * element_shape.rank
  mask = tf.reshape(at if index.stacked or not stacked else
                    tf.logical_and(tf.ones([size, length], tf.bool), at),
                    mask_shape)
  written = tf.expand_dims(written, 1 if stacked else 0)
  conversion.define(output, tf_internal.ConvertedValue(
      dtensor_rewrites.select(mask, written, rows), stacked))


def _repeated(value, stacked, size):
  if stacked and not value.stacked:
    return stacking.repeat_along_new_axis(value.tensor, 0, size)
  return value.tensor


def _stack(conversion, operation, pending):
  shape = _known(conversion, operation.inputs[1])
  dense = _list(conversion, operation.inputs[0], pending,
                None if shape is None or shape.ndim != 1 else list(shape))
  conversion.define(operation.outputs[0], dense)


def _length(conversion, operation, pending):
  tensor = operation.inputs[0]
  length = pending[tensor.ref()].length if tensor.ref() in pending else (
      conversion.convert(tensor).tensor.shape[
          1 if conversion.convert(tensor).stacked else 0])
  conversion.define(operation.outputs[0],
                    tf_internal.ConvertedValue(tf.constant(length), False))


def _element_shape(conversion, operation, pending):
  dense = _list(conversion, operation.inputs[0], pending)
  shape = dense.tensor.shape[2 if dense.stacked else 1:]
  conversion.define(operation.outputs[0], tf_internal.ConvertedValue(
      tf.constant(shape.as_list(), operation.get_attr("shape_type")), False))


def _empty(conversion, operation, pending):
  """The list a loop's gradient fills: as long as the loop's step bound."""
  length = _known(conversion, operation.inputs[1])
  if length is not None and length >= 0 and (
      operation.get_attr("element_dtype") == tf.variant):
    # A loop nested in a loop: each element is an inner loop's list, whose
    # dense shape the loop that pushes them finds (`_define_loop`).
    pending[operation.outputs[0].ref()] = _Pending(int(length), None)
    return
  shape = _known(conversion, operation.inputs[0])
  if length is None or length < 0:
    raise ValueError(
        "the mapped function takes a gradient through a tf.while_loop with no "
        "maximum_iterations: its backward pass keeps one value per step, and "
        "tfspmd needs a bound on the steps known when tracing (as JAX "
        "differentiates fori_loop and scan, not while_loop). Give the loop "
        "maximum_iterations, or use tf.scan or a loop over tf.range.")
  if shape is None or shape.ndim != 1 or any(d < 0 for d in shape):
    raise ValueError(
        "the mapped function takes a gradient through a loop that keeps a "
        "value of unknown shape per step; give the loop's values static "
        "shapes.")
  conversion.define(operation.outputs[0], tf_internal.ConvertedValue(
      tf.zeros([int(length)] + [int(d) for d in shape],
               operation.get_attr("element_dtype")), False))


def _push_or_pop(conversion, operation, position):
  """A forward step's push (row `counter`) or a backward step's pop."""
  if position is None or (operation.type == "TensorListPopBack" and
                          position.steps is None):
    raise ValueError(
        f"the mapped function uses {operation.type} on a TensorArray outside "
        f"the loops and gradients tfspmd supports; use a fixed-size "
        f"TensorArray (read, write, stack) instead.")
  counter = conversion.convert(position.counter)
  if operation.type == "TensorListPushBack":
    item = conversion.convert(operation.inputs[1])
    _write(conversion, operation.outputs[0],
           conversion.convert(operation.inputs[0]), counter, item,
           item.tensor.shape[1 if item.stacked else 0:])
    return
  steps = conversion.convert(position.steps)
  row = tf_internal.ConvertedValue(
      steps.tensor - 1 - counter.tensor, steps.stacked or counter.stacked)
  dense = conversion.convert(operation.inputs[0])
  conversion.define(operation.outputs[0], dense)
  conversion.define(operation.outputs[1],
                    _read(conversion, dense, row, in_range=True))


def _zeros_like(conversion, operation, pending):
  dense = _list(conversion, operation.inputs[0], pending)
  conversion.define(operation.outputs[0], tf_internal.ConvertedValue(
      tf.zeros_like(dense.tensor), dense.stacked))


def _add(conversion, operation, pending):
  values = [_list(conversion, t, pending) for t in operation.inputs]
  stacked = any(v.stacked for v in values)
  total = _repeated(values[0], stacked, conversion.size)
  for value in values[1:]:
    total = total + _repeated(value, stacked, conversion.size)
  conversion.define(operation.outputs[0],
                    tf_internal.ConvertedValue(total, stacked))


def _define_loop(conversion, operation, pending, convert_loop):
  """Converts a While op carrying lists, giving pending ones their shape."""
  body = tf_internal.function_graph(operation, "body")
  for k, tensor in enumerate(operation.inputs):
    if tensor.ref() in pending and pending[tensor.ref()].dtype is None:
      dtype, shape = _pushed_list(body, body.inputs[k])
      conversion.define(tensor, pending.pop(tensor.ref()).materialize(
          shape, dtype))
    elif tensor.ref() in pending:
      shape = _written_shape(body, body.inputs[k])
      if shape is None:
        raise ValueError(
            "a loop in the mapped function carries a TensorArray whose "
            "element shape tfspmd cannot find (no write in the loop body): "
            "give the TensorArray an element_shape.")
      conversion.define(tensor, pending.pop(tensor.ref()).materialize(shape))
  outputs = conversion.apply(operation, convert_loop)
  for tensor, value in zip(operation.outputs, outputs):
    conversion.define(tensor, value)


def _pushed_list(graph, handle):
  """(dtype, dense shape) of the lists the ops of `graph` push to `handle`.

  A loop nested in a loop's body keeps its gradient's values in a list
  made in that body (an EmptyTensorList with a bound and a shape); the
  outer loop's gradient pushes the inner loop's final list once per outer
  step.
  """
  for operation in graph.get_operations():
    if operation.type == "TensorListPushBack" and operation.inputs[0] is handle:
      found = _dense_form(operation.inputs[1])
      if found is not None:
        return found
  raise ValueError(
      "the mapped function takes a gradient through loops nested more "
      "deeply than tfspmd follows (a loop in a loop in a loop, or an inner "
      "loop without maximum_iterations); give every loop maximum_iterations, "
      "or unroll one level with a Python for loop.")


def _dense_form(handle):
  """(dtype, dense shape) of the list `handle`, from the op that made it.

  Follows the list back through loops (an output to the loop's input),
  identities and writes to the op that made it, whose bound or tensor
  gives its shape when tracing.
  """
  while True:
    kind = handle.op.type
    if kind in op_types.LOOPS:
      handle = handle.op.inputs[handle.value_index]
    elif kind in ("Identity", "TensorListSetItem", "TensorListPushBack"):
      handle = handle.op.inputs[0]
    else:
      break
  operation = handle.op
  if operation.type == "TensorListFromTensor":
    shape = operation.inputs[0].shape
    if shape.is_fully_defined():
      return operation.inputs[0].dtype, shape.as_list()
    return None
  if operation.type not in ("EmptyTensorList", "TensorListReserve"):
    return None
  length = tf.get_static_value(operation.inputs[1])
  shape = tf.get_static_value(operation.inputs[0])
  dtype = operation.get_attr("element_dtype")
  if (length is None or length < 0 or shape is None or shape.ndim != 1 or
      any(d < 0 for d in shape) or dtype == tf.variant):
    return None
  return dtype, [int(length)] + [int(d) for d in shape]


def _written_shape(graph, handle):
  """The shape of the elements the ops of `graph` write into `handle`."""
  for operation in graph.get_operations():
    if operation.type == "TensorListSetItem" and operation.inputs[0] is handle:
      shape = operation.inputs[2].shape
      return shape.as_list() if shape.is_fully_defined() else None
    if operation.type == "Identity" and operation.inputs[0] is handle:
      found = _written_shape(graph, operation.outputs[0])
      if found is not None:
        return found
  return None


_HANDLERS = {
    "TensorListReserve": _reserve,
    "TensorListFromTensor": _from_tensor,
    "TensorListGetItem": _get_item,
    "TensorListSetItem": _set_item,
    "TensorListStack": _stack,
    "TensorListLength": _length,
    "TensorListElementShape": _element_shape,
    "Identity": _identity,
    "EmptyTensorList": _empty,
    "ZerosLike": _zeros_like,
    "AddN": _add,
    "AddV2": _add,
}
