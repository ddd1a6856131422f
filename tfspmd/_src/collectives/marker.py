"""The marker op that carries a collective through pfor.

A collective emits a cheap `IdentityN` whose Python attribute
`pfor_converter` does the cross-device work when pfor vectorizes the loop of
the innermost bound axis: the converter sees the value stacked over that
axis and applies one step (a sum, a gather, ...). Axes of enclosing loops
are handled by re-emitting a marker for them from inside the converter, so
each level of a nested pmap does its own part.

Every marker also takes the loop index of each enclosing axis as an input:
pfor only calls a converter when some input varies across the loop, and a
collective of a constant (`psum(1, 'i')`) must still run. pfor also checks
that a converted output has the shape of the op's output, so a collective
that changes the shape puts a first input of the result's per-device shape
in front (zeros that nothing computes once the marker is converted).
"""

import tensorflow as tf

from tfspmd._src import axis_env
from tfspmd._src import tf_internal

_do_not_convert = tf.autograph.experimental.do_not_convert


@_do_not_convert
def over_axes(value, targets, step, function, result_shape=None):
  """Applies `step` to `value` along each axis in `targets`.

  Args:
    value: A tensor, the per-device value.
    targets: The `Frame`s to apply `step` over (from `normalize_axis_names`).
    step: `step(tensor, stacked, frame, batch_dims) -> (tensor, stacked)`:
      given the value stacked over `frame`'s axis at position 0 (or
      unstacked, the same on every position, when `stacked` is False),
      returns the per-position result, stacked or not. `batch_dims` leading
      dims of each position's value (after the stacked axis) stand for
      nested axes inside `frame`'s: the per-device value follows them, and
      they stay in front in the result.
    function: The collective's name, for error messages.
    result_shape: The per-device shape of the result where it differs from
      `value`'s (collectives over a single axis only).

  Returns:
    The per-device result.
  """
  return _emit(value, axis_env.frames(), tuple(targets), step, function,
               result_shape, 0)


def with_transpose(value, targets, step, function, transpose,
                   result_shape=None):
  """`over_axes` of `value`, whose gradient is `transpose(cotangent)`.

  A collective's cotangent is another collective (psum's is psum,
  all_gather's is psum_scatter, ...), so a GradientTape inside the mapped
  function differentiates the per-device program.
  """

  @tf.custom_gradient
  def collective(x):
    return over_axes(x, targets, step, function, result_shape), transpose

  return collective(value)


def _emit(value, chain, targets, step, function, result_shape, batch_dims):
  frame = chain[-1]
  head = [] if result_shape is None else [tf.zeros(result_shape, value.dtype)]
  outputs = tf.raw_ops.IdentityN(input=head + [value] + [f.index for f in chain])
  value_input = len(head)

  @_do_not_convert
  def convert(pfor_input):
    own_index = pfor_input.input(pfor_input.num_inputs - 1)
    if not own_index.is_stacked:
      raise ValueError(
          f"{function} over axis {frame.name!r} met a loop that is not that "
          f"axis's (a tf.vectorized_map or tf.while_loop inside the mapped "
          f"function?). Use tfspmd.vmap with an axis_name instead of "
          f"tf.vectorized_map around collectives.")
    tensor, stacked, _ = pfor_input.input(value_input)
    if any(target is frame for target in targets):
      tensor, stacked = step(tensor, stacked, frame, batch_dims)
    remaining = tuple(t for t in targets if t is not frame)
    if remaining:
      # Outer loops see this axis, where still stacked, as one more batch dim.
      extra = [frame.size] if stacked else []
      tensor = _emit(tensor, chain[:-1], remaining, step, function,
                     None if result_shape is None else extra + list(result_shape),
                     batch_dims + len(extra))
    return [tf_internal.wrap_converted(tensor, stacked)] + [
        pfor_input.input(k) for k in range(1, pfor_input.num_inputs)]

  tf_internal.set_pfor_converter(outputs[0].op, convert)
  return outputs[0]
