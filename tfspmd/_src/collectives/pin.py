"""Fixing where a collective's value is split, at every level of the mesh.

DTensor's layout propagation picks each value's layout from its producers
and its consumers, and its Transpose expander does no communication ("needs
communication is not supported yet"): when a consumer asks for a layout
that the transpose inside a collective would have to move data for (a
psum_scatter's result added to an all_gather's, still split where the
gather left it), the program stops while DTensor runs it. A relayout on
each side of such a transpose fixes both layouts; DTensor moves the data in
the relayouts, whose expander does communicate.

A collective's step runs at the level of its axis, on the value without
the axes of the enclosing levels, and the mesh is complete only once every
level is traced. So `pin` emits an identity whose converter adds the axis
of each enclosing level in front of the spec as that level vectorizes it,
and the outermost level emits the relayout.
"""

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import merged_dims
from tfspmd._src.core import tf_internal
from tfspmd._src.runtime import axis_env

_do_not_convert = tf.autograph.experimental.do_not_convert


def applies(frame, batch_dims):
  """Whether a step of `frame`'s level pins its layouts.

  On a program's mesh of several dimensions, where the layouts DTensor
  picks otherwise fail, for a step over one pmap axis with no leading dims
  of other levels (whose mesh dimensions the step does not know).
  """
  state = axis_env.trace_state()
  return (state is not None and len(state.mesh_axes) > 1 and
          frame.mesh_dim is not None and not batch_dims)


def whole_on_each_device(tensor):
  """`tensor` (a device's own value) held whole by each device.

  A gathered value is otherwise left split over the mesh dimensions it was
  gathered from, to be gathered where it is used. DTensor cannot lay out
  some uses of such a value: two values split over different dimensions
  meeting in one op (the contraction of an einsum whose operands were
  gathered over other axes), or a slice at a constant position of the
  gathered axis (`all_gather(x)[2]`), which it would leave split.
  """
  state = axis_env.trace_state()
  rank = tensor.shape.rank
  if state is None or rank is None or (
      rank + len(axis_env.frames()) > merged_dims.MAX_KERNEL_RANK):
    # Past the rank DTensor's relayouts take, the value stays as it is.
    return tensor
  return pin(tensor, [dtensor.UNSHARDED] * rank, where_same=True)


def pin(tensor, spec, where_same=False):
  """`tensor`, to be split over the mesh as `spec` says.

  Args:
    tensor: A value of the level whose step calls this.
    spec: One mesh dimension name or `dtensor.UNSHARDED` per axis of
      `tensor`.
    where_same: Whether to pin it also where it is the same on every
      device of an enclosing level; otherwise the layout is left to
      DTensor there.

  Returns:
    `tensor` relaid out to `spec` (with the mesh dimensions of the
    enclosing levels in front, as each adds its axis); `tensor` itself
    outside a pmap's trace (the devices of debug mode run eagerly) and in a
    program that does not lay out its values.
  """
  state = axis_env.trace_state()
  if state is None or not state.lays_out:
    return tensor
  return _pin(tensor, list(spec), axis_env.frames(), state, where_same)


def _pin(tensor, spec, outer, state, where_same):
  if not outer:
    return dtensor.relayout(tensor, state.layout(spec))
  frame = outer[-1]
  # pfor leaves an op whose inputs are all the same on every device of the
  # level as it is, so the level's index rides along where the marker must
  # be converted there too.
  inputs = [tensor] + ([tf_internal.reachable(frame.index)]
                       if where_same else [])
  marked = tf.raw_ops.IdentityN(input=inputs)[0]

  @_do_not_convert
  def convert(op_inputs):
    value, stacked = op_inputs.input(0)
    dims = [frame.mesh_dim or dtensor.UNSHARDED] if stacked else []
    return [tf_internal.wrap_converted(
        _pin(value, dims + spec, outer[:-1], state, where_same), stacked)] + [
            tf_internal.wrap_converted(*op_inputs.input(k))
            for k in range(1, op_inputs.num_inputs)]

  tf_internal.set_pfor_converter(marked.op, convert)
  return marked
