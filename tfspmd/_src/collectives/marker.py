"""The marker op that carries a collective through pfor.

A collective emits a cheap `IdentityN` whose Python attribute
`pfor_converter` does the cross-device work when pfor vectorizes the loop of
the innermost bound axis: the converter sees the value stacked over that
axis and applies one step (a sum, a gather, ...). Axes of enclosing loops
are handled by re-emitting a marker for them from inside the converter, so
each level of a nested pmap does its own part.

A reduction is separable: it sums over one axis at a time. Other
collectives over a tuple of axes act on the linear index over all of them,
so the levels of the inner named axes only pass the value up, stacked, and
the level of the outermost named axis applies the step once to the value
stacked over every named axis, flattened into one axis in the order named.

Every marker also takes the loop index of each enclosing axis as an input:
pfor only calls a converter when some input varies across the loop, and a
collective of a constant (`psum(1, 'i')`) must still run. pfor also checks
that a converted output has the shape of the op's output, so a collective
that changes the shape puts a first input of the result's per-device shape
in front (zeros that nothing computes once the marker is converted).
"""

import dataclasses
import math

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.collectives import pin
from tfspmd._src.core import graph_gradients
from tfspmd._src.core import merged_dims
from tfspmd._src.core import stacking
from tfspmd._src.core import tf_internal
from tfspmd._src.rewrites import control_flow
from tfspmd._src.runtime import axis_env

_do_not_convert = tf.autograph.experimental.do_not_convert


@dataclasses.dataclass(frozen=True)
class _Collective:
  """What every level of one collective needs to know.

  Attributes:
    targets: The named `Frame`s, in the order named.
    step: `step(tensor, stacked, frame, batch_dims) -> (tensor, stacked)`:
      given the value stacked over `frame`'s axis at position 0 (or
      unstacked, the same on every position, when `stacked` is False),
      returns the per-position result, stacked or not. `batch_dims` leading
      dims of each position's value (after the stacked axis) stand for
      axes of other levels: the per-device value follows them, and they stay
      in front in the result.
    function: The collective's name, for error messages.
    joint: Whether the step acts on the linear index over all targets at
      once (False: it is applied per target, one level at a time).
    varies: Whether a joint collective's result differs between the
      positions of its targets (all_gather's does not).
    transpose_step: The step of the collective's transpose, where that is
      the same kind of per-level collective (psum's is psum's step), else
      None.
  """
  targets: tuple
  step: object
  function: str
  joint: bool
  varies: bool
  transpose_step: object = None


@_do_not_convert
def over_axes(value, targets, step, function, result_shape=None, *,
              joint=False, varies=True, transpose_step=None):
  """Applies `step` to `value` along the axes `targets`.

  Args:
    value: A tensor, the per-device value.
    targets: The `Frame`s named (from `normalize_axis_names`).
    step: See `_Collective.step`. With `joint`, the frame it gets stands for
      all targets: its size is their product.
    function: The collective's name, for error messages.
    result_shape: The per-device shape of the result where it differs from
      `value`'s.
    joint: Apply `step` once over the linear index of all targets instead of
      once per target.
    varies: With `joint`: whether the result differs along the targets.
    transpose_step: See `_Collective.transpose_step`.

  Returns:
    The per-device result.
  """
  threaded = next((frame.run_collective for frame in targets
                   if frame.run_collective is not None), None)
  if threaded is not None:
    # Eager device threads: no pfor to convert a marker, so the devices meet.
    return threaded(value, targets, step, function)
  collective = _Collective(tuple(targets), step, function,
                           joint and len(targets) > 1, varies, transpose_step)
  return _emit(value, axis_env.frames(), collective, result_shape, ())


def flat_where_too_high(value, collective):
  """`collective(value)`, computed on `value` flattened where it must be.

  For a collective whose every element of the result comes from the same
  element on each device (a reduction, a permutation). Where the mapped
  axes would take `value` past the rank TensorFlow's kernels take, and
  with them DTensor's moves of it between layouts, it is moved flat; its
  dimensions are the device's own, so the reshape moves no data.
  """
  shape = value.shape
  split = axis_env.split_leading_dims()
  if not shape.is_fully_defined() or shape.rank <= split + 1 or (
      shape.rank + len(axis_env.frames()) <= merged_dims.MAX_KERNEL_RANK):
    return collective(value)
  sizes = shape.as_list()
  flat = collective(tf.reshape(value, sizes[:split] + [-1]))
  if split:
    return tf.reshape(flat, sizes)
  # Split as a device's own value before it takes its rank back, or
  # DTensor may move it between layouts at that rank.
  return tf.reshape(pin.pin(flat, [dtensor.UNSHARDED]), sizes)


def merged_around(value, axes):
  """`value` with the runs of dimensions between `axes` merged, if it must be.

  For a collective that acts on the dimensions `axes` of the per-device
  value and on each of the others alike. Where the mapped axes would take
  `value` past the rank TensorFlow's kernels take (and DTensor's moves of
  it), the runs of other dimensions merge: they are the device's own, so
  the reshape moves no data.

  Returns:
    `(merged value, {axis: its position in the merged value})`, or None
    where nothing must merge.
  """
  shape = value.shape
  if not shape.is_fully_defined() or (
      shape.rank + len(axis_env.frames()) <= merged_dims.MAX_KERNEL_RANK):
    return None
  sizes = shape.as_list()
  merged, positions, start = [], {}, 0
  split = range(axis_env.split_leading_dims())
  for axis in sorted(set(axes).union(split)):
    if start < axis:
      merged.append(math.prod(sizes[start:axis]))
    positions[axis] = len(merged)
    merged.append(sizes[axis])
    start = axis + 1
  if start < len(sizes):
    merged.append(math.prod(sizes[start:]))
  if len(merged) == len(sizes):
    return None
  return tf.reshape(value, merged), positions


def with_transpose(value, targets, step, function, transpose,
                   result_shape=None, *, elementwise=False, **options):
  """`over_axes` of `value`, whose gradient is `transpose(cotangent)`.

  A collective's cotangent is another collective (psum's is psum,
  all_gather's is psum_scatter, ...), so a GradientTape inside the mapped
  function differentiates the per-device program. An `elementwise`
  collective moves high-rank values flat (`flat_where_too_high`).
  """

  @graph_gradients.custom_gradient
  def collective(x):
    return (over_axes(x, targets, step, function, result_shape, **options),
            transpose)

  if elementwise:
    return flat_where_too_high(value, collective)
  return collective(value)


def _shaped_like(shape, value):
  """A tensor whose static shape is `shape` (None: a size open until it runs).

  It only gives the marker's result its shape: the collective's conversion
  replaces the result.
  """
  zeros = tf.zeros([0 if size is None else size for size in shape],
                   value.dtype)
  if None not in shape:
    return zeros
  return tf.raw_ops.PlaceholderWithDefault(input=zeros, shape=shape)


def _emit(value, chain, collective, result_shape, levels):
  """Emits the marker of the innermost frame of `chain`.

  `levels` are the frames of the leading dims of `value` that stand for
  inner axes already passed (outermost first).
  """
  frame = chain[-1]
  head = [] if result_shape is None else [_shaped_like(result_shape, value)]
  indices = [tf_internal.reachable(f.index) for f in chain]
  outputs = tf.raw_ops.IdentityN(input=head + [value] + indices)
  value_input = len(head)

  @_do_not_convert
  def convert(op_inputs):
    own_index = op_inputs.input(op_inputs.num_inputs - 1)
    if not own_index.stacked:
      raise ValueError(
          f"{collective.function} over axis {frame.name!r} met a loop that "
          f"is not that axis's (a tf.vectorized_map or tf.while_loop inside "
          f"the mapped function?). Use tfspmd.vmap with an axis_name instead "
          f"of tf.vectorized_map around collectives.")
    tensor, stacked = op_inputs.input(value_input)
    remaining = _remaining_targets(collective.targets, chain[:-1])
    tensor, stacked, out_stacked = _convert_level(
        tensor, stacked, frame, collective, levels, outermost=not remaining)
    if remaining:
      tensor = _emit_outer(
          tensor, chain[:-1], collective,
          None if result_shape is None else
          [frame.size] * out_stacked + list(result_shape),
          (frame,) * stacked + levels)
    return [tf_internal.wrap_converted(tensor, out_stacked)] + [
        tf_internal.wrap_converted(*op_inputs.input(k))
        for k in range(1, op_inputs.num_inputs)]

  tf_internal.set_pfor_converter(outputs[0].op, convert)
  setattr(outputs[0].op, control_flow.COLLECTIVE_ATTRIBUTE, collective.function)
  return outputs[0]


def _emit_outer(value, chain, collective, result_shape, levels):
  """`_emit` for the enclosing levels, from inside a converter.

  A GradientTape open around an inner pmap records the ops its
  vectorization creates, this marker among them: give it the gradient of
  the collective's remaining part, not IdentityN's.
  """
  if not tf_internal.tape_active():
    return _emit(value, chain, collective, result_shape, levels)

  @graph_gradients.custom_gradient
  def outer(x):
    def transpose(cotangent):
      if collective.transpose_step is None:
        names = ", ".join(repr(t.name) for t in collective.targets)
        raise NotImplementedError(
            f"the gradient of {collective.function} over {names} taken by a "
            f"GradientTape opened outside the pmap that calls it is not "
            f"supported; open the tape inside the innermost mapped function "
            f"(or differentiate the outer pmap's own function).")
      return _emit(cotangent, chain, dataclasses.replace(
          collective, step=collective.transpose_step), None, levels)
    return _emit(x, chain, collective, result_shape, levels), transpose

  return outer(value)


def _remaining_targets(targets, chain):
  return tuple(t for t in targets if any(t is f for f in chain))


def _convert_level(tensor, stacked, frame, collective, levels, outermost):
  """One level's part: returns (tensor, stacked, output stacked).

  An inner level of a joint collective passes the tensor up with its own
  axis stacked in front, while the output of its marker leaves that axis
  out when the result does not vary along it.
  """
  if not any(t is frame for t in collective.targets):
    return tensor, stacked, stacked
  if not collective.joint:
    tensor, stacked = collective.step(tensor, stacked, frame, len(levels))
    return tensor, stacked, stacked
  if not stacked:
    tensor = stacking.repeat_along_new_axis(tensor, 0, frame.size)
  if outermost:
    tensor = _joint_step(tensor, (frame,) + levels, collective)
    return tensor, collective.varies, collective.varies
  return tensor, True, collective.varies


def _joint_step(tensor, leading, collective):
  """Applies the step over the targets among the `leading` dims at once.

  The target dims go to the front in the order named and merge into one
  axis (the first named major, as in `axis_index` of a tuple); after the
  step a varying result is split back into the dims it came from.
  """
  position = {id(f): k for k, f in enumerate(leading)}
  target_dims = [position[id(t)] for t in collective.targets]
  other_dims = [k for k in range(len(leading)) if k not in target_dims]
  rest = list(range(len(leading), tensor.shape.rank))
  order = target_dims + other_dims + rest
  grouped = tf.transpose(tensor, order)
  sizes = [t.size for t in collective.targets]
  total = math.prod(sizes)
  merged = tf.reshape(grouped, [total] + stacking.sizes(grouped)[len(sizes):])
  names = tuple(t.name for t in collective.targets)
  result, stacked = collective.step(
      merged, True, axis_env.Frame(names, total, None), len(other_dims))
  if not stacked:
    return result
  split = tf.reshape(result, sizes + stacking.sizes(result)[1:])
  inverse = [order.index(k) for k in range(len(leading))]
  return tf.transpose(split, inverse + list(range(len(leading),
                                                  split.shape.rank)))
