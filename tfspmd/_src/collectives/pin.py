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


def pin(tensor, spec):
  """`tensor`, to be split over the mesh as `spec` says.

  Args:
    tensor: A value of the level whose step calls this.
    spec: One mesh dimension name or `dtensor.UNSHARDED` per axis of
      `tensor`.

  Returns:
    `tensor` relaid out to `spec` (with the mesh dimensions of the
    enclosing levels in front, as each adds its axis); `tensor` itself
    outside a pmap's trace (the devices of debug mode run eagerly) and in a
    program that does not lay out its values.
  """
  state = axis_env.trace_state()
  if state is None or not state.lays_out:
    return tensor
  return _pin(tensor, list(spec), axis_env.frames(), state)


def _pin(tensor, spec, outer, state):
  if not outer:
    return dtensor.relayout(tensor, state.layout(spec))
  frame = outer[-1]
  marked = tf.identity(tensor)

  @_do_not_convert
  def convert(op_inputs):
    value, stacked = op_inputs.input(0)
    dims = [frame.mesh_dim or dtensor.UNSHARDED] if stacked else []
    return [tf_internal.wrap_converted(
        _pin(value, dims + spec, outer[:-1], state), stacked)]

  tf_internal.set_pfor_converter(marked.op, convert)
  return marked
