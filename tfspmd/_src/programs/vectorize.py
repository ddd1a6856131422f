"""Vectorizing the per-device function over one mapped axis with pfor.

`map_over_axis` is the part shared by every level of a pmap (and by vmap):
it binds the axis name, slices each mapped input inside the pfor loop, calls
the user's function, checks its outputs against `out_axes`, and returns the
stacked results with the mapped axis where `out_axes` puts it.
"""

import dataclasses
import functools

import tensorflow as tf

from tfspmd._src.arguments import out_axes as out_axes_lib
from tfspmd._src.core import op_types
from tfspmd._src.core import stacking
from tfspmd._src.core import tf_internal
from tfspmd._src.programs import replica_context
from tfspmd._src.rewrites import control_flow
from tfspmd._src.rewrites import converters
from tfspmd._src.rewrites import dtensor_rewrites
from tfspmd._src.rewrites import lane_guards
from tfspmd._src.rewrites import side_effects
from tfspmd._src.rewrites import variable_writes
from tfspmd._src.runtime import axis_env
from tfspmd._src.trees import tree

_do_not_convert = tf.autograph.experimental.do_not_convert


@dataclasses.dataclass
class MappedResult:
  """The outputs of `map_over_axis`.

  Attributes:
    values: One tensor per output leaf: stacked along its out axis, or the
      single per-device value where out_axes is None.
    out_axes: The resolved out axis of each leaf (None: not mapped).
    treedef: The output tree.
    per_device: The per-device output tensors `fun` returned (before
      stacking), to look up what nested pmaps recorded about them.
    paths: The pytree path of each output leaf, for messages.
    effects: The `side_effects.Record`s of the prints and checks the caller
      must make happen (none inside an enclosing vectorized level, which
      takes them over).
  """
  values: list
  out_axes: list
  treedef: object
  per_device: list
  paths: list
  effects: list


@dataclasses.dataclass
class _TracedBody:
  """What the one trace of the per-device function found.

  Attributes:
    treedef: The output tree.
    specs: The resolved out axis of each output leaf (None: not mapped).
    outputs: The per-device output tensors.
    paths: The pytree path of each output leaf, for messages.
    anchored: Whether a last output anchors the prints and checks.
  """
  treedef: object = None
  specs: list = None
  outputs: list = None
  paths: list = None
  anchored: bool = False


def map_over_axis(fun, *, frame_template, inputs, in_axes, rebuild_args,
                  out_axes, on_slice=None,
                  varying_output_error=out_axes_lib.varying_output_error):
  """Traces `fun` once per position of one axis, vectorized by pfor.

  Args:
    fun: The per-device function.
    frame_template: `(axis_name, size, mesh_dim)` of the axis.
    inputs: The input tensors, one per dynamic leaf.
    in_axes: For each input, the axis mapped over (non-negative) or None.
    rebuild_args: Turns the list of per-device inputs into `(args, kwargs)`.
    out_axes: The out_axes spec (a tree prefix of the output).
    on_slice: Optional `on_slice(leaf, per_device_tensor, index)` called for
      each mapped input's per-device slice (nested pmaps track origins).
    varying_output_error: `(path, axis_name)` -> the error to raise for an
      output with out_axes None that varies along the axis, or None to take
      the value of position 0 instead (shard_map's `check_vma=False`).

  Returns:
    A `MappedResult`.
  """
  axis_name, size, mesh_dim = frame_template
  fronted = [None if axis is None else stacking.move_axis_to_front(value, axis)
             for value, axis in zip(inputs, in_axes)]
  invariant = {}
  varying = []
  traced = _TracedBody()

  @_do_not_convert
  def loop_fn(index):
    frame = axis_env.Frame(axis_name, size, index, mesh_dim)
    with axis_env.bound_axis(frame):
      per_device = []
      for leaf, (value, moved) in enumerate(zip(inputs, fronted)):
        if moved is None:
          per_device.append(value)
        else:
          piece = tf.gather(moved, index)
          if on_slice is not None:
            on_slice(leaf, piece, index)
          per_device.append(piece)
      args, kwargs = rebuild_args(per_device)
      graph = tf.compat.v1.get_default_graph()
      first_op = len(graph.get_operations())
      try:
        # Refused as it is created: its initial value would otherwise be
        # refused as a write the user never wrote.
        with tf.variable_creator_scope(functools.partial(
            _refuse_variable, axis_name=axis_name)), \
            dtensor_rewrites.rewriting_traced_ops(), \
            replica_context.replica_of_device_axes():
          result = fun(*args, **kwargs)
      except tf.errors.OperatorNotAllowedInGraphError as e:
        raise _python_control_flow_error(e, axis_name) from None
      leaves, treedef = tree.flatten(result)
      # Sparse results become dense here, with ops of their own.
      outputs = [output_tensor(leaf, path) for leaf, path in zip(
          leaves, tree.leaf_paths(result, "output"))]
      # pfor's own converters for these give what DTensor cannot expand.
      new_ops = graph.get_operations()[first_op:]
      converters.give_converters(new_ops)
      # pfor drops a write nothing reads: find it before it goes unseen.
      write = control_flow.find_operation(
          new_ops, lambda op: op_types.writes_variable(op.type))
      if write is not None:
        raise variable_writes.write_error(write.type, axis_name)
      specs = out_axes_lib.resolve(out_axes, result,
                                   [o.shape.rank for o in outputs])
      traced.treedef, traced.specs, traced.outputs = treedef, specs, outputs
      traced.paths = tree.leaf_paths(result, "output")
      marked = [_mark_invariant(value, k, frame, invariant, varying)
                for k, value in enumerate(outputs)]
      effects = control_flow.effect_operations(new_ops, axis_name)
      if effects:
        marked.append(side_effects.anchor(effects, index))
      traced.anchored = bool(effects)
      return marked

  try:
    # pfor's own stacking (a tile) is rewritten too where it passes rank 8.
    with side_effects.recording() as effects, \
        control_flow.remembered_loop_stacking(), lane_guards.vectorizing(), \
        dtensor_rewrites.rewriting_traced_ops():
      stacked = tf_internal.vectorize_loop(loop_fn, size,
                                           control_flow.prepare)
    if traced.anchored:
      stacked = stacked[:-1]
  except ValueError as e:
    found = tf_internal.unvectorizable_op(e)
    if found is None:
      raise
    raise _unvectorizable_error(*found, axis_name) from None
  unmappable = [k for k in varying if traced.specs[k] is None]
  for k in unmappable:
    error = varying_output_error(traced.paths[k], axis_name)
    if error is not None:
      raise error
  values = []
  for k, spec in enumerate(traced.specs):
    if spec is None and k in invariant:
      values.append(invariant[k])
    elif spec is None:
      values.append(tf.gather(stacked[k], 0))
    elif k in invariant:
      values.append(stacking.repeat_along_new_axis(invariant[k], spec, size))
    else:
      values.append(stacking.move_front_axis_to(stacked[k], spec))
  return MappedResult(values=values, out_axes=traced.specs,
                      treedef=traced.treedef, per_device=traced.outputs,
                      paths=traced.paths,
                      effects=side_effects.hand_outward(
                          sorted(effects, key=lambda record: record.key)))


def _refuse_variable(next_creator, axis_name, **kwargs):
  """A variable creator that refuses: the mapped function made a variable."""
  del next_creator  # unused: nothing is created
  name = kwargs.get("name")
  raise ValueError(
      f"the function mapped over axis {axis_name!r} creates a tf.Variable"
      f"{'' if name is None else f' ({name})'}; a mapped function cannot "
      f"create variables. Create it outside the mapped function and pass "
      f"its value in as an argument (in_axes=None for a value every device "
      f"shares), or read it inside: reading a variable created outside is "
      f"fine. A Keras layer or model makes its weights on its first call: "
      f"build it (or call it once) outside first.")


def _python_control_flow_error(error, axis_name):
  """What to write instead of Python control flow on a per-device tensor.

  TensorFlow's own message advises @tf.function, which does not help here:
  the mapped function is traced once for every device, as under jax.pmap.
  """
  if "Iterating over" in str(error):
    used = "iterates over a tensor with a Python for loop"
    instead = ("use tf.range in a tf.while_loop, tf.map_fn or tf.scan, or "
               "vectorized ops over the tensor")
  else:
    used = ("uses a tensor as a Python bool (an `if`, `while`, `and`, `or`, "
            "`not` or `assert` on a tensor)")
    instead = ("use tf.cond or tf.where to choose between values, and "
               "tf.while_loop for a loop")
  return TypeError(
      f"the function mapped over axis {axis_name!r} {used}, but its tensors "
      f"are traced once for every device, as under jax.pmap, and have no "
      f"value yet: {instead}. To run Python on each device's values "
      f"while debugging, run the pmap with debug=True.")


def _unvectorizable_error(op_type, input_name, axis_name):
  if input_name is not None:
    return ValueError(
        f"the function mapped over axis {axis_name!r} gives the op {op_type} "
        f"an input `{input_name}` that differs between devices, and "
        f"TensorFlow's vectorizer (pfor) needs that input to be the same on "
        f"every device. Pass the value it comes from with in_axes=None (and "
        f"keep it out of per-device computations), or compute it outside the "
        f"mapped function.")
  if op_type.startswith(("Rng", "Stateful")):
    return ValueError(
        f"the function mapped over axis {axis_name!r} draws from a "
        f"tf.random.Generator ({op_type}), whose state is a variable a mapped "
        f"function cannot update. Draw one seed per device outside "
        f"(`generator.make_seeds(n)`, a column per device, passed with "
        f"in_axes=1) and use tf.random.stateless_* ops with it inside "
        f"(docs/randomness.md).")
  if op_types.writes_variable(op_type):
    return variable_writes.write_error(op_type, axis_name)
  return ValueError(
      f"the function mapped over axis {axis_name!r} uses the op {op_type}, "
      f"which TensorFlow's vectorizer (pfor) cannot map over an axis. Compute "
      f"it outside the mapped function, or replace it with ops pfor supports "
      f"(for example tf.gather instead of a dynamic slice of a TensorArray).")


def output_tensor(leaf, path):
  try:
    tensor = tf.convert_to_tensor(leaf)
  except (TypeError, ValueError) as e:
    raise TypeError(
        f"the pmapped function returned a {type(leaf).__name__} at {path}, "
        f"which is not convertible to a tensor ({e}). Return tensors, NumPy "
        f"arrays or Python numbers, in tuples, lists, dicts or namedtuples."
    ) from None
  if tensor.dtype == tf.string:
    # The devices' programs carry numbers only: DTensor cannot place strings.
    what = (f"the string {leaf!r}" if isinstance(leaf, (str, bytes))
            else f"a {type(leaf).__name__} of strings")
    raise TypeError(
        f"the pmapped function returned {what} at {path}; outputs must be "
        f"numbers or bools (tensors, NumPy arrays or Python numbers). Return "
        f"a number (a class index, a code) and map it to the string outside "
        f"the pmap.")
  return tensor


def _mark_invariant(value, k, frame, invariant, varying):
  """Passes an output through a marker that records whether it varies.

  pfor keeps a value unstacked exactly when it provably does not depend on
  the position along the axis; the converter records the unstacked value
  (one copy, for out_axes=None or to repeat it without pfor's tile) or
  notes that the output varies.
  """
  outputs = tf.raw_ops.IdentityN(input=[value, frame.index])

  @_do_not_convert
  def convert(op_inputs):
    tensor, stacked = op_inputs.input(0)
    if stacked:
      varying.append(k)
    else:
      invariant[k] = tensor
    return [tf_internal.wrap_converted(*op_inputs.input(k)) for k in range(2)]

  tf_internal.set_pfor_converter(outputs[0].op, convert)
  return outputs[0]
