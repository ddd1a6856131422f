"""`tfspmd.jit`: JAX's `jax.jit` for functions over global arrays.

The function is traced once per call signature into one `tf.function`
that runs on DTensors: every argument is placed on one mesh (as its
sharding says), each pmap and shard_map inside adds its ops to the graph
and runs over the mesh's devices as the arguments' layouts say
(`pmap_in_graph`), and the results come back as `ShardedArray`s laid out
as under `jax.jit` (a shard_map's as its out_specs say, a sharding
constraint's as it says, others as DTensor's layout propagation leaves
them, which elementwise ops keep as their inputs lie; or as `out_shardings`
say), ready for the next call.
A shard_map built inside on every call, as JAX code under `jax.jit` does,
is traced with the function, not at each call.

Small replicated arguments cross the function's boundary wide and small
results are returned wide, whole on each device (`small_values`), so that
DTensor does not fold them into the program and compile it again when
they change.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import contextlib
import dataclasses
import functools
import inspect
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.arguments import arguments
from tfspmd._src.arguments import transfers
from tfspmd._src.core import function_keys
from tfspmd._src.core import lru
from tfspmd._src.core import tf_internal
from tfspmd._src.core import trace_context
from tfspmd._src.executors import dtensor_calls
from tfspmd._src.executors import dtensor_device
from tfspmd._src.executors import dtensor_values
from tfspmd._src.executors import small_values
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import mesh_context
from tfspmd._src.runtime import placement as placement_lib
from tfspmd._src.runtime.named_mesh import Mesh
from tfspmd._src.runtime.named_mesh import PartitionSpec
from tfspmd._src.runtime.named_mesh import make_mesh
from tfspmd._src.runtime.named_sharding import NamedSharding
from tfspmd._src.runtime.sharded_array import ShardedArray
from tfspmd._src.trees import tree

_do_not_convert = tf.autograph.experimental.do_not_convert


def tracing_mesh() -> Mesh | None:
  """The mesh of the `tfspmd.jit` function this thread traces, or None."""
  return trace_context.this_thread.jit_mesh


@contextlib.contextmanager
def _traced_on(mesh):
  """Within, `mesh` is the jit mesh; yields this thread's trace context.

  Its `jit_shard_map_meshes` and `jit_merged_outputs` then gather what the
  shard_maps traced within leave.
  """
  context = trace_context.this_thread
  enclosing = (context.jit_mesh, context.jit_shard_map_meshes,
               context.jit_merged_outputs)
  context.jit_mesh, context.jit_shard_map_meshes = mesh, []
  context.jit_merged_outputs = {}
  try:
    yield context
  finally:
    (context.jit_mesh, context.jit_shard_map_meshes,
     context.jit_merged_outputs) = enclosing


def _positions(value, name, count=None):
  """`value` (an int or a sequence of ints) as a tuple of positions."""
  values = (value,) if isinstance(value, (int, np.integer)) else value
  try:
    values = tuple(values)
  except TypeError:
    values = None
  if values is None or not all(
      isinstance(v, (int, np.integer)) and not isinstance(v, bool)
      for v in values):
    raise TypeError(f"jit: `{name}` must be an int or a sequence of ints, "
                    f"got {value!r}.")
  if count is None:
    return tuple(int(v) for v in values)
  for v in values:
    if not -count <= v < count:
      raise ValueError(f"jit: `{name}` holds {v}, but the function was "
                       f"called with {count} positional arguments.")
  return tuple(sorted({int(v) % count for v in values}))


def _names(value):
  """`value` (a str or a sequence of strs) as a tuple of argument names."""
  values = (value,) if isinstance(value, str) else value
  try:
    values = tuple(values)
  except TypeError:
    values = None
  if values is None or not all(isinstance(v, str) for v in values):
    raise TypeError(f"jit: `static_argnames` must be a str or a sequence of "
                    f"strs, got {value!r}.")
  return values


def _static_arguments(fun, static_argnums, static_argnames):
  """`(positions of static_argnames, {static_argnum: its name})` in `fun`.

  As `jax.jit` does, each completes the other where `fun`'s signature tells:
  a static position is static when passed by keyword too, and a static name
  when passed positionally.
  """
  try:
    parameters = inspect.signature(fun).parameters.values()
  except (TypeError, ValueError):
    return (), {}
  positional = [p for p in parameters if p.kind in (
      p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  names = {k: positional[k].name for k in static_argnums
           if 0 <= k < len(positional)
           and positional[k].kind == positional[k].POSITIONAL_OR_KEYWORD}
  positions = tuple(k for k, p in enumerate(positional)
                    if p.name in static_argnames)
  return positions, names


def _is_sharding_leaf(value):
  """Ends the walk of a shardings tree: a sharding, None, or a bare spec."""
  return value is None or isinstance(value, (NamedSharding, PartitionSpec))


@dataclasses.dataclass
class _Program:
  """One traced signature of a jitted function.

  Attributes:
    call: The program, called with the flat DTensors of the arguments.
    treedef: The output tree.
    wide: For each output leaf, whether it comes widened (`small_values`).
    shapes: For each output leaf, its global shape.
    mesh: The mesh it runs on.
    shard_map_meshes: The meshes of the shard_maps traced in it.
    merged: For each output leaf, the `NamedSharding` it takes after the
      call (a shard_map's result split over several axes in one
      dimension, which DTensor cannot lay out in the function), or None.
  """
  call: Callable = None
  treedef: Any = None
  wide: tuple = ()
  shapes: list = dataclasses.field(default_factory=list)
  mesh: Mesh = None
  shard_map_meshes: list = dataclasses.field(default_factory=list)
  merged: tuple = ()


class JittedFunction:
  """The callable `jit` returns."""

  def __init__(self, fun, in_shardings, out_shardings, static_argnums,
               donate_argnums, static_argnames=(), mesh=None):
    if not callable(fun):
      raise TypeError(f"jit: `fun` must be callable, got {fun!r}.")
    self._fun = fun
    self._in_shardings = in_shardings
    self._out_shardings = out_shardings
    self._static_argnums = _positions(static_argnums, "static_argnums")
    given_names = _names(static_argnames)
    self._named_positions, self._names_of_argnums = _static_arguments(
        fun, self._static_argnums, given_names)
    self._static_argnames = given_names + tuple(
        self._names_of_argnums.values())
    self._donate_argnums = _positions(donate_argnums, "donate_argnums")
    # The mesh every call runs on, where the caller fixes it (the VJP of a
    # call runs on its call's).
    self._fixed_mesh = mesh
    self._functions = lru.LRUCache(lru.TRACE_CACHE_SIZE)
    functools.update_wrapper(self, fun, updated=())

  def _mesh(self, leaves):
    """The mesh every argument goes on (`_DefaultMesh` where none says)."""
    if self._fixed_mesh is not None:
      return self._fixed_mesh
    for shardings in (self._in_shardings, self._out_shardings):
      for sharding in tree.flatten(shardings,
                                   is_leaf=_is_sharding_leaf)[0]:
        if isinstance(sharding, NamedSharding):
          return sharding.mesh
    context = mesh_context.get_mesh()
    if context is not None:
      return context
    for leaf in leaves:
      if isinstance(leaf, ShardedArray) and isinstance(
          leaf.sharding.mesh, Mesh):
        return leaf.sharding.mesh
    return _DefaultMesh(make_mesh((devices_lib.device_count(),), ("i",)))

  def _static_positions(self, args):
    """The positions in `args` of static arguments."""
    # A static position past the call's positional arguments is one its
    # name passes by keyword (or leaves at its default).
    in_call = tuple(k for k in self._static_argnums
                    if k >= len(args) and k in self._names_of_argnums)
    return tuple(sorted(set(_positions(
        tuple(k for k in self._static_argnums if k not in in_call),
        "static_argnums", len(args))).union(
            k for k in self._named_positions if k < len(args))))

  @_do_not_convert
  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    context = trace_context.this_thread
    if tf.inside_function() or context.frames or context.trace is not None:
      return self._inlined(args, kwargs)
    if tf_internal.tape_active():
      recorded = self._recorded(args, kwargs)
      if recorded is not None:
        return recorded
    return self._compiled(args, kwargs)

  def _compiled(self, args, kwargs):
    """The call's results, from the program traced for its signature."""
    static = self._static_positions(args)
    donated = _positions(self._donate_argnums, "donate_argnums", len(args))
    static_values = tuple((k, args[k]) for k in static)
    static_kwargs = tuple(sorted((name, kwargs[name])
                                 for name in self._static_argnames
                                 if name in kwargs))
    for where, value in ([(f"args[{k}]", v) for k, v in static_values] +
                         [(f"kwargs[{n!r}]", v) for n, v in static_kwargs]):
      try:
        hash(value)
      except TypeError:
        raise TypeError(
            f"jit: the static argument {where} must be hashable, as it keys "
            f"the traces; got a {type(value).__name__}.") from None
    kwargs = {name: value for name, value in kwargs.items()
              if name not in self._static_argnames}
    dynamic = tuple(a for k, a in enumerate(args) if k not in static)
    leaves, treedef = tree.flatten((dynamic, kwargs))
    paths = tree.leaf_paths((dynamic, kwargs), "args")
    mesh = self._mesh(leaves)
    default = isinstance(mesh, _DefaultMesh)
    mesh = mesh.mesh if default else mesh
    shardings = self._leaf_shardings(dynamic, kwargs, len(leaves))

    def arguments_on(mesh):
      placed = [self._placed(leaf, sharding, mesh, path)
                for leaf, sharding, path in zip(leaves, shardings, paths)]
      return placed, tuple(_is_small_replicated(value) for value in placed)

    placed, wide = arguments_on(mesh)
    static_key = tuple(
        (where, function_keys.static_value_key(value))
        for where, value in static_values + static_kwargs)
    key = (treedef, static_key, wide, tuple(
        (tuple(v.shape), v.dtype) for v in placed), mesh.mesh_key)
    program = self._functions.get(key)
    if program is None:
      program = self._traced(treedef, static_values, static_kwargs,
                             len(args), placed, wide, mesh)
      found = _shard_map_mesh(program, mesh) if default else None
      if found is not None:
        # As jax.jit, whose arrays lie on the mesh of the shard_map in it:
        # there its results keep their out specs. Where nothing else names
        # a mesh, the arguments (whole on each device) go on that one.
        placed, wide = arguments_on(found)
        program = self._traced(treedef, static_values, static_kwargs,
                               len(args), placed, wide, found)
      self._functions.put(key, program)
    elif program.mesh != mesh:
      placed, wide = arguments_on(program.mesh)
    mesh = program.mesh
    tensors = [value._wide_value(  # pylint: disable=protected-access
        value.placement) if is_wide else value.dtensor_value
               for value, is_wide in zip(placed, wide)]
    try:
      # The mesh is the default one for ops with no DTensor input (a
      # function of no arguments).
      outputs = dtensor_values.call_program(
          program.call, tensors, (), mesh.dtensor_mesh)
    except tf.errors.OpError:
      raise ValueError(
          f"jit: DTensor (TF {tf.__version__}) could not lower or run the "
          f"jitted function {_name(self._fun)} "
          f"on {mesh}. Call the shard_maps inside it on their own: tfspmd "
          f"then names the op DTensor refused and what to write instead."
      ) from None
    results = [_wrapped(value, shape, is_wide, mesh)
               for value, shape, is_wide in zip(outputs, program.shapes,
                                                  program.wide)]
    results = [result if sharding is None else
               transfers.device_put(result, sharding)
               for result, sharding in zip(results, program.merged)]
    result = program.treedef.unflatten(results)
    if self._out_shardings is not None:
      result = transfers.device_put(result, self._out_shardings)
    for k in donated:
      for leaf in tree.flatten(args[k])[0]:
        if isinstance(leaf, ShardedArray) and not leaf.is_deleted():
          leaf.delete()
    return result

  def _recorded(self, args, kwargs):
    """The call, recorded on the GradientTape that watches its arguments.

    The forward pass is the compiled call; its gradient is another jitted
    function on the same mesh: the vector-Jacobian product, taken with a
    GradientTape inside it (the shard_maps in the function carry their
    transposes). The tape sees the tensors and variables among the
    arguments; `ShardedArray`s and host values are constants to it, as the
    call's results are tensors (a tape records tensors only).

    Returns:
      The results as tensors, or None where the tape watches no argument.
    """
    static = self._static_positions(args)
    dynamic = tuple(a for k, a in enumerate(args) if k not in static)
    dynamic_kwargs = {name: value for name, value in kwargs.items()
                      if name not in self._static_argnames}
    leaves, treedef = tree.flatten((dynamic, dynamic_kwargs))
    sources = tuple(k for k, leaf in enumerate(leaves)
                    if isinstance(leaf, (tf.Tensor, tf.Variable)) and (
                        leaf.dtype.is_floating or leaf.dtype.is_complex))
    # Reading a variable here puts the read on the tape.
    tensors = [tf.convert_to_tensor(leaves[k]) for k in sources]
    if not tf_internal.tape_may_record(tensors):
      return None
    static_args = tuple((k, args[k]) for k in static)
    static_kwargs = tuple(sorted(
        (name, value) for name, value in kwargs.items()
        if name in self._static_argnames))
    rebuild = functools.partial(_call_arguments, treedef, static_args,
                                static_kwargs, len(args))
    mesh = self._mesh(leaves)
    vjp = self._vjp(rebuild, treedef, static_args, static_kwargs, sources,
                    mesh.mesh if isinstance(mesh, _DefaultMesh) else mesh)
    out_treedef = []

    @tf.custom_gradient
    def forward(*source_values):
      values = _with_sources(leaves, sources, source_values)
      result = self._compiled(*rebuild(values))
      out_leaves, out = tree.flatten(result)
      out_treedef.append(out)
      outputs = [tf.convert_to_tensor(leaf) for leaf in out_leaves]

      def backward(*cotangents, variables=None):
        if variables:
          raise ValueError(
              f"jit: {_name(self._fun)} reads the tf.Variables "
              f"{[v.name for v in variables]}, which it was not passed; a "
              f"GradientTape around a jitted call differentiates its "
              f"arguments only. Pass the variables as arguments, or take the "
              f"gradient inside the jitted function.")
        cotangents = [tf.zeros_like(o) if c is None else c
                      for c, o in zip(cotangents, outputs)]
        grads = vjp(values, cotangents)
        return [tf.convert_to_tensor(g) for g in grads]

      return outputs, backward

    outputs = forward(*tensors)
    return out_treedef[0].unflatten(list(outputs))

  def _vjp(self, rebuild, treedef, static_args, static_kwargs, sources, mesh):
    """The jitted vector-Jacobian product of one call signature.

    Kept per signature, so that the gradient of a call like an earlier one
    runs the program traced for that one.
    """
    key = ("vjp", treedef, tuple(
        (where, function_keys.static_value_key(value))
        for where, value in static_args + static_kwargs), sources,
           mesh.mesh_key)
    vjp = self._functions.get(key)
    if vjp is not None:
      return vjp
    fun = self._fun

    def product(values, cotangents):
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        watched = [values[k] for k in sources]
        tape.watch(watched)
        call_args, call_kwargs = rebuild(values)
        outputs = [tf.convert_to_tensor(leaf)
                   for leaf in tree.flatten(fun(*call_args, **call_kwargs))[0]]
      pairs = [(o, c) for o, c in zip(outputs, cotangents)
               if o.dtype.is_floating or o.dtype.is_complex]
      return tape.gradient([o for o, _ in pairs], watched,
                           output_gradients=[c for _, c in pairs],
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)

    vjp = JittedFunction(product, None, None, (), (), mesh=mesh)
    self._functions.put(key, vjp)
    return vjp

  def _inlined(self, args, kwargs):
    """The function called on `args` while another function traces.

    As JAX inlines a jit inside a traced function, the function's ops go
    into the trace around it: a `tfspmd.jit` function's, a pmap's or
    shard_map's, or a user's `tf.function`. In a `tfspmd.jit` function the
    shardings given lay the arguments and results out (as constraints);
    elsewhere values lie on no mesh.
    """
    if self._in_shardings is None and self._out_shardings is None:
      return self._fun(*args, **kwargs)
    context = trace_context.this_thread
    if context.jit_mesh is None or context.frames or context.trace is not None:
      raise ValueError(
          f"jit: {_name(self._fun)}, jitted with in_shardings or "
          f"out_shardings, was called inside a pmap, a shard_map or a "
          f"tf.function that is not a tfspmd.jit function, whose values lie "
          f"on no mesh. Jit it without shardings to call it there (it is "
          f"then inlined, as in JAX), or call it outside.")
    static = self._static_positions(args)
    dynamic = tuple(a for k, a in enumerate(args) if k not in static)
    dynamic_kwargs = {name: value for name, value in kwargs.items()
                      if name not in self._static_argnames}
    leaves, treedef = tree.flatten((dynamic, dynamic_kwargs))
    shardings = self._leaf_shardings(dynamic, dynamic_kwargs, len(leaves))
    placed, placed_kwargs = treedef.unflatten([
        leaf if sharding is None else transfers.device_put(leaf, sharding)
        for leaf, sharding in zip(leaves, shardings)])
    rest = iter(placed)
    call_args = [args[k] if k in static else next(rest)
                 for k in range(len(args))]
    result = self._fun(*call_args, **placed_kwargs, **{
        name: value for name, value in kwargs.items()
        if name in self._static_argnames})
    if self._out_shardings is None:
      return result
    return transfers.device_put(result, self._out_shardings)

  def _leaf_shardings(self, dynamic, kwargs, count):
    if self._in_shardings is None:
      return [None] * count
    shardings = tree.broadcast_prefix(
        (self._in_shardings, {}), (dynamic, kwargs), spec_name="in_shardings",
        root="args", is_spec_leaf=_is_sharding_leaf)
    for sharding in shardings:
      if sharding is not None and not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"jit: `in_shardings` holds {sharding!r}; give NamedShardings "
            f"(NamedSharding(mesh, spec)) or None.")
    return shardings

  @staticmethod
  def _placed(leaf, sharding, mesh, path):
    """`leaf` as a ShardedArray on `mesh` (as `sharding` says, if given)."""
    value = arguments.to_array_leaf(leaf, path)
    if sharding is not None:
      if sharding.mesh != mesh:
        raise ValueError(
            f"jit: the in_shardings run over the meshes {sharding.mesh} and "
            f"{mesh}; one function runs on one mesh.")
      return transfers.device_put(value, sharding)
    if isinstance(value, ShardedArray):
      current = value.sharding
      if current.mesh == mesh and value.placement.merged is None:
        return value
      if current.mesh == mesh and value.placement.merged is not None:
        # DTensor's function takes DTensors of one mesh: a dimension split
        # over several axes lies on a merged one, so it goes in whole.
        return transfers.device_put(value, NamedSharding(mesh,
                                                          PartitionSpec()))
      if set(value.devices()) == set(mesh.devices.flat):
        return transfers.device_put(value, NamedSharding(mesh,
                                                          PartitionSpec()))
      raise ValueError(
          f"jit: {path} lies on the devices of {current.mesh}, but the "
          f"function runs on {mesh}; device_put it onto the function's mesh "
          f"first.")
    return transfers.device_put(value, NamedSharding(mesh, PartitionSpec()))

  def _traced(self, treedef, static_values, static_kwargs, count, placed,
              wide, mesh):
    """The `_Program` of one call signature."""
    fun, program = self._fun, _Program(mesh=mesh)
    named, mesh = mesh, mesh.dtensor_mesh

    def body(*tensors):
      tensors = [small_values.narrow(t, value.shape.as_list()) if is_wide
                 else t for t, value, is_wide in zip(tensors, placed, wide)]
      dynamic, kwargs = treedef.unflatten(tensors)
      rest = iter(dynamic)
      given = dict(static_values)
      call_args = [given[k] if k in given else next(rest)
                   for k in range(count)]
      with _traced_on(named) as context:
        result = fun(*call_args, **kwargs, **dict(static_kwargs))
        program.shard_map_meshes = list(context.jit_shard_map_meshes)
        merged_outputs = dict(context.jit_merged_outputs)
      leaves, out_treedef = tree.flatten(result)
      program.merged = tuple(
          merged_outputs.get(leaf.ref()) if tf.is_tensor(leaf) else None
          for leaf in leaves)
      outputs, out_wide, shapes = [], [], []
      for leaf in leaves:
        tensor = tf.convert_to_tensor(leaf)
        shapes.append(tensor.shape)
        small = tensor.shape.is_fully_defined() and small_values.is_small(
            tensor.shape.as_list(), tensor.dtype)
        out_wide.append(small)
        if small:
          # Whole on each device first: a small result may lie split.
          whole = dtensor.relayout(tensor, dtensor.Layout.replicated(
              mesh, tensor.shape.rank))
          tensor = dtensor.relayout(small_values.widen(whole),
                                    small_values.wide_layout(mesh))
        outputs.append(tensor)
      program.treedef, program.wide = out_treedef, tuple(out_wide)
      program.shapes = shapes
      return outputs

    function = tf.function(body, autograph=False)
    specs = [tf.TensorSpec((small_values.WIDTH,) if is_wide else
                           tuple(value.dtensor_value.shape), value.dtype)
             for value, is_wide in zip(placed, wide)]
    concrete = function.get_concrete_function(*specs)
    program.call = dtensor_calls.flat_caller(concrete, concrete.captured_inputs)
    return program


@dataclasses.dataclass(frozen=True)
class _DefaultMesh:
  """The mesh of a call whose shardings, context and arguments name none."""
  mesh: Mesh


def _shard_map_mesh(program, mesh):
  """The one mesh, other than `mesh`, of the shard_maps in `program`, or None.

  Only a mesh of the same devices: the arguments go on it instead.
  """
  meshes = set(program.shard_map_meshes)
  if len(meshes) != 1:
    return None
  (found,) = meshes
  if found == mesh or set(found.devices.flat) != set(mesh.devices.flat):
    return None
  return found


def _call_arguments(treedef, static_args, static_kwargs, count, values):
  """`(args, kwargs)` of a call: the dynamic leaves `values` and statics."""
  dynamic, kwargs = treedef.unflatten(list(values))
  rest, given = iter(dynamic), dict(static_args)
  return ([given[k] if k in given else next(rest) for k in range(count)],
          {**kwargs, **dict(static_kwargs)})


def _with_sources(leaves, sources, values):
  """`leaves` with the leaves at positions `sources` replaced by `values`."""
  replaced = list(leaves)
  for k, value in zip(sources, values):
    replaced[k] = value
  return replaced


def _name(fun):
  return getattr(fun, "__qualname__", None) or repr(fun)


def _is_small_replicated(value):
  return small_values.is_small_replicated(value.placement.spec, value.shape,
                                          value.dtype)


def _wrapped(value, shape, wide, mesh):
  """The DTensor output `value` as a `ShardedArray` on `mesh`."""
  layout = dtensor.fetch_layout(value)
  if layout.mesh != mesh.dtensor_mesh:
    raise ValueError(
        f"jit: a result lies on the DTensor mesh {layout.mesh.dim_names}, not "
        f"on the function's mesh {mesh}: a pmap inside runs on a mesh of its "
        f"own; use shard_map over the function's mesh inside jit.")
  spec = (None,) * shape.rank if wide else tuple(
      None if dim == dtensor.UNSHARDED else dim
      for dim in layout.sharding_specs)
  placement = placement_lib.Placement(mesh.mesh_key, spec)
  return ShardedArray(value, placement, placement.local_shape(
      tuple(shape.as_list())), value.dtype, wide=wide)


def jit(fun: Callable[..., Any] | None = None, *,
        in_shardings: Any = None, out_shardings: Any = None,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = ()) -> Any:
  """JAX's `jax.jit`: `fun` traced once per signature, run on the devices.

  Every array argument is placed on one mesh: the mesh of the shardings
  given, else the context's (`set_mesh`, `with mesh:`), else that of the
  first `ShardedArray` argument, else that of the shard_maps inside where
  they all run over one mesh of every device (traced a second time then),
  else one axis 'i' over every device. The function runs as one
  `tf.function` on DTensors: a `shard_map` over that mesh inside (built
  anew on every call, as JAX code builds it) runs over the devices, traced
  once with the function. Results are `ShardedArray`s laid out as
  `jax.jit` lays them out: a shard_map's result as its out_specs say
  (`P('i')` stays split), a `lax.with_sharding_constraint`'s as it says,
  and other values as the program leaves them (elementwise ops keep their
  inputs' layouts); they go into the next call with no copy. Called
  while another function traces (a `tfspmd.jit` function, a shard_map's
  or pmap's function, a `tf.function`), the function is inlined into that
  trace, as in JAX; there its `in_shardings` and `out_shardings` are
  sharding constraints, inside a `tfspmd.jit` only.
  A `tf.GradientTape` watching tensor or variable arguments records the
  call (its results are then tensors), and its gradient runs as another
  jitted function, the call's vector-Jacobian product.

  Args:
    fun: The function, of arrays (pytrees of them) to arrays.
    in_shardings: A `NamedSharding` per positional argument (or a tree
      prefix of them; None for an argument to take as it lies, or whole on
      each device if it is a host value).
    out_shardings: Shardings of the results (a tree prefix), or None.
    static_argnums: Positions of hashable arguments that are Python values
      the function is traced for, one trace per value.
    static_argnames: Names of such arguments, passed by keyword. As in
      `jax.jit`, each of the two completes the other through `fun`'s
      signature: a static position is static when passed by keyword too.
    donate_argnums: Positions of arguments whose `ShardedArray`s are freed
      after the call.

  Returns:
    The jitted function (or a decorator, without `fun`).

  Example:
    >>> import numpy as np, tensorflow as tf, tfspmd
    >>> from tfspmd import P, lax
    >>> mesh = tfspmd.make_mesh((8,), ('data',))
    >>> @tfspmd.jit
    ... def mean_row(x):
    ...   total = tfspmd.shard_map(lambda b: lax.psum(tf.reduce_sum(b, 0),
    ...                                               'data'),
    ...                          mesh=mesh, in_specs=P('data'),
    ...                          out_specs=P())(x)
    ...   return total / x.shape[0]
    >>> x = tfspmd.device_put(np.arange(16.).reshape(8, 2),
    ...                       tfspmd.NamedSharding(mesh, P('data')))
    >>> print(mean_row(x))
    [7. 8.]
  """
  if fun is None:
    return functools.partial(jit, in_shardings=in_shardings,
                             out_shardings=out_shardings,
                             static_argnums=static_argnums,
                             static_argnames=static_argnames,
                             donate_argnums=donate_argnums)
  return JittedFunction(fun, in_shardings, out_shardings, static_argnums,
                        donate_argnums, static_argnames)
