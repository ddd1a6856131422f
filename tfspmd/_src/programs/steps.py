"""Several steps of a mapped function in one compiled call.

`pmap(step, steps=K)` runs `carry, y = step(carry, *xs_t)` for t = 0..K-1
inside the program (a `tf.while_loop` around the vectorized step), so the
per-call dispatch is paid once per K steps. The first positional argument is
the carry, threaded from step to step; every other argument holds one slice
per step along its first per-device axis (as in `lax.scan`). The call
returns the last carry and the per-step outputs stacked along a new first
per-device axis.
"""

import tensorflow as tf

from tfspmd._src.arguments import out_axes as out_axes_lib
from tfspmd._src.core import stacking
from tfspmd._src.programs import vectorize
from tfspmd._src.rewrites import dtensor_rewrites
from tfspmd._src.rewrites import side_effects
from tfspmd._src.runtime import axis_env
from tfspmd._src.trees import tree


def check_steps(steps):
  if steps is not None and (isinstance(steps, bool) or
                            not isinstance(steps, int) or steps < 1):
    raise ValueError(f"pmap: `steps` must be a positive int or None, got "
                     f"{steps!r}.")
  return steps


def map_steps(fun, steps, *, frame_template, inputs, in_axes, paths,
              carry_treedef, rebuild_args, out_axes, on_slice):
  """Runs `steps` iterations of `fun` vectorized over one axis.

  Args:
    fun: The per-device step, `fun(carry, *xs, **kw) -> (carry, y)`.
    steps: The number of iterations, K.
    frame_template: `(axis_name, size, mesh_dim)` of the axis.
    inputs: The input tensors, one per dynamic leaf; the carry's leaves first.
    in_axes: For each input, its mapped axis (non-negative) or None.
    paths: The pytree path of each input, for messages.
    carry_treedef: The tree of the carry (the first positional argument).
    rebuild_args: Turns per-device leaves into `(args, kwargs)`.
    out_axes: The user's out_axes, a tree prefix of `(carry, ys)`.
    on_slice: As for `vectorize.map_over_axis`.

  Returns:
    A `vectorize.MappedResult` for the output `(carry, ys)`.
  """
  carry_count = carry_treedef.num_leaves
  fronted = []
  for k, (value, axis, path) in enumerate(zip(inputs, in_axes, paths)):
    moved = value if axis is None else stacking.move_axis_to_front(value, axis)
    if k >= carry_count:
      step_axis = 0 if axis is None else 1
      if moved.shape.rank <= step_axis or moved.shape[step_axis] != steps:
        raise ValueError(
            f"pmap with steps={steps}: {path} is a per-step input, so its "
            f"first per-device axis must have length {steps} (one slice per "
            f"step), but its per-device shape is "
            f"{tuple(moved.shape[step_axis:])}. Pass values that stay the "
            f"same across steps in the carry (the first argument).")
    fronted.append(moved)
  inner_axes = [None if axis is None else 0 for axis in in_axes]
  carry_specs = carry_treedef.unflatten(inner_axes[:carry_count])
  step_fn = _checked_step(fun, carry_treedef, steps)
  slice_tracker = _step_slice_tracker(on_slice, inputs, in_axes, carry_count)

  def one_step(t, carry):
    xs = [value if k < carry_count else
          tf.gather(value, t, axis=0 if in_axes[k] is None else 1)
          for k, value in enumerate(fronted)]
    result = vectorize.map_over_axis(
        step_fn, frame_template=frame_template, inputs=list(carry) + xs[carry_count:],
        in_axes=inner_axes, rebuild_args=rebuild_args,
        out_axes=(carry_specs, 0), on_slice=slice_tracker)
    if result.effects:
      raise side_effects.steps_error(steps)
    return result.values[:carry_count], result.values[carry_count:], result

  state = axis_env.trace_state()
  loop = (_loop_of_one_trace if state is not None and state.host else
          _loop_after_a_first_step)
  carry, buffers, first = loop(one_step, fronted[:carry_count], steps, paths)
  # [step, device, ...] -> [device, step, ...]: the step axis is the first
  # per-device axis of each output.
  stacked = [tf.transpose(b, [1, 0] + list(range(2, b.shape.rank)))
             for b in buffers]
  return _apply_out_axes(out_axes, list(carry) + stacked,
                         inner_axes[:carry_count], first, frame_template[1])


def _loop_of_one_trace(one_step, carry, steps, paths):
  """The loop over the steps, its step traced once, as a function it calls.

  The function's outputs give the shapes of the per-step output buffers,
  and XLA compiles the step once. For the host executor: DTensor's
  expansion of a call in a loop whose step reads a variable beside a
  collective cancels the program (TF 2.21).

  Returns:
    `(last carry, per-step output buffers [step, device, ...], the step's
    MappedResult)`.
  """
  count = len(carry)
  traced = []

  def flat_step(t, *values):
    new_carry, ys, result = one_step(t, list(values))
    traced.append(result)
    return list(new_carry) + list(ys)

  # Named specs: TensorFlow reads each input's name from its placeholder,
  # and an unnamed one costs it a raised and caught error (1-2 ms each).
  step_function = tf.function(flat_step, autograph=False).get_concrete_function(
      tf.TensorSpec([], tf.int32, name="step"),
      *[tf.TensorSpec.from_tensor(c, name=f"carry_{k}")
        for k, c in enumerate(carry)])
  outputs = step_function.outputs
  _check_carry(outputs[:count], carry, paths)
  buffers = [tf.zeros([steps] + y.shape.as_list(), y.dtype)
             for y in outputs[count:]]

  def body(t, carry, buffers):
    values = step_function(t, *carry)
    return (t + 1, values[:count],
            [_write(b, y, t, steps) for b, y in zip(buffers, values[count:])])

  _, carry, buffers = tf.while_loop(
      lambda t, *_: t < steps, body, (tf.constant(0), carry, buffers))
  return carry, buffers, traced[0]


def _loop_after_a_first_step(one_step, carry, steps, paths):
  """The loop over the steps, the first step traced before it.

  The first step's outputs give the shapes of the per-step output buffers;
  the loop traces the step again for the others. For DTensor's executor,
  which expands the step in the loop's body as it is.

  Returns:
    As `_loop_of_one_trace`.
  """
  new_carry, ys, first = one_step(tf.constant(0), carry)
  _check_carry(new_carry, carry, paths)
  buffers = [_write(tf.zeros([steps] + y.shape.as_list(), y.dtype), y, 0,
                    steps) for y in ys]

  def body(t, carry, buffers):
    # Through an Identity: DTensor's mesh propagation cannot follow a loop
    # variable into a loop in the step ("Block argument must be enclosed by
    # a function", TF 2.21), but follows an op's result.
    new_carry, ys, _ = one_step(tf.identity(t),
                                [tf.identity(c) for c in carry])
    return (t + 1, new_carry,
            [_write(b, y, t, steps) for b, y in zip(buffers, ys)])

  if steps > 1:
    _, new_carry, buffers = tf.while_loop(
        lambda t, *_: t < steps, body, (tf.constant(1), new_carry, buffers))
  return new_carry, buffers, first


def _step_slice_tracker(on_slice, inputs, in_axes, carry_count):
  """Tells nested pmaps which input axis a per-step slice keeps.

  A per-step input loses its step axis (its first per-device axis) before
  the step sees it, so its slices keep the input's axes other than the
  mapped one and that one.
  """
  state = axis_env.trace_state()
  if on_slice is None or state is None:
    return on_slice

  def track(leaf, piece, index):
    if leaf < carry_count:
      on_slice(leaf, piece, index)
      return
    kept = [a for a in range(inputs[leaf].shape.rank) if a != in_axes[leaf]]
    state.record_origin(piece, leaf, kept[1:])

  return track


def _checked_step(fun, carry_treedef, steps):
  def step(*args, **kwargs):
    result = fun(*args, **kwargs)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
      raise TypeError(
          f"pmap with steps={steps}: the step function must return a pair "
          f"(carry, output), as for lax.scan; got {type(result).__name__}.")
    if tree.flatten(result[0])[1] != carry_treedef:
      raise TypeError(
          f"pmap with steps={steps}: the carry the step returns has another "
          f"structure than the carry it was given (its first argument); "
          f"return the new carry with the same structure.")
    return result
  return step


def _check_carry(new, old, paths):
  for value, before, path in zip(new, old, paths):
    if value.shape != before.shape or value.dtype != before.dtype:
      raise TypeError(
          f"pmap with steps: the step returns the carry leaf {path} with "
          f"per-device shape {value.shape.as_list()[1:]} and dtype "
          f"{value.dtype.name}, but was given shape "
          f"{before.shape.as_list()[1:]} and dtype {before.dtype.name}; a "
          f"carry keeps its shape and dtype from step to step.")


def _write(buffer, value, t, steps):
  at_t = tf.reshape(tf.range(steps) == t, [steps] + [1] * value.shape.rank)
  return dtensor_rewrites.select(at_t, tf.expand_dims(value, 0), buffer)


def _apply_out_axes(out_axes, values, carry_axes, first, size):
  """Puts the mapped axis of each output where `out_axes` says.

  `values` are the carry's leaves, then the stacked per-step outputs; a
  carry leaf passed with in_axes=None (None in `carry_axes`) has no mapped
  axis yet.
  """
  carry_tree, ys_tree = first.treedef.unflatten(values)
  output = (carry_tree, ys_tree)
  leaves, treedef = tree.flatten(output)
  mapped = [k >= len(carry_axes) or carry_axes[k] is not None
            for k in range(len(leaves))]
  resolved = out_axes_lib.resolve(
      out_axes, output, [value.shape.rank - is_mapped
                         for value, is_mapped in zip(leaves, mapped)])
  placed = []
  paths = tree.leaf_paths(output, "output")
  for value, axis, is_mapped, path in zip(leaves, resolved, mapped, paths):
    if axis is None:
      if is_mapped:
        raise ValueError(
            f"out_axes=None for {path}, but with steps only a carry leaf "
            f"passed with in_axes=None (and kept the same on every device) "
            f"can come back unmapped.")
      placed.append(value)
    elif is_mapped:
      placed.append(stacking.move_front_axis_to(value, axis))
    else:
      placed.append(stacking.repeat_along_new_axis(value, axis, size))
  return vectorize.MappedResult(values=placed, out_axes=resolved,
                                treedef=treedef, per_device=[None] * len(placed),
                                paths=paths, effects=[])
