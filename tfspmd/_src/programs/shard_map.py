"""shard_map: the per-device program over a mesh of named axes.

`shard_map(f, mesh=..., in_specs=..., out_specs=...)` splits each global
input into blocks as its `PartitionSpec` says, runs `f` on every device's
blocks (with the collectives of `tfspmd.lax` over the mesh's axis names),
and joins the blocks `f` returns into global results as `out_specs` say.

It is one pmap per mesh axis, nested in the mesh's axis order. Each input is
first reshaped so that every mesh axis naming one of its dimensions is an
axis of its own, just before the block along that dimension (a dimension of
size 8 split over 'data' of size 2 becomes [2, 4]); the pmap of each mesh
axis maps over that axis (or broadcasts the input along a mesh axis its
spec does not name), so `f` sees the blocks. The results come back the
same way and are reshaped into the global arrays, whose DTensors are split
over the mesh dimensions the out specs name. Each pmap's mesh dimension is
named as the mesh names its axis (`Mesh.dim_names`), so the program runs on
`mesh.dtensor_mesh` itself. An output whose spec leaves a mesh axis out
must be the same along it: that pmap returns it with out_axes=None, which
checks it (with `check_vma=False` it takes the first device's instead). A
GradientTape around the call records it with its own VJP, a shard_map of
`f`'s per-device VJP (`shard_map_gradient`). With several processes each
passes its part of every input, placed as the global array
(`shard_map_processes`), and the pmaps take global arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Set as AbstractSet
import functools
import math
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src.arguments import arguments
from tfspmd._src.arguments import transfers
from tfspmd._src.core import compile_log
from tfspmd._src.core import function_keys
from tfspmd._src.core import stacking
from tfspmd._src.core import tf_internal
from tfspmd._src.core import trace_context
from tfspmd._src.executors import dtensor_values
from tfspmd._src.programs import pmap as pmap_lib
from tfspmd._src.programs import pmap_options
from tfspmd._src.programs import shard_map_gradient
from tfspmd._src.runtime import array_ops
from tfspmd._src.runtime import axis_env
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import mesh_context
from tfspmd._src.runtime import named_mesh
from tfspmd._src.runtime import named_sharding
from tfspmd._src.runtime import placement as placement_lib
from tfspmd._src.runtime import shard_map_processes
from tfspmd._src.runtime.named_mesh import Mesh
from tfspmd._src.runtime.named_mesh import PartitionSpec
from tfspmd._src.runtime.sharded_array import ShardedArray
from tfspmd._src.trees import tree


def _is_spec(value):
  return value is None or isinstance(value, PartitionSpec)


def _as_spec(value):
  return PartitionSpec() if value is None else value


def _map_specs(specs, function, name):
  """`specs` with each PartitionSpec (or None) leaf replaced by `function(spec)`.

  The containers are any pytree's, classes registered with
  `tfspmd.tree_util` included, as in JAX.
  """
  leaves, treedef = tree.flatten(specs, is_leaf=_is_spec)
  for leaf in leaves:
    if not _is_spec(leaf):
      raise TypeError(
          f"shard_map: `{name}` must hold PartitionSpecs (tfspmd.P(...)) in "
          f"pytrees (tuples, lists, dicts, registered classes), got "
          f"{type(leaf).__name__} {leaf!r} in {specs!r}.")
  return treedef.unflatten([function(_as_spec(leaf)) for leaf in leaves])


def _mesh_axis_position(spec, names, level):
  """Where the axis of mesh axis `names[level]` is in an expanded value.

  Each pmap level sees the expanded value without the axes of the levels
  outside it: an input once they have taken theirs, an output before they
  insert theirs. So the position counts the named axes of this level and
  the inner ones, and the blocks. None if the spec does not name the axis.
  """
  present = set(names[level:])
  position = 0
  for dimension in range(len(spec)):
    for name in spec.axes_of(dimension):
      if name == names[level]:
        return position
      if name in present:
        position += 1
    position += 1
  return None


def _check_spec(spec, rank, mesh, path, argument):
  """Raises unless `spec` can split a value of rank `rank` over `mesh`."""
  if len(spec) > rank:
    raise ValueError(
        f"shard_map: {argument} spec {spec} for {path} has {len(spec)} "
        f"entries, but the value has rank {rank}; give at most one entry per "
        f"dimension.")
  named_mesh.check_spec_axes(spec, mesh,
                             f"shard_map: {argument} spec {spec} for {path}")


def _expanded_shape(shape, spec, mesh, path):
  """`shape` with each named mesh axis split out just before its block.

  A size may be a scalar tensor: one a serving signature leaves open, which
  a dimension no mesh axis splits keeps.
  """
  expanded = []
  for dimension, size in enumerate(shape):
    names = spec.axes_of(dimension)
    count = math.prod(mesh.shape[name] for name in names)
    if not isinstance(size, int):
      if names:
        raise ValueError(
            f"shard_map: dimension {dimension} of {path} is split over the "
            f"mesh axes {names} by the in spec {spec}, so its size must be "
            f"known when the function traces, but it is open (None, as an "
            f"input_signature may leave it). Give it a fixed size; "
            f"dimensions no mesh axis splits may stay open.")
      expanded.append(size)
      continue
    if size % count:
      sizes = " x ".join(f"{name!r} ({mesh.shape[name]})" for name in names)
      raise ValueError(
          f"shard_map: dimension {dimension} of {path} has size {size}, which "
          f"the in spec {spec} splits over {sizes}: {size} is not divisible "
          f"by {count}.")
    expanded += [mesh.shape[name] for name in names] + [size // count]
  return expanded


def _expand_input(value, spec, mesh, path):
  value = arguments.to_array_leaf(value, path)
  rank = len(value.shape)
  _check_spec(spec, rank, mesh, path, "in")
  if isinstance(value, ShardedArray):
    if _is_whole_on_each_device(value) and not _names_axes(spec, rank):
      # Goes into the program as it is (held wide if small: `small_values`).
      return value
    whole = value._held_on_host()  # pylint: disable=protected-access
    # The host executor's array: its expanded form is a reshape in memory.
    value = value.dtensor_value if whole is None else whole
  if _is_host_part(value):
    if isinstance(value, tf.Tensor):
      value = value.numpy()
    return shard_map_processes.place_part(np.asarray(value), spec, mesh, path)
  shape = _expanded_shape(
      stacking.sizes(value) if isinstance(value, tf.Tensor) else
      tuple(value.shape), spec, mesh, path)
  if isinstance(value, np.ndarray):
    return value.reshape(shape)
  # A DTensor's reshape is a call into DTensor's device.
  return dtensor_values.entered(_expanded_tensor, value, spec, mesh, rank,
                                shape, path)


def _expanded_tensor(value, spec, mesh, rank, shape, path):
  """`_expand_input` of a tensor: `value` reshaped to `shape`."""
  if (_merges_axes(spec, rank) and not tf.inside_function() and
      dtensor.is_dtensor(value)):
    merged = _merged_placement(spec, mesh, value.shape, path)
    if dtensor.fetch_layout(value) == merged.layout:
      # Laid out as the spec says (an earlier result): every device holds
      # its block already.
      expanded = _expanded_placement(spec, mesh, rank)
      return placement_lib.moved_blocks(value, merged, expanded, shape)
  return tf.reshape(value, shape)


def _names_axes(spec, rank):
  """Whether `spec` splits any of `rank` dimensions over mesh axes."""
  return any(spec.axes_of(dimension) for dimension in range(rank))


def _is_whole_on_each_device(value):
  """Whether every device holds the whole of the ShardedArray `value`."""
  return not any(dim is not None for dim in value.placement.spec)


def _merges_axes(spec, rank):
  """Whether `spec` splits one of `rank` dimensions over several axes."""
  return any(len(spec.axes_of(dimension)) > 1 for dimension in range(rank))


def _merged_placement(spec, mesh, shape, path):
  """Where a value of `shape` lies as `spec` says, on its merged mesh."""
  return named_sharding.placement_of(named_sharding.NamedSharding(mesh, spec),
                                     tuple(shape), path)


def _expanded_placement(spec, mesh, rank):
  """Where a value of rank `rank` lies in its expanded form on `mesh`.

  Each mesh axis `spec` names is an axis of its own, split over its mesh
  dimension, just before the block it splits.
  """
  dim_of = dict(zip(mesh.axis_names, mesh.dim_names))
  split = []
  for dimension in range(rank):
    axes = spec.axes_of(dimension)
    split += [dim_of[name] for name in axes] + [None]
  return placement_lib.Placement(mesh.mesh_key, tuple(split))


def _is_host_part(value):
  """Whether `value` is one process's part of an input of several processes.

  A DTensor (an earlier result, or a tensor traced in a user's tf.function)
  is the global array; a host value is this process's part.
  """
  if devices_lib.process_count() == 1 or tf.inside_function():
    return False
  return not (isinstance(value, tf.Tensor) and dtensor.is_dtensor(value))


def _join_output(value, spec, mesh):
  """The global array of the expanded result `value`.

  A ShardedArray gives a ShardedArray split as `spec` says; a tensor (what
  pmap returns inside a user's tf.function while a GradientTape records)
  gives a tensor, which the tape can follow. A dimension split over
  several mesh axes lies on a DTensor mesh of the same devices whose one
  dimension merges them (`named_sharding.merged_mesh_key`): a DTensor
  layout splits a dimension over one mesh dimension.
  """
  if (isinstance(value, ShardedArray) and _is_whole_on_each_device(value) and
      not _names_axes(spec, len(spec))):
    # Nothing to join: each device holds the result whole, as returned.
    return value
  dim_of = dict(zip(mesh.axis_names, mesh.dim_names))
  # The global shape: a ShardedArray's own is this process's part's. The
  # host executor's arrays are whole in one process.
  whole = (value._held_on_host() if isinstance(value, ShardedArray)  # pylint: disable=protected-access
           else None)
  global_value = (value if not isinstance(value, ShardedArray) else
                  whole if whole is not None else value.dtensor_value)
  shape = stacking.sizes(global_value)
  named = sum(len(spec.axes_of(d)) for d in range(len(spec)))
  rank = len(shape) - named
  merged, split, position = [], [], 0
  for dimension in range(rank):
    axes = spec.axes_of(dimension)
    merged.append(math.prod(shape[position:position + len(axes) + 1]))
    split.append(dim_of[axes[0]] if axes else dtensor.UNSHARDED)
    position += len(axes) + 1
  if not isinstance(value, ShardedArray):
    return _joined_in_graph(tf.reshape(value, merged), spec, mesh, rank)
  if whole is not None:
    # The host executor's result: joined in memory, laid out as `spec` says.
    target = (_merged_placement(spec, mesh, merged, "output")
              if _merges_axes(spec, rank) else placement_lib.Placement(
                  value.placement.mesh_key,
                  tuple(None if dim == dtensor.UNSHARDED else dim
                        for dim in split)))
    return ShardedArray.on_host(tf.reshape(whole, merged), target, merged,
                                value.dtype)
  # Each step below is a call into DTensor's device.
  return dtensor_values.entered(_joined_dtensor, value, global_value, spec,
                                mesh, rank, merged, split)


def _joined_in_graph(joined, spec, mesh, rank):
  """The joined result `joined` of a traced call, laid out as `spec` says.

  In a `tfspmd.jit` function over the shard_map's mesh the program runs on
  DTensors, and the result keeps the shard_map's out sharding, as under
  `jax.jit`; DTensor's layout propagation alone would leave it as the
  inputs lay (whole on every device for host inputs). A dimension split
  over several axes cannot lie so on the function's mesh: the jit lays
  out such a result after the call, where the function returns it as it
  is. Elsewhere (a user's `tf.function`) values lie on no mesh.
  """
  context = trace_context.this_thread
  if (context.jit_mesh is None or context.frames or
      context.trace is not None):
    return joined
  context.jit_shard_map_meshes.append(mesh)
  if context.jit_mesh != mesh:
    return joined
  if _merges_axes(spec, rank):
    context.jit_merged_outputs[joined.ref()] = named_sharding.NamedSharding(
        mesh, spec)
    return joined
  return transfers.laid_out_in_jit(joined, spec, mesh, "output", "shard_map")


def _joined_dtensor(value, global_value, spec, mesh, rank, merged, split):
  """`_join_output` of the DTensor `global_value` of the ShardedArray `value`."""
  if _merges_axes(spec, rank):
    # Each device's block of the expanded result is its block of the
    # global array: it moves onto the merged mesh where it is. A pmap
    # inside `f` adds mesh dimensions of its own, along which the relayout
    # leaves each block whole.
    expanded = placement_lib.Placement(
        value.placement.mesh_key, _expanded_placement(spec, mesh, rank).spec)
    if dtensor.fetch_layout(global_value) != expanded.layout:
      global_value = dtensor.relayout(global_value, expanded.layout)
    target = _merged_placement(spec, mesh, merged, "output")
    joined = placement_lib.moved_blocks(global_value, expanded, target,
                                        merged)
    return ShardedArray(joined, target, target.local_shape(merged),
                        joined.dtype)
  joined = tf.reshape(global_value, merged)
  # DTensor's reshape leaves a dimension split over an inner mesh axis
  # replicated; going back to the split is a local slice.
  layout = dtensor.Layout(split, value.placement.mesh)
  if dtensor.fetch_layout(joined) != layout:
    joined = dtensor.relayout(joined, layout)
  return array_ops.wrap(joined, value)


def _checked_in_specs(fun, in_specs, out_specs, check_vma):
  """`in_specs` as a spec tree of the arguments, once the arguments check."""
  if not callable(fun):
    raise TypeError(f"shard_map: `f` must be callable, got {fun!r}.")
  if not isinstance(check_vma, bool):
    raise TypeError(f"shard_map: `check_vma` must be True or False, got "
                    f"{check_vma!r}.")
  if isinstance(in_specs, list):
    # As in JAX, whose spec tree is a prefix of the tuple of arguments.
    written = ", ".join(map(repr, in_specs))
    raise ValueError(
        f"shard_map: in_specs is a list, [{written}]; in_specs gives one "
        f"spec per positional argument in a tuple, as in JAX: write "
        f"in_specs=({written}{',' if len(in_specs) == 1 else ''}) (a list "
        f"argument takes a list inside that tuple).")
  if not (_is_spec(in_specs) or isinstance(in_specs, tuple)):
    in_specs = (in_specs,)  # the spec tree of a single argument
  # The spec trees are checked now, their leaves against each value.
  _map_specs(in_specs, lambda s: s, "in_specs")
  _map_specs(out_specs, lambda s: s, "out_specs")
  return in_specs


class ShardMappedFunction:
  """The callable `shard_map` returns."""

  def __init__(self, fun, mesh, in_specs, out_specs, check_vma):
    in_specs = _checked_in_specs(fun, in_specs, out_specs, check_vma)
    if not isinstance(mesh, Mesh):
      raise TypeError(
          f"shard_map: `mesh` must be a tfspmd.Mesh (tfspmd.make_mesh(...)), "
          f"got {type(mesh).__name__}.")
    self._fun = fun
    self._mesh = mesh
    self._in_specs = in_specs
    self._out_specs = out_specs
    self._check_vma = check_vma
    self._mapped = self._nest(0)
    self._gradients = shard_map_gradient.Gradients(
        lambda f, in_specs, out_specs: ShardMappedFunction(
            f, mesh, in_specs, out_specs, check_vma), fun, mesh)
    functools.update_wrapper(self, fun, updated=())

  def _nest(self, level):
    """The pmap of mesh axis `level`, around those of the inner axes."""
    names = self._mesh.axis_names
    if level == len(names):
      return self._per_device
    def position(spec):
      return _mesh_axis_position(spec, names, level)

    in_axes = _map_specs(self._in_specs, position, "in_specs")
    out_axes = _map_specs(self._out_specs, position, "out_specs")
    return pmap_lib.PmappedFunction(pmap_options.checked_options(
        self._nest(level + 1), axis_name=names[level], in_axes=in_axes,
        out_axes=out_axes, axis_size=self._mesh.shape[names[level]],
        level=pmap_options.ShardMapLevel(
            mesh_dim=self._mesh.dim_names[level],
            devices=tuple(self._mesh.devices.flat) if level == 0 else None,
            check_invariant=self._check_vma,
            function_name=getattr(self._fun, "__qualname__", None) or repr(
                self._fun))))

  def _per_device(self, *blocks):
    result = self._fun(*blocks)
    leaves, _ = tree.flatten(result)
    specs = tree.broadcast_prefix(self._out_specs, result,
                                  spec_name="out_specs", root="output",
                                  is_spec_leaf=_is_spec)
    for leaf, spec, path in zip(leaves, specs, tree.leaf_paths(result,
                                                                "output")):
      rank = len(tf.convert_to_tensor(leaf).shape)
      _check_spec(_as_spec(spec), rank, self._mesh, path, "out")
      if devices_lib.process_count() > 1:
        shard_map_processes.check_spec(_as_spec(spec), self._mesh, path,
                                       "out")
    return result

  @tf.autograph.experimental.do_not_convert
  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if kwargs:
      raise TypeError(
          f"shard_map: pass the arguments of the mapped function by position "
          f"(in_specs match them in order), got keywords {sorted(kwargs)}.")
    if axis_env.frames() or axis_env.trace_state() is not None:
      raise ValueError(
          "shard_map inside a pmap or vmap is not supported (nor is it in "
          "JAX); call shard_map at top level, or inside a tf.function.")
    specs = tree.broadcast_prefix(self._in_specs, args, spec_name="in_specs",
                                  root="args", is_spec_leaf=_is_spec)
    specs = [_as_spec(spec) for spec in specs]
    leaves, treedef = tree.flatten(args)
    paths = tree.leaf_paths(args, "args")
    leaves = [arguments.to_array_leaf(leaf, path)
              for leaf, path in zip(leaves, paths)]
    if tf_internal.tape_active() and not tf.inside_function():
      return self._gradients.recorded_call(
          lambda values: self._run(values, treedef, specs, paths), leaves,
          treedef, specs)
    out_leaves, out_treedef, _ = self._run(leaves, treedef, specs, paths)
    return out_treedef.unflatten(out_leaves)

  def _run(self, leaves, treedef, specs, paths):
    """The global results of one call: (leaves, treedef, out specs)."""
    expanded = [_expand_input(leaf, spec, self._mesh, path)
                for leaf, spec, path in zip(leaves, specs, paths)]
    with compile_log.arguments_shown_as(tuple(
        (tuple(leaf.shape), tf.as_dtype(leaf.dtype)) for leaf in leaves)):
      result = self._mapped(*treedef.unflatten(expanded))
    out_leaves, out_treedef = tree.flatten(result)
    out_specs = [_as_spec(spec) for spec in tree.broadcast_prefix(
        self._out_specs, result, spec_name="out_specs", root="output",
        is_spec_leaf=_is_spec)]
    return ([_join_output(leaf, spec, self._mesh)
             for leaf, spec in zip(out_leaves, out_specs)],
            out_treedef, out_specs)


class ContextMeshFunction:
  """The callable `shard_map` returns without a mesh.

  Each call runs over the mesh `tfspmd.set_mesh` set at that time, with the
  `ShardMappedFunction` of that mesh, kept so that its traces are reused.
  """

  def __init__(self, fun, in_specs, out_specs, check_vma):
    in_specs = _checked_in_specs(fun, in_specs, out_specs, check_vma)
    self._make = functools.partial(ShardMappedFunction, fun,
                                   in_specs=in_specs, out_specs=out_specs,
                                   check_vma=check_vma)
    self._by_mesh = {}
    functools.update_wrapper(self, fun, updated=())

  @tf.autograph.experimental.do_not_convert
  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    mesh = mesh_context.get_mesh()
    if mesh is None:
      raise ValueError(
          "shard_map: no `mesh` was given and none is set: pass mesh=..., "
          "or call the function inside `with tfspmd.set_mesh(mesh):`.")
    if mesh not in self._by_mesh:
      self._by_mesh[mesh] = self._make(mesh)
    return self._by_mesh[mesh](*args, **kwargs)


# Tells a missing in_specs or out_specs from None, which is a spec.
_REQUIRED = object()


def shard_map(
    f: Callable[..., Any] | None = None,
    mesh: Mesh | None = None,
    in_specs: Any = _REQUIRED,
    out_specs: Any = _REQUIRED,
    check_rep: bool | None = None,
    auto: AbstractSet[Hashable] = frozenset(),
    *,
    check_vma: bool | None = None,
) -> Callable[..., Any]:
  """Runs `f` on every device's blocks of arrays split over a named mesh.

  It takes JAX's `jax.shard_map(f, *, mesh, in_specs, out_specs,
  check_vma)` and the older `jax.experimental.shard_map.shard_map(f, mesh,
  in_specs, out_specs, check_rep, auto)`, positional or by keyword; without
  `f`, it returns a decorator.

  Args:
    f: The per-device function: it gets each argument's block (the global
      shape divided along the dimensions its spec splits) and may use every
      `tfspmd.lax` collective over the mesh's axis names (or tuples of them).
    mesh: A `tfspmd.Mesh`. If None, each call runs over the mesh
      `tfspmd.set_mesh` set at that time (a mesh given here is used even
      where `set_mesh` set another).
    in_specs: A `tfspmd.P` per positional argument (or a tree prefix of the
      arguments): which mesh axes split each dimension. An axis it does not
      name gives every device along it the same block.
    out_specs: A `tfspmd.P` per output (or a tree prefix): how the blocks
      form the global result. An output must be the same along every mesh
      axis its spec leaves out.
    check_rep: The older name of `check_vma`; give one of them.
    auto: Must be empty: `f` is per device along every mesh axis.
    check_vma: If True (the default), an output that varies along a mesh
      axis its out spec leaves out is an error at trace time. If False, it
      is not checked, and, as in JAX, the result holds the block of the
      first device along each such axis (position 0 there), the others'
      dropped.

  Returns:
    A function of global arrays returning global arrays: `ShardedArray`s
    whose `dtensor_value` lies on `mesh.dtensor_mesh` (whose dimensions have
    the mesh's axis names), laid out as `out_specs` say:
    `P('data', None)` gives `dtensor.Layout(['data', dtensor.UNSHARDED],
    mesh.dtensor_mesh)`. A dimension split over several axes
    (`P(('data', 'model'))`) is split over all of them, the first major, as
    in JAX: the device at `('data', 'model')` position (d, m) holds block
    `4 * d + m`, and the result's `sharding` is `NamedSharding(mesh,
    P(('data', 'model')))`. A DTensor layout splits a dimension over one
    mesh dimension, so such a result's `dtensor_value` lies on a DTensor
    mesh of the same devices whose one dimension, named 'data.model',
    merges the two (each device's block is moved there where it is); it
    goes back into a shard_map with the same in spec as it is. Inside a
    user's `tf.function`, where no value can change meshes, such a
    dimension lies split over the first axis only, on `mesh.dtensor_mesh`.
    DTensor inputs on `mesh.dtensor_mesh` laid out as `in_specs` say are
    used as they are.
    Calls of `shard_map` with the same `f` (the same function object),
    mesh and specs return the same function (the 64 most recent are kept),
    so a step function that builds its shard_map on every call traces and
    compiles it once, as under `jax.jit`.
    While a GradientTape records, it returns `tf.Tensor`s the tape follows;
    as in JAX, the gradient of an input the same along a mesh axis is the
    sum of its devices' gradients over that axis, and an output the same
    along one counts once.

  Example:
    >>> import numpy as np, tfspmd
    >>> from tfspmd import P
    >>> mesh = tfspmd.make_mesh((2, 4), ('data', 'model'))
    >>> def f(block):
    ...   return tfspmd.lax.psum(block, 'model')
    >>> g = tfspmd.shard_map(f, mesh=mesh, in_specs=P('data', 'model'),
    ...                      out_specs=P('data', None))
    >>> x = np.arange(16.).reshape(4, 4)
    >>> print(np.asarray(g(x)))
    [[ 6.]
     [22.]
     [38.]
     [54.]]
    >>> from tensorflow.experimental import dtensor
    >>> layout = dtensor.Layout(['data', dtensor.UNSHARDED], mesh.dtensor_mesh)
    >>> dtensor.fetch_layout(g(x).dtensor_value) == layout
    True

  Several processes:
    After `tfspmd.distributed.initialize()`, a mesh may hold the devices of
    every process (`tfspmd.make_mesh` over `tfspmd.devices()`, in process
    order); every process calls the same shard_map with the same mesh. The
    specs keep their meaning over the global arrays, and each process passes
    and gets back its part of them: along a dimension its spec splits, the
    blocks of the mesh positions its devices hold, in order; along any
    other dimension, the whole extent. With 2 processes of 4 devices and
    `make_mesh((2, 4), ('p', 'd'))`, an input split by `P('p', 'd')` of
    global shape (16, 8) is passed as its 8 rows by each process (process
    k's rows 8k..8k+7), and one split by `P('d')` or `P()` is passed whole
    by every process; a result split by `P('p', 'd')` comes back as the
    process's 8 rows, a `ShardedArray` of its blocks, as pmap's. Meshes
    whose one axis crosses the processes (`make_mesh((8,), ('x',))`, or
    `(4, 2)` whose first axis does) work the same way: a `P('x')` input is
    passed as the process's half. A process's devices must hold every
    combination of their positions along the mesh's axes (they do in such
    meshes), and a dimension split over several axes may cross processes
    in the first only. An input not split over the axes that cross the
    processes must be equal in every process; that is not checked: each
    process's devices compute with the values it passed, which the program
    takes as the same along those axes (a psum of the input over them is
    the axis size times this process's value). A result, or its
    `dtensor_value`, goes back in as the global array.
  """
  for name, value in (("in_specs", in_specs), ("out_specs", out_specs)):
    if value is _REQUIRED:
      raise TypeError(
          f"shard_map: `{name}` is missing: give a tfspmd.P per "
          f"{'argument' if name == 'in_specs' else 'output'} (or a tree "
          f"prefix of them).")
  if check_rep is not None:
    if check_vma is not None:
      raise TypeError(
          "shard_map: give `check_vma` or its older name `check_rep`, not "
          "both.")
    if not isinstance(check_rep, bool):
      raise TypeError(f"shard_map: `check_rep` must be True or False, got "
                      f"{check_rep!r}.")
  check = check_vma if check_rep is None else check_rep
  check = True if check is None else check
  if auto:
    raise ValueError(
        f"shard_map: `auto` must be empty, got {set(auto)}: f is per device "
        f"along every mesh axis. Drop `auto` and use collectives over those "
        f"axes, or leave them out of the mesh.")
  if f is None:
    return functools.partial(shard_map, mesh=mesh, in_specs=in_specs,
                             out_specs=out_specs, check_vma=check)
  if mesh is None:
    return _shared((f, None, in_specs, out_specs, check), lambda: (
        ContextMeshFunction(f, in_specs, out_specs, check)))
  return _shared((f, mesh, in_specs, out_specs, check), lambda: (
      ShardMappedFunction(f, mesh, in_specs, out_specs, check)))


# The shard_maps made lately, by function, mesh and specs: code that builds
# the shard_map in each call (`shard_map(f, ...)(x)` inside a step function)
# reuses its traces and compiled programs, as jax.jit's cache, keyed on the
# function, does; it would otherwise trace and compile on every call. A new
# closure of the same code over the same values counts as the same function
# (`function_keys`); a dropped function frees its shard_maps.
_RECENT = function_keys.SharedByFunction("shard_map")


def _shared(arguments_key, make):
  """The shard_map `make()` gives, shared by calls with equal arguments.

  `arguments_key` is `(f, mesh, in_specs, out_specs, check_vma)`; the spec
  trees count by their structure and specs. A key that cannot be hashed
  (a function object that cannot) is not shared.
  """
  f, mesh, in_specs, out_specs, check = arguments_key
  try:
    return _RECENT.get_or_put(f, (mesh, check) + tuple(
        (treedef, tuple(leaves)) for leaves, treedef in (
            tree.flatten(specs, is_leaf=_is_spec)
            for specs in (in_specs, out_specs))), make)
  except TypeError:
    return make()
