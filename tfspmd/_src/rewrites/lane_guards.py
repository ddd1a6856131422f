"""Ops a device does not reach get inputs that cannot fail there.

A per-device conditional becomes its branches computed on every device and
a select, and a loop whose trip count differs between devices runs until
every device is done (`control_flow`). The ops of a branch a device does
not take, and of the iterations it does not run, then compute on that
device's values too, where a program running on the device would never
run them: a gather or scatter index out of range there, an integer
division by zero or an integer to a negative power, would fail the whole
call. As JAX's vmap does, those ops get safe inputs at the positions that
do not reach them (an index of 0, a divisor or an exponent of 1); the
positions that reach them keep their own inputs, so no
result a device keeps changes, and the select drops what the others
computed. Prints and checks are kept to the devices that reach them by
`side_effects`.
"""

import contextlib

import tensorflow as tf

from tfspmd._src.core import tf_internal
from tfspmd._src.core import trace_context
from tfspmd._src.rewrites import dtensor_rewrites

_do_not_convert = tf.autograph.experimental.do_not_convert

# For each op type that can fail on the values of a device that does not
# reach it: the inputs to make safe, each with the value that cannot fail.
_INDEX = 0
_DIVISOR = 1
_SAFE_INPUTS = {
    "GatherV2": {1: _INDEX},
    "Gather": {1: _INDEX},
    "GatherNd": {1: _INDEX},
    "ResourceGather": {1: _INDEX},
    "ResourceGatherNd": {1: _INDEX},
    "TensorScatterAdd": {1: _INDEX},
    "TensorScatterSub": {1: _INDEX},
    "TensorScatterUpdate": {1: _INDEX},
    "TensorScatterMax": {1: _INDEX},
    "TensorScatterMin": {1: _INDEX},
    "ScatterNd": {0: _INDEX},
    "UnsortedSegmentSum": {1: _INDEX},
    "UnsortedSegmentProd": {1: _INDEX},
    "UnsortedSegmentMax": {1: _INDEX},
    "UnsortedSegmentMin": {1: _INDEX},
    "SparseSoftmaxCrossEntropyWithLogits": {1: _INDEX},
    "FloorDiv": {1: _DIVISOR},
    "TruncateDiv": {1: _DIVISOR},
    "FloorMod": {1: _DIVISOR},
    "TruncateMod": {1: _DIVISOR},
    "Mod": {1: _DIVISOR},
    "Div": {1: _DIVISOR},
    # An integer to a negative power fails; to the power 1 it cannot.
    "Pow": {1: _DIVISOR},
}
GUARDED_TYPES = frozenset(_SAFE_INPUTS)


def _masks():
  return trace_context.this_thread.lane_masks


@contextlib.contextmanager
def vectorizing():
  """Within, conversions start with every position reaching every op.

  A nested pmap is vectorized while its enclosing function is traced, with
  a loop of its own size: masks of the enclosing conversion do not apply.
  """
  context = trace_context.this_thread
  saved, context.lane_masks = context.lane_masks, [None]
  try:
    yield
  finally:
    context.lane_masks = saved


def reached():
  """Where the ops converted now are reached: a bool mask, or None (all)."""
  return _masks()[-1]


@contextlib.contextmanager
def reached_where(mask):
  """Ops converted within are reached only where `mask` holds.

  Args:
    mask: A bool tensor, one per position of the loop being converted, or a
      scalar for all of them; combined with the masks of enclosing branches.
  """
  masks = _masks()
  outer = masks[-1]
  masks.append(mask if outer is None else tf.logical_and(outer, mask))
  try:
    yield
  finally:
    masks.pop()


def guard(operation):
  """Gives `operation`, if it can fail where it is not reached, safe inputs there.

  Wraps the converter pfor would call for `operation` (tfspmd's route, or
  pfor's own), so this is called after the op was given its route.
  """
  if operation.type not in GUARDED_TYPES:
    return
  if (operation.type in ("Div", "Mod", "Pow") and
      not operation.outputs[0].dtype.is_integer):
    return
  converter = tf_internal.converter_of(operation)
  if converter is None:
    return

  @_do_not_convert
  def convert(op_inputs):
    mask = _masks()[-1]
    if mask is None:
      return converter(op_inputs)
    values = op_inputs.inputs()
    for index, kind in _SAFE_INPUTS[operation.type].items():
      values[index] = _made_safe(values[index], kind, mask,
                                 op_inputs.loop_size)
    return converter(tf_internal.with_inputs(op_inputs, values))

  tf_internal.set_pfor_converter(operation, convert)


def _made_safe(value, kind, mask, size):
  """`value` where `mask` holds, and a value that cannot fail elsewhere."""
  tensor = value.tensor
  safe = tf.zeros_like(tensor) if kind == _INDEX else tf.ones_like(tensor)
  if mask.shape.rank == 0:
    everywhere = tf.logical_and(tf.ones(tf.shape(tensor), tf.bool), mask)
    return tf_internal.ConvertedValue(
        dtensor_rewrites.select(everywhere, tensor, safe), value.stacked)
  if not value.stacked:
    tensor = tf_internal.stacked(value, size)
    safe = tf.zeros_like(tensor) if kind == _INDEX else tf.ones_like(tensor)
  shape = [-1] + [1] * (tensor.shape.rank - 1)
  return tf_internal.ConvertedValue(
      dtensor_rewrites.select(tf.reshape(mask, shape), tensor, safe), True)
