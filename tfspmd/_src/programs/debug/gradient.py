"""A GradientTape around a pmap call in debug mode.

As in the compiled path (`pmap_gradient`), the call is recorded on the tape
as one op whose gradient is another pmap, here in debug mode too, of each
device's vector-Jacobian product. The devices run in other threads than the
tape's: the variables they read are found by a tape in each device thread,
and read again in the tape's thread, where `tf.custom_gradient` looks for
the variables a function used.
"""

from tfspmd._src.programs import pmap_gradient
from tfspmd._src.trees import tree

# pylint: disable=protected-access


class _AfterForward:
  """The VJP program, made once the forward call showed its outputs."""

  def __init__(self):
    self.program = None

  @property
  def variables(self):
    return self.program.variables

  def __call__(self, leaves, cotangents, axis_size):
    return self.program(leaves, cotangents, axis_size)


def recorded_call(pmapped, run, bound):
  """Runs a call in debug mode so that the active GradientTape records it.

  Args:
    pmapped: The `PmappedFunction`.
    run: `run(values, watch_variables) -> (outputs, out axes, variables)`,
      the call on the input leaves `values`.
    bound: The call's `_Bound` arguments.

  Returns:
    The outputs, `tf.Tensor`s on the tape.
  """
  vjp = _AfterForward()
  output = tree.OutputTree()

  def forward(values):
    outputs, out_axes, variables = run(values, watch_variables=True)
    for variable in variables:
      variable.read_value()
    vjp.program = pmap_gradient.VjpProgram(
        lambda fun, in_axes, out_axes: pmapped.over_the_same_axis(
            fun, in_axes, out_axes, debug=True),
        pmapped.options.fun, bound.rebuild, bound.in_axes, out_axes, variables,
        pmapped.options.axis_name)
    return output.leaves_of(outputs)

  outputs = pmap_gradient.recorded_call(forward, vjp, bound.values, bound.size)
  return output.rebuild(outputs)
