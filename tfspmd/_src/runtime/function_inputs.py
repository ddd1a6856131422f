"""The inputs of a user's tf.function that takes ShardedArrays or calls a pmap.

DTensor runs a function on one mesh and takes DTensors only: a plain tensor
beside a DTensor fails the call ("expecting a DTensor", TF 2.21) unless it
is a scalar or a small integer tensor, and DTensors of two meshes fail in
its mesh propagation. `tf.function` casts each argument on its own and
traces a DTensor and a plain tensor alike, so no argument's trace type sees
the mix; a function's `FunctionType` sees every input of a call at once
(`unpack_inputs`). A function whose trace took a ShardedArray or its
`dtensor_value` (`CheckedInputSpec`), or called a pmap, is marked (`mark`),
and its concrete functions get a `FunctionType`
that, at each eager call given a DTensor, copies the plain tensors whole to
every device of the DTensors' mesh, as `tfspmd.jit` places them, and names
the arguments given on two meshes. Calls given no DTensor run as before: on
one device in one process; with several processes such a call is refused,
as each process would hold only its part. A marked function that writes a
variable is refused at its first call: DTensor copies the variable to each
device and would update every copy (the host executor gives functions the
arrays' host tensors, so it never marks them).
"""

from __future__ import annotations

import dataclasses
import re

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import tf_internal
from tfspmd._src.executors import small_values
from tfspmd._src.runtime import placement as placement_lib


@dataclasses.dataclass
class _Marks:
  """What the trace of one function found."""
  laid_out_over_processes: bool = False
  takes_arrays: bool = False


def mark(graph: tf.Graph, laid_out_over_processes: bool = False,
         takes_arrays: bool = False) -> None:
  """Marks `graph` and the functions it lies in as taking inputs on devices.

  Args:
    graph: The graph being traced: a ShardedArray's placeholder is made in
      it, or a pmap's ops go there.
    laid_out_over_processes: Whether the pmap's program lays its inputs out
      over several processes' devices, so that it needs DTensors.
    takes_arrays: Whether the function takes a DTensor argument, so that
      it runs on every device of its mesh.
  """
  while isinstance(graph, tf.Graph) and graph.building_function:
    marks = getattr(graph, "_tfspmd_function_inputs", None)
    if marks is None:
      marks = graph._tfspmd_function_inputs = _Marks()  # pylint: disable=protected-access
    marks.laid_out_over_processes |= laid_out_over_processes
    marks.takes_arrays |= takes_arrays
    graph = getattr(graph, "outer_graph", None)


class CheckedInputSpec(tf.TensorSpec):
  """The trace type of an array tfspmd hands out: it marks the function.

  A function traced for plain tensors does not check its calls' inputs, so
  an array of this type is not taken as a subtype of a plain `TensorSpec`:
  it traces the function anew.
  """

  def placeholder_value(self, placeholder_context):
    if not placeholder_context.unnest_only:
      mark(placeholder_context.context_graph, takes_arrays=True)
    return super().placeholder_value(placeholder_context)

  def is_subtype_of(self, other):
    return isinstance(other, CheckedInputSpec) and super().is_subtype_of(
        other)


class _TracedAsChecked:
  """A DTensor's `__tf_tracing_type__`: a new `CheckedInputSpec` of it.

  New at each trace: TensorFlow names the spec of a tensor a function
  captures, and a shared one would carry that name into other traces.
  """

  __slots__ = ("_shape", "_dtype")

  def __init__(self, shape, dtype):
    self._shape, self._dtype = shape, dtype

  def __call__(self, context):
    del context  # unused
    return CheckedInputSpec(self._shape, self._dtype)


def traced_as_checked(value: tf.Tensor) -> tf.Tensor:
  """`value`, an eager DTensor, which `tf.function` traces as checked.

  `tf.function` asks a tensor for its trace type through the tensor
  (`value.__tf_tracing_type__`), so this one DTensor answers with a
  `CheckedInputSpec`; the answer holds no reference to the tensor.
  """
  if "__tf_tracing_type__" not in value.__dict__:
    value.__tf_tracing_type__ = _TracedAsChecked(value.shape, value.dtype)
  return value


class _InputsOnOneMesh(tf_internal.FunctionType):
  """A FunctionType whose eager calls place plain tensors beside DTensors."""

  laid_out_over_processes = False
  # (mesh text, a DTensor on it) of a DTensor the function closes over.
  captured = None

  def unpack_inputs(self, bound_parameters):
    flat = super().unpack_inputs(bound_parameters)
    if not tf.executing_eagerly():
      return flat
    meshes, folded, plain = {}, None, []
    if self.captured is not None:
      meshes[self.captured[0]] = None
    for position, value in enumerate(flat):
      if not isinstance(value, tf.Tensor) or value.dtype in (
          tf.resource, tf.variant):
        continue
      layout = tf_internal.dtensor_layout_text(value)
      if layout is None:
        if not _copied_by_dtensor(value):
          plain.append(position)
      elif _folded_by_dtensor(value, layout):
        folded = position if folded is None else folded
      else:
        meshes.setdefault(_mesh_text(layout), position)
    if len(meshes) > 1:
      raise ValueError(self._two_meshes(bound_parameters, flat, meshes))
    if not plain:
      return flat
    if not meshes and folded is None:
      if self.laid_out_over_processes:
        raise ValueError(self._host_part(bound_parameters, plain[0]))
      return flat
    (on_mesh,) = meshes.values() or (folded,)
    on = self.captured[1] if on_mesh is None else flat[on_mesh]
    mesh = dtensor.fetch_layout(on).mesh
    for position in plain:
      flat[position] = placement_lib.replicated(flat[position], mesh)
    return flat

  def _two_meshes(self, bound_parameters, flat, meshes):
    names = tf_internal.argument_of_each_input(self, bound_parameters)

    def described(position):
      if position is None:
        return (f"a DTensor the function closes over, "
                f"{_mesh_words(self.captured[1])}")
      return f"argument `{names[position]}`, {_mesh_words(flat[position])}"

    first, second = list(meshes.values())[:2]
    return (
        f"a tf.function was called with DTensors on different meshes: "
        f"{described(first)}, and {described(second)}. DTensor runs a "
        f"function on one mesh: put the arrays on one first "
        f"(`tfspmd.device_put(b, a.sharding)` for ShardedArrays), or call "
        f"the function on each mesh's arrays apart.")

  def _host_part(self, bound_parameters, position):
    name = tf_internal.argument_of_each_input(self, bound_parameters)[position]
    return (
        f"a tf.function that calls a pmap over several processes was given "
        f"a plain tensor for argument `{name}`, which is only this "
        f"process's part: pass the array the pmap takes as a ShardedArray "
        f"(an earlier pmap's result, or `tfspmd.device_put`) or its "
        f"`.dtensor_value`, or call the pmap outside the tf.function.")


def _mesh_text(layout):
  """The mesh part of a DTensor layout's text."""
  return layout.partition(" mesh:")[2]


def _copied_by_dtensor(value):
  """Whether DTensor copies `value` to the mesh itself (scalars, strings)."""
  return value.shape.rank == 0 or value.dtype == tf.string


def _folded_by_dtensor(value, layout):
  """Whether DTensor makes the DTensor `value` a constant of the function.

  Such a value lies on no mesh there, so it may come from any.
  """
  specs = layout.partition(" mesh:")[0].partition("sharding_specs:")[2]
  return (all(spec in ("unsharded", "") for spec in specs.split(",")) and
          small_values.is_small(value.shape, value.dtype))


def _mesh_words(value):
  """The mesh of the DTensor `value` in words, for messages."""
  mesh = dtensor.fetch_layout(value).mesh
  dims = ", ".join(f"{name}={mesh.dim_size(name)}" for name in mesh.dim_names)
  devices = [name.rsplit("/device:", 1)[1] for name in mesh.local_devices()]
  return f"on a mesh ({dims}) of {', '.join(devices)}"


def _captured_dtensor(concrete_function):
  """(mesh text, tensor) of a DTensor `concrete_function` closes over."""
  for captured in concrete_function.graph.external_captures:
    if not isinstance(captured, tf.Tensor) or tf.is_symbolic_tensor(captured):
      continue
    layout = tf_internal.dtensor_layout_text(captured)
    if layout is not None and not _folded_by_dtensor(captured, layout):
      return _mesh_text(layout), captured
  return None


_VARIABLE_WRITES = re.compile(
    r"^(Assign(Add|Sub)?VariableOp|Resource(Sparse)?Apply\w+|"
    r"ResourceScatter\w+|ResourceStridedSliceAssign)$")


def _written_variables(graph):
  """The names of the variables ops of `graph` (or functions it calls) write.

  A write inside a loop, a branch or a call names the variables that op is
  given.
  """
  variable_of = {}
  handles = {id(getattr(v, "handle", None)): v for v in graph.variables}
  for external, internal in graph.captures:
    if id(external) in handles:
      variable_of[internal.ref()] = handles[id(external)]
  writing_functions = {
      function.signature.name for function in
      graph.as_graph_def().library.function
      if any(_VARIABLE_WRITES.match(node.op) for node in function.node_def)}
  written = []
  for op in graph.get_operations():
    if _VARIABLE_WRITES.match(op.type):
      given = op.inputs[:1]
    elif any(attr.func.name in writing_functions or any(
        f.name in writing_functions for f in attr.list.func)
             for attr in op.node_def.attr.values()):
      given = op.inputs
    else:
      continue
    for value in given:
      variable = variable_of.get(value.ref())
      if variable is not None and variable.name not in written:
        written.append(variable.name)
  if not written and writing_functions:
    written.append("a variable")
  return written


def _check_no_variable_writes(concrete_function):
  """Raises if a function run on every device of a mesh writes a variable.

  DTensor copies a plain variable to each device of the mesh and runs the
  function's update on each copy: it would change once per device.
  """
  written = _written_variables(concrete_function.graph)
  if written:
    raise ValueError(
        f"the tf.function {concrete_function.graph.name!r} was given "
        f"ShardedArrays (or DTensors) and runs on every device of their "
        f"mesh, so its update of {', '.join(map(repr, written))} would "
        f"happen once per device. Compute the new values in the function "
        f"and assign them outside it (`v.assign(step(x))`), or give it "
        f"plain tensors (`np.asarray(array)`), which run on one device.")


def _place_inputs_of_marked(concrete_function):
  """Gives a function whose trace was marked the placing FunctionType."""
  marks = getattr(concrete_function.graph, "_tfspmd_function_inputs", None)
  if marks is None:
    return
  captured = _captured_dtensor(concrete_function)
  if marks.takes_arrays or captured is not None:
    _check_no_variable_writes(concrete_function)
  current = concrete_function.function_type
  placing = _InputsOnOneMesh(current.parameters.values(), current.captures,
                             return_annotation=current.output)
  placing.laid_out_over_processes = marks.laid_out_over_processes
  placing.captured = captured
  tf_internal.set_function_type(concrete_function, placing)


tf_internal.on_new_concrete_function(_place_inputs_of_marked)
