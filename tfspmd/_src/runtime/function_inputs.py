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
as each process would hold only its part.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.core import tf_internal
from tfspmd._src.runtime import placement as placement_lib
from tfspmd._src.runtime import small_values


@dataclasses.dataclass
class _Marks:
  """What the trace of one function found."""
  laid_out_over_processes: bool = False


def mark(graph: tf.Graph, laid_out_over_processes: bool = False) -> None:
  """Marks `graph` and the functions it lies in as taking inputs on devices.

  Args:
    graph: The graph being traced: a ShardedArray's placeholder is made in
      it, or a pmap's ops go there.
    laid_out_over_processes: Whether the pmap's program lays its inputs out
      over several processes' devices, so that it needs DTensors.
  """
  while isinstance(graph, tf.Graph) and graph.building_function:
    marks = getattr(graph, "_tfspmd_function_inputs", None)
    if marks is None:
      marks = graph._tfspmd_function_inputs = _Marks()  # pylint: disable=protected-access
    marks.laid_out_over_processes |= laid_out_over_processes
    graph = getattr(graph, "outer_graph", None)


class CheckedInputSpec(tf.TensorSpec):
  """The trace type of an array tfspmd hands out: it marks the function.

  A function traced for plain tensors does not check its calls' inputs, so
  an array of this type is not taken as a subtype of a plain `TensorSpec`:
  it traces the function anew.
  """

  def placeholder_value(self, placeholder_context):
    if not placeholder_context.unnest_only:
      mark(placeholder_context.context_graph)
    return super().placeholder_value(placeholder_context)

  def is_subtype_of(self, other):
    return isinstance(other, CheckedInputSpec) and super().is_subtype_of(
        other)


class _TracedAsChecked:
  """A DTensor's `__tf_tracing_type__`: its `CheckedInputSpec`."""

  __slots__ = ("_spec",)

  def __init__(self, spec):
    self._spec = spec

  def __call__(self, context):
    del context  # unused
    return self._spec


def traced_as_checked(value: tf.Tensor) -> tf.Tensor:
  """`value`, an eager DTensor, which `tf.function` traces as checked.

  `tf.function` asks a tensor for its trace type through the tensor
  (`value.__tf_tracing_type__`), so this one DTensor answers with a
  `CheckedInputSpec`; the spec holds no reference to the tensor.
  """
  if "__tf_tracing_type__" not in value.__dict__:
    value.__tf_tracing_type__ = _TracedAsChecked(
        CheckedInputSpec(value.shape, value.dtype))
  return value


class _InputsOnOneMesh(tf_internal.FunctionType):
  """A FunctionType whose eager calls place plain tensors beside DTensors."""

  laid_out_over_processes = False

  def unpack_inputs(self, bound_parameters):
    flat = super().unpack_inputs(bound_parameters)
    if not tf.executing_eagerly():
      return flat
    meshes, folded, plain = {}, None, []
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
        meshes.setdefault(layout.partition(" mesh:")[2], position)
    if len(meshes) > 1:
      raise ValueError(self._two_meshes(bound_parameters, flat, meshes))
    if not plain:
      return flat
    if not meshes and folded is None:
      if self.laid_out_over_processes:
        raise ValueError(self._host_part(bound_parameters, plain[0]))
      return flat
    (on_mesh,) = meshes.values() or (folded,)
    mesh = dtensor.fetch_layout(flat[on_mesh]).mesh
    for position in plain:
      flat[position] = placement_lib.replicated(flat[position], mesh)
    return flat

  def _two_meshes(self, bound_parameters, flat, meshes):
    names = tf_internal.argument_of_each_input(self, bound_parameters)
    first, second = list(meshes.values())[:2]
    return (
        f"a tf.function was called with DTensors on different meshes: "
        f"argument `{names[first]}` on the devices "
        f"{_device_ids(flat[first])}, argument `{names[second]}` on "
        f"{_device_ids(flat[second])}. DTensor runs a function on one "
        f"mesh: put the arrays on one first (`tfspmd.device_put(b, "
        f"a.sharding)` for ShardedArrays), or call the function on each "
        f"mesh's arrays apart.")

  def _host_part(self, bound_parameters, position):
    name = tf_internal.argument_of_each_input(self, bound_parameters)[position]
    return (
        f"a tf.function that calls a pmap over several processes was given "
        f"a plain tensor for argument `{name}`, which is only this "
        f"process's part: pass the array the pmap takes as a ShardedArray "
        f"(an earlier pmap's result, or `tfspmd.device_put`) or its "
        f"`.dtensor_value`, or call the pmap outside the tf.function.")


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


def _device_ids(value):
  """The ids of the devices of the DTensor `value`'s mesh."""
  return [int(name.rsplit(":", 1)[1])
          for name in dtensor.fetch_layout(value).mesh.local_devices()]


def _place_inputs_of_marked(concrete_function):
  """Gives a function whose trace was marked the placing FunctionType."""
  marks = getattr(concrete_function.graph, "_tfspmd_function_inputs", None)
  if marks is None:
    return
  current = concrete_function.function_type
  placing = _InputsOnOneMesh(current.parameters.values(), current.captures,
                             return_annotation=current.output)
  placing.laid_out_over_processes = marks.laid_out_over_processes
  tf_internal.set_function_type(concrete_function, placing)


tf_internal.on_new_concrete_function(_place_inputs_of_marked)
