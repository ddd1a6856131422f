"""A collective in debug mode: the devices of its group meet, one runs its step.

The group of a device is the devices that differ from it only along the
named axes; they meet in the `Session`, their values are stacked in the
order of their linear index over the named axes (the first name major), and
the collective's own `step` (the one its pfor converter applies in the
compiled program) computes the result from the stack. Each member takes its
row of a result that varies along the axes, or the whole of one that does
not. A collective that is not joint is a reduction, separable over its axes,
so one step over the merged axis gives what one step per axis gives.
"""

import math

import tensorflow as tf

from tfspmd._src.programs.debug import session as session_lib
from tfspmd._src.runtime import axis_env


def over_axes(value, targets, step, function):
  """`marker.over_axes` for the device threads of a pmap in debug mode.

  Args:
    value: This device's value, an eager tensor.
    targets: The named `DebugFrame`s, in the order named.
    step: The collective's step (see `marker.over_axes`).
    function: The collective's name, for error messages.

  Returns:
    This device's result.

  Raises:
    RuntimeError: If called while tracing a `tf.function` or a vmap, or
      over both debug pmap axes and vmap axes.
  """
  names = tuple(frame.name for frame in targets)
  axes = repr(names[0]) if len(names) == 1 else repr(names)
  if not all(isinstance(frame, session_lib.DebugFrame) for frame in targets):
    raise RuntimeError(
        f"{function} over {axes} names axes of a pmap in debug mode, whose "
        f"devices run in threads, together with vmap axes, vectorized inside "
        f"one device's program; debug mode cannot do both in one collective.")
  if not tf.executing_eagerly():
    raise RuntimeError(
        f"{function} over {axes} ran inside a tf.function or a vmap in a "
        f"pmap in debug mode, whose devices run eagerly in threads that meet "
        f"at each collective over its axes. Call the collective outside the "
        f"vmap, or the function's Python body instead of the tf.function "
        f"(tf.config.run_functions_eagerly(True) runs every tf.function "
        f"eagerly while debugging).")
  chain = axis_env.frames()
  position = {id(frame): k for k, frame in enumerate(chain)}
  named = {id(frame) for frame in targets}
  group = (tuple(frame.name for frame in chain),
           tuple(position[id(frame)] for frame in targets),
           tuple(frame.index for frame in chain if id(frame) not in named))
  linear = 0
  for frame in targets:
    linear = linear * frame.size + frame.index
  size = math.prod(frame.size for frame in targets)
  merged = axis_env.Frame(names[0] if len(names) == 1 else names, size, None)

  def compute(values, devices):
    check_alike(values, devices, f"{function} over {axes}")
    return step(tf.stack(values), True, merged, 0)

  result, stacked = chain[-1].session.meet(
      chain, group, linear, size, function, axes, value, compute)
  return result[linear] if stacked else result


def check_alike(values, devices, what):
  """Raises unless `values` (one per device) agree in shape and dtype.

  In the compiled program they always do; in debug mode Python code that
  depends on the device can make them differ.
  """
  kinds = [(tuple(value.shape), value.dtype.name) for value in values]
  if len(set(kinds)) > 1:
    listing = ", ".join(f"{device}: {dtype}{list(shape)}"
                        for device, (shape, dtype) in zip(devices, kinds))
    raise ValueError(
        f"pmap(debug=True): the devices gave {what} values of different "
        f"shapes or dtypes ({listing}); in the compiled program every "
        f"device's value has the same shape and dtype.")
