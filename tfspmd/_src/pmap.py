"""pmap: the pipeline of one call, top to bottom, and its trace cache.

A call at the top level (not inside another pmap's trace):
  1. split off static arguments, flatten the rest (`tree`);
  2. expand in_axes over the leaves, find the mapped size and check it;
  3. look up the traced program for this call's signature, or trace it:
     the per-device function vectorized over the axis by pfor, inside one
     `tf.function(jit_compile=True)`; nested pmaps met while tracing add
     mesh dimensions;
  4. place each input on the program's mesh (`placement`), run, wrap the
     results as `ShardedArray`s.
A call inside another pmap's trace vectorizes over one more axis in place.
A call in debug mode runs each device's program eagerly instead (`debug.call`).
"""

import dataclasses
import functools

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfspmd._src import arguments
from tfspmd._src import axis_env
from tfspmd._src import devices as devices_lib
from tfspmd._src import distributed
from tfspmd._src import dtensor_errors
from tfspmd._src import dtensor_settings
from tfspmd._src import lru
from tfspmd._src import mapped_args
from tfspmd._src import mesh as mesh_lib
from tfspmd._src import new_axis
from tfspmd._src import placement as placement_lib
from tfspmd._src import pmap_gradient
from tfspmd._src import steps as steps_lib
from tfspmd._src import tf_internal
from tfspmd._src import tree
from tfspmd._src import vectorize
from tfspmd._src.debug import call as debug_call
from tfspmd._src.debug import mode as debug_mode
from tfspmd._src.sharded_array import ShardedArray

_do_not_convert = tf.autograph.experimental.do_not_convert


@dataclasses.dataclass
class _Program:
  """A traced program and how its inputs and outputs lie on the mesh."""
  function: object
  input_placements: tuple
  output_placements: tuple
  output_shapes: tuple
  output_dtypes: tuple
  output_treedef: object
  inline: object
  output_axes: tuple
  mesh: object
  size: int
  trainable_variables: tuple
  dtensor_switches: tuple


@functools.lru_cache(maxsize=4096)
def _placement(mesh_key, spec):
  """Interned `Placement`s, so equal placements compare by identity."""
  return placement_lib.Placement(mesh_key, spec)


def _argnums(value, name):
  if value is None:
    return ()
  if isinstance(value, int) and not isinstance(value, bool):
    return (value,)
  try:
    nums = tuple(value)
  except TypeError:
    raise TypeError(
        f"{name} must be an int or a collection of ints, got {value!r}."
    ) from None
  for num in nums:
    if isinstance(num, bool) or not isinstance(num, int):
      raise TypeError(
          f"{name} must be an int or a collection of ints, got {value!r}.")
  return nums


class PmappedFunction:
  """The callable `pmap` returns; call it like the function it maps."""

  def __init__(self, fun, axis_name, in_axes, out_axes,
               static_broadcasted_argnums, devices, backend, axis_size,
               donate_argnums, steps, debug=False, mesh_devices=None):
    if not callable(fun):
      raise TypeError(f"pmap: `fun` must be callable, got {fun!r}.")
    if not isinstance(debug, bool):
      raise TypeError(
          f"pmap: `debug` must be True or False, got {type(debug).__name__} "
          f"{debug!r}.")
    arguments.check_axis_spec_tree(out_axes, "out_axes")
    static_argnums = _argnums(static_broadcasted_argnums,
                              "static_broadcasted_argnums")
    self._donate_argnums = _argnums(donate_argnums, "donate_argnums")
    overlap = set(static_argnums) & set(self._donate_argnums)
    if overlap:
      raise ValueError(
          f"pmap: arguments {sorted(overlap)} are both static "
          f"(static_broadcasted_argnums) and donated (donate_argnums); a "
          f"static argument has no buffer to donate.")
    self._args = mapped_args.MappedArguments("pmap", in_axes, static_argnums,
                                             axis_size)
    self._fun = fun
    self._axis_name = axis_env.checked_axis_name(axis_name, fun, "pmap")
    self._out_axes = out_axes
    self._steps = steps_lib.check_steps(steps)
    self._devices = _check_devices(devices, backend)
    # shard_map's outermost level: the devices of the whole nested mesh.
    self._whole_mesh_devices = mesh_devices
    self._backend = backend
    self._debug = debug
    self._programs = lru.LRUCache(lru.TRACE_CACHE_SIZE)
    self._vjps = lru.LRUCache(lru.TRACE_CACHE_SIZE)
    functools.update_wrapper(self, fun, updated=())

  def __repr__(self):
    return f"<pmap of {self._fun!r} over axis {self._axis_name!r}>"

  def __get__(self, instance, owner):
    if instance is None:
      return self
    return functools.partial(self, instance)

  # --- the call ----------------------------------------------------------

  def __call__(self, *args, **kwargs):
    if self._donate_argnums:
      self._check_donated_positions(len(args))
    if self._debug or debug_mode.active():
      return debug_call.call(self, args, kwargs)
    if axis_env.trace_state() is not None:
      return self._call_nested(args, kwargs)
    if tf.inside_function():
      return self._call_in_graph(args, kwargs)
    call = self._args.bind(args, kwargs)
    values, signature = [], []
    for k, leaf in enumerate(call.leaves):
      if isinstance(leaf, tf.Variable):
        leaf = tf.convert_to_tensor(leaf)
      if isinstance(leaf, ShardedArray):
        if leaf.is_deleted():
          raise _donated_argument_error(call.paths[k])
        values.append(leaf)
        signature.append((tuple(leaf.shape), leaf.dtype))
        continue
      if isinstance(leaf, tf.Tensor):
        dtype = leaf.dtype
        ready = (dtype.is_numeric and not dtype.is_quantized) or dtype.is_bool
      else:
        ready = isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biufc"
      if not ready:
        leaf = arguments.to_array_leaf(leaf, call.paths[k])
      values.append(leaf)
      signature.append((tuple(leaf.shape), tf.as_dtype(leaf.dtype)))
    key = (call.treedef, call.static_key, tuple(signature))
    program = self._programs.get(key)
    if program is None:
      program = self._trace(key, call, values)
    if tf_internal.tape_active() and (
        program.trainable_variables or tf_internal.tape_may_record(
            [v for v in values if isinstance(v, tf.Tensor)])):
      outputs = pmap_gradient.recorded_call(
          lambda tensors: [tf.convert_to_tensor(r)
                           for r in self._run(program, tensors)],
          self._vjp(key, program, call),
          [tf.convert_to_tensor(v) for v in values], program.size)
      return program.output_treedef.unflatten(list(outputs))
    results = self._run(program, values)
    if self._donate_argnums:
      self._delete_donated(args, results)
    return program.output_treedef.unflatten(results)

  def _call_in_graph(self, args, kwargs):
    """A call while the user's own tf.function traces: one more call op.

    The inputs must be DTensors on the program's mesh (arguments of the
    user's function that came from `ShardedArray.dtensor_value` or from
    another call). The program's ops go into the user's graph as they are
    (a nested jit-compiled DTensor function mis-expands collectives:
    "SPMD expansion resulted in op output inconsistent with the provided
    layout", TF 2.21), and the outputs are left as DTensors for the rest
    of the user's function.
    """
    call = self._args.bind(args, kwargs)
    values = []
    for leaf, path in zip(call.leaves, call.paths):
      if isinstance(leaf, ShardedArray):
        leaf = leaf.dtensor_value
      value = _traced_tensor(leaf, path)
      if not value.shape.is_fully_defined():
        raise ValueError(
            f"pmap inside a tf.function needs static shapes, but {path} has "
            f"shape {value.shape}; give the tf.function an input_signature "
            f"with full shapes, or call it with tensors of fixed shape.")
      values.append(value)
    share = self._process_share()
    signature = tuple((_local_shape(v, axis, path, share), v.dtype)
                      for v, axis, path in zip(values, call.in_axes,
                                               call.paths))
    key = (call.treedef, call.static_key, signature)
    program = self._programs.get(key)
    if program is None:
      program = self._trace(key, call, values)
    outputs = program.inline(*values)
    return program.output_treedef.unflatten(list(outputs))

  def _run(self, program, values):
    """Places `values`, runs `program`, wraps its outputs."""
    placed = [_place(value, placement)
              for value, placement in zip(values, program.input_placements)]
    try:
      with dtensor_settings.applied(program.dtensor_switches):
        if placed:
          outputs = program.function(*placed)
        else:
          with dtensor.run_on(program.mesh):
            outputs = program.function()
    except tf.errors.OpError as e:
      distributed.raise_peer_failure(e)
      explained = dtensor_errors.explain(e, self._axis_name)
      if explained is None:
        raise
      raise explained from None
    return [ShardedArray(value, placement, shape, dtype)
            for value, placement, shape, dtype in zip(
                outputs, program.output_placements, program.output_shapes,
                program.output_dtypes)]

  def _vjp(self, key, program, call):
    """The pmapped VJP of the call signature `key`, made once."""
    vjp = self._vjps.get(key)
    if vjp is None:
      def make_pmap(fun, in_axes, out_axes):
        return PmappedFunction(fun, self._axis_name, in_axes, out_axes, (),
                               self._devices, self._backend, None, (), None,
                               mesh_devices=self._whole_mesh_devices)
      vjp = pmap_gradient.VjpProgram(
          make_pmap, self._fun, call.rebuilder(), call.in_axes,
          program.output_axes, program.trainable_variables,
          self._axis_name)
      self._vjps.put(key, vjp)
    return vjp

  # --- tracing -----------------------------------------------------------

  def _trace(self, key, call, values):
    paths = call.paths
    # This process's shapes, from the call's signature: with several
    # processes each passes its part, and the program sees the whole array,
    # whose mapped axis spans the devices of all processes.
    shapes = [shape for shape, _ in key[2]]
    axes = [None if axis is None else arguments.normalize_axis(
        axis, len(shape), spec_name="in_axes", path=path)
            for axis, shape, path in zip(call.in_axes, shapes, paths)]
    size = self._args.mapped_size(axes, shapes, paths)
    devices = self._mesh_devices(size)
    local, total = self._process_share()
    global_size = size * total // local
    shapes = [shape if axis is None else
              shape[:axis] + (global_size,) + shape[axis + 1:]
              for shape, axis in zip(shapes, axes)]
    size = global_size
    top_dim = mesh_lib.mesh_dim_name(0)
    state = axis_env.TraceState(
        mesh_axes=[(self._axis_name, size, top_dim)],
        max_devices=len(devices) if self._devices is None else size,
        devices=tuple(devices))
    dtypes = [value.dtype for value in values]
    rebuild = call.rebuilder()
    built = {}

    def on_slice(leaf, piece, _):
      state.origins[id(piece)] = (piece, leaf, [
          a for a in range(len(shapes[leaf])) if a != axes[leaf]])

    @_do_not_convert
    def program(*inputs):
      with axis_env.tracing(state):
        for leaf, (value, axis) in enumerate(zip(inputs, axes)):
          if axis is None:
            state.origins[id(value)] = (value, leaf, list(range(len(shapes[leaf]))))
        if self._steps is None:
          result = vectorize.map_over_axis(
              self._fun, frame_template=(self._axis_name, size, top_dim),
              inputs=list(inputs), in_axes=axes, rebuild_args=rebuild,
              out_axes=self._out_axes, on_slice=on_slice)
        else:
          result = steps_lib.map_steps(
              self._fun, self._steps,
              frame_template=(self._axis_name, size, top_dim),
              inputs=list(inputs), in_axes=axes, paths=paths,
              carry_treedef=_carry_treedef(call.dynamic, self._steps),
              rebuild_args=rebuild, out_axes=self._out_axes,
              on_slice=on_slice)
        mesh_key = state.mesh_key()
        placements = []
        outputs = []
        for value, axis, per_device in zip(result.values, result.out_axes,
                                           result.per_device):
          spec = [None] * value.shape.rank
          if axis is not None:
            spec[axis] = top_dim
            for inner_axis, dim in _inner_splits(state, per_device).items():
              spec[inner_axis + (inner_axis >= axis)] = dim
          placement = _placement(mesh_key, tuple(spec))
          placements.append(placement)
          outputs.append(_relayout(value, placement.layout))
        built.update(result=result, placements=placements, mesh_key=mesh_key)
        return outputs

    function = tf.function(program, jit_compile=True, autograph=False)
    specs = [tf.TensorSpec(shape, tf.as_dtype(dtype))
             for shape, dtype in zip(shapes, dtypes)]
    concrete = function.get_concrete_function(*specs)
    new_axis.check_program(concrete.outputs, self._axis_name)
    mesh_key = built["mesh_key"]
    input_placements = []
    for leaf, (shape, axis) in enumerate(zip(shapes, axes)):
      spec = [None] * len(shape)
      if axis is not None:
        spec[axis] = top_dim
      for original_axis, dim in state.input_splits.get(leaf, {}).items():
        spec[original_axis] = dim
      input_placements.append(_placement(mesh_key, tuple(spec)))
    result = built["result"]
    mesh = mesh_lib.mesh_for_axes(*mesh_key)
    program = _Program(
        function=tf_internal.flat_caller(
            concrete, [_on_mesh(value, mesh)
                       for value in concrete.captured_inputs]),
        input_placements=tuple(input_placements),
        output_placements=tuple(built["placements"]),
        output_shapes=tuple(
            placement.local_shape(tuple(v.shape))
            for v, placement in zip(result.values, built["placements"])),
        output_dtypes=tuple(v.dtype for v in result.values),
        output_treedef=result.treedef,
        inline=program,
        output_axes=tuple(result.out_axes),
        size=size,
        trainable_variables=tuple(concrete.trainable_variables),
        dtensor_switches=dtensor_settings.for_program(
            mesh_key[2], len(mesh_key[1]),
            devices_lib.process_count(), concrete.graph.as_graph_def()),
        mesh=mesh)
    self._programs.put(key, program)
    return program

  def _process_share(self):
    """`(local, total)`: this process maps over `local / total` of the axis."""
    if self._devices is None:
      return 1, devices_lib.process_count()
    me = devices_lib.process_index()
    return (sum(1 for d in self._devices if d.process_index == me),
            len(self._devices))

  def _mesh_devices(self, size):
    """The devices the call's mesh is made of: the given ones, or from all.

    Without `devices=`, each process maps over its first devices
    (`mesh.mesh_key` picks them), as many in every process.
    """
    if self._whole_mesh_devices is not None:
      return self._whole_mesh_devices
    if self._devices is not None:
      local = [d for d in self._devices
               if d.process_index == devices_lib.process_index()]
      if size != len(local):
        raise ValueError(
            f"pmap was given {len(self._devices)} devices ({len(local)} in "
            f"this process), but the mapped axis has size {size}; with "
            f"devices=, the mapped size must equal the number of local "
            f"devices given.")
      return self._devices
    available = devices_lib.local_devices(self._backend)
    if size > len(available):
      raise ValueError(
          f"compiling computation that requires {size} replicas, but only "
          f"{len(available)} devices are available (num_replicas={size}). "
          f"Map over fewer elements, or make more devices: "
          f"{devices_lib.NUM_CPU_DEVICES_ENV} or tfspmd.set_num_cpu_devices "
          f"for CPU.")
    return devices_lib.devices(self._backend)

  # --- donation ----------------------------------------------------------

  def _check_donated_positions(self, count):
    for num in self._donate_argnums:
      if not -count <= num < count:
        raise ValueError(
            f"pmapped function has donate_argnums={self._donate_argnums}, but "
            f"was called with only {count} positional argument(s), so "
            f"argument {num} cannot be donated. Pass every donated argument "
            f"positionally, or drop it from donate_argnums.")

  def _delete_donated(self, args, results):
    kept = {id(r) for r in results}
    for num in self._donate_argnums:
      position = num + len(args) if num < 0 else num
      if 0 <= position < len(args):
        for leaf in tree.flatten(args[position])[0]:
          if isinstance(leaf, ShardedArray) and id(leaf) not in kept:
            leaf.delete()

  # --- nested --------------------------------------------------------------

  def _check_nested(self):
    """Raises if this pmap cannot run inside the enclosing ones."""
    if self._steps is not None:
      raise ValueError(
          "pmap: steps= is for the outermost pmap, which runs the loop; "
          "give it there (a nested pmap runs once per step of it).")
    if self._devices is not None:
      raise ValueError(
          "pmap: nested pmaps with devices= are not supported (as in JAX); "
          "give devices= to neither, and the nested mesh uses the first "
          "devices of the outer pmap's platform.")
    axis_env.check_not_bound(self._axis_name, "pmap")

  def _call_nested(self, args, kwargs):
    state = axis_env.trace_state()
    self._check_nested()
    call = self._args.bind(args, kwargs)
    paths = call.paths
    values = [_traced_tensor(leaf, path)
              for leaf, path in zip(call.leaves, paths)]
    shapes = [tuple(v.shape) for v in values]
    axes = [None if axis is None else arguments.normalize_axis(
        axis, len(shape), spec_name="in_axes", path=path)
            for axis, shape, path in zip(call.in_axes, shapes, paths)]
    size = self._args.mapped_size(axes, shapes, paths)
    depth = sum(1 for frame in axis_env.frames() if frame.mesh_dim is not None)
    mesh_dim = _register_nested_axis(state, self._axis_name, size, depth)

    for leaf, (value, axis) in enumerate(zip(values, axes)):
      origin = state.origins.get(id(value))
      if axis is not None and origin is not None and origin[0] is value:
        _, source_leaf, source_axes = origin
        splits = state.input_splits.setdefault(source_leaf, {})
        splits.setdefault(source_axes[axis], mesh_dim)

    result = vectorize.map_over_axis(
        self._fun, frame_template=(self._axis_name, size, mesh_dim),
        inputs=values, in_axes=axes,
        rebuild_args=call.rebuilder(),
        out_axes=self._out_axes, on_slice=state.slice_tracker(values, axes))
    for value, axis, per_device in zip(result.values, result.out_axes,
                                       result.per_device):
      if axis is None:
        continue
      splits = {axis: mesh_dim}
      for inner_axis, dim in _inner_splits(state, per_device).items():
        splits[inner_axis + (inner_axis >= axis)] = dim
      state.output_splits[id(value)] = (value, splits)
    return result.treedef.unflatten(result.values)


def _relayout(value, layout):
  """`dtensor.relayout`, moving uint64 as int64, which DTensor can move.

  DTensor's collectives refuse uint64 (TF 2.21); the cast keeps the bits.
  """
  if value.dtype != tf.uint64:
    return dtensor.relayout(value, layout)
  moved = dtensor.relayout(tf.cast(value, tf.int64), layout)
  return tf.cast(moved, tf.uint64)


def _donated_argument_error(path):
  return RuntimeError(
      f"pmapped function argument {path} is a ShardedArray that was donated "
      f"to an earlier call (donate_argnums), which deleted it. Pass that "
      f"call's result instead, or do not donate an argument you use again.")


def _carry_treedef(dynamic, steps):
  if not dynamic:
    raise TypeError(
        f"pmap with steps={steps} needs the carry as the first positional "
        f"argument (not static), and got none.")
  return tree.flatten(dynamic[0])[1]


def _place(value, placement):
  """The DTensor of one input leaf on `placement`, moving as little as possible."""
  if isinstance(value, ShardedArray):
    current = value.placement
    if current is placement:
      return value.dtensor_value
    if current.block_map == placement.block_map:
      return placement_lib.repack(value.dtensor_value, placement)
    value = value.numpy()
  elif isinstance(value, tf.Tensor):
    if dtensor.is_dtensor(value):
      return _relayout_dtensor(value, placement)
    value = value.numpy()
  return placement_lib.pack_host_array(np.asarray(value), placement)


def _on_mesh(captured, mesh):
  """A tensor the program closes over, as DTensor takes it.

  DTensor takes an eager tensor that is not a DTensor only if it is a scalar
  or a small integer one ("was expecting a DTensor"): a closed-over array is
  copied to every device of the mesh once, when the program is traced (an
  eager tensor never changes). Resource handles (variables) pass as they are.
  """
  if (not isinstance(captured, tf.Tensor) or dtensor.is_dtensor(captured) or
      captured.dtype in (tf.resource, tf.variant)):
    return captured
  return placement_lib.replicated(captured, mesh)


def _relayout_dtensor(value, placement):
  """A DTensor argument (from a user's tf.function) on `placement`."""
  layout = dtensor.fetch_layout(value)
  if layout == placement.layout:
    return value
  if layout.mesh == placement.mesh:
    return dtensor.relayout(value, placement.layout)
  replicated = dtensor.Layout.replicated(layout.mesh, layout.rank)
  host = dtensor.unpack(dtensor.relayout(value, replicated))[0].numpy()
  return placement_lib.pack_global_array(host, placement)


def _local_shape(value, axis, path, share):
  """The shape of this process's part of the traced DTensor `value`.

  `share` is `(local, total)`: this process holds `local` of every `total`
  positions of the mapped axis.
  """
  shape = tuple(value.shape)
  local, total = share
  if axis is None or local == total:
    return shape
  axis = arguments.normalize_axis(axis, len(shape), spec_name="in_axes",
                                  path=path)
  return shape[:axis] + (shape[axis] * local // total,) + shape[axis + 1:]


def _traced_tensor(leaf, path):
  if isinstance(leaf, ShardedArray):
    raise TypeError(
        f"nested pmap argument {path} is a ShardedArray from outside the "
        f"enclosing pmap; pass it to the outer pmap instead.")
  if isinstance(leaf, tf.Tensor):
    return leaf
  return tf.convert_to_tensor(arguments.to_array_leaf(leaf, path))


def _inner_splits(state, per_device):
  found = state.output_splits.get(id(per_device))
  if found is None or found[0] is not per_device:
    return {}
  return found[1]


def _register_nested_axis(state, axis_name, size, depth):
  """Adds the mesh dimension of a nested pmap at `depth`, or reuses it."""
  if depth < len(state.mesh_axes):
    _, known_size, dim = state.mesh_axes[depth]
    if known_size != size:
      raise ValueError(
          f"nested pmaps at the same depth must have the same size to share "
          f"a mesh dimension: axis {axis_name!r} has size {size}, another "
          f"pmap at that depth has size {known_size}.")
    return dim
  total = size
  for _, outer_size, _ in state.mesh_axes:
    total *= outer_size
  if total > state.max_devices:
    shape = " x ".join(str(s) for _, s, _ in state.mesh_axes) + f" x {size}"
    message = (f"compiling computation that requires {total} replicas "
               f"({shape} nested pmaps), but only {state.max_devices} devices "
               f"are available (num_replicas={total}).")
    if devices_lib.process_count() > 1:
      inner = total // state.mesh_axes[0][1]
      message += (
          f" With several processes the outermost pmap's axis spans the "
          f"processes and the nested axes lie within each process, as in "
          f"JAX: the nested axes need {inner} devices in every process, "
          f"which has {devices_lib.local_device_count()}. Give each process "
          f"at least {inner} devices, or map the inner axis with tfspmd.vmap "
          f"(its collectives stay on the device).")
    raise ValueError(message)
  dim = mesh_lib.mesh_dim_name(depth)
  state.mesh_axes.append((axis_name, size, dim))
  return dim


def _check_devices(devices, backend):
  if devices is None:
    return None
  try:
    devices = tuple(devices)
  except TypeError:
    raise TypeError(
        f"pmap: `devices` must be a sequence of tfspmd.Device (from "
        f"tfspmd.devices()), got {type(devices).__name__} {devices!r}."
    ) from None
  if not devices:
    raise ValueError("pmap: `devices` is empty; give at least one device or "
                     "leave it None to use the first local devices.")
  for device in devices:
    if not isinstance(device, devices_lib.Device):
      raise TypeError(
          f"pmap: `devices` must hold tfspmd.Device objects (from "
          f"tfspmd.devices()), got {type(device).__name__} {device!r}.")
  if len(set(devices)) != len(devices):
    twice = next(d for d in devices if devices.count(d) > 1)
    raise ValueError(
        f"pmap: `devices` lists {twice!r} twice; give each device once: "
        f"{list(devices)}.")
  platforms = {d.platform for d in devices}
  if len(platforms) > 1:
    raise ValueError(
        f"pmap: `devices` mixes platforms {sorted(platforms)}; all devices of "
        f"a pmap must be of one kind.")
  if backend is not None and devices_lib.resolve_backend(backend) not in platforms:
    raise ValueError(
        f"pmap: backend={backend!r} disagrees with the platform of `devices` "
        f"({platforms.pop()}).")
  return devices


def pmap(fun=None, axis_name=None, *, in_axes=0, out_axes=0,
         static_broadcasted_argnums=(), devices=None, backend=None,
         axis_size=None, donate_argnums=(), steps=None, debug=False):
  """Maps `fun` over an axis of its arguments, one position per device.

  `fun` is the program one device runs, written with TensorFlow ops; it may
  call named-axis collectives (`tfspmd.lax.psum`, ...) over `axis_name`. The
  mapped function traces `fun` once per distinct call signature into one
  `tf.function(jit_compile=True)` that DTensor runs on a mesh of the devices.

  Args:
    fun: The per-device function. Its arguments and results are tensors,
      NumPy arrays or Python numbers in tuples, lists, dicts or namedtuples.
    axis_name: A hashable name for the mapped axis, used by collectives.
    in_axes: For each positional argument, the axis to map over (any axis,
      negative counts from the end), None to broadcast it to every device,
      or a tree prefix of the arguments holding those. Keyword arguments are
      mapped over axis 0.
    out_axes: Where the mapped axis goes in each output (an int, or None for
      an output that is the same on every device: one copy is returned), or a
      tree prefix of the output.
    static_broadcasted_argnums: Positions of arguments passed as Python
      values (hashable); each new value traces again.
    devices: The `Device`s to map over, in order (from `tfspmd.devices()`);
      the mapped size must equal the number of them local to this process.
    backend: 'cpu', 'gpu' or 'tpu'; None picks the best present.
    axis_size: The size of the mapped axis when no argument is mapped.
    donate_argnums: Positions of arguments whose `ShardedArray` leaves the
      call frees; using one again raises.
    steps: Run `fun` this many times in one compiled call (a loop inside the
      program, so the dispatch cost is paid once per `steps`), as
      `carry, y = fun(carry, *xs_t)`: the first argument is the carry, every
      other argument has one slice per step along its first per-device
      axis. The call returns `(last carry, ys)`, with the `y` of every step
      stacked along a new first per-device axis.
    debug: If True, run in debug mode (below) instead of compiling.

  Returns:
    A callable with `fun`'s arguments (with the extra mapped axes), returning
    `fun`'s outputs with the mapped axis added, as `ShardedArray`s.

  Example:
    >>> import tensorflow as tf, tfspmd
    >>> print(tfspmd.pmap(lambda x: x ** 2)(tf.range(8)))
    [ 0  1  4  9 16 25 36 49]
    >>> f = tfspmd.pmap(lambda x, y: (x + y, y * 2.), in_axes=(0, None))
    >>> print(f(tf.range(2.), 4.))
    (ShardedArray([4., 5.], dtype=float32), ShardedArray([8., 8.], dtype=float32))

    Three steps of a running sum per device in one call:

    >>> step = lambda total, x: (total + x, total)
    >>> total, seen = tfspmd.pmap(step, steps=3)(tf.zeros(2), tf.ones((2, 3)))
    >>> print(total)
    [3. 3.]
    >>> print(seen)
    [[0. 1. 2.]
     [0. 1. 2.]]

  Trace cache:
    Each pmapped function keeps the programs of its 64 most recently used
    call signatures (`tfspmd._src.lru.TRACE_CACHE_SIZE`): shapes, dtypes,
    tree structure, static values. A call with a signature beyond those
    drops the least recently used program, so calls with ever-new shapes
    trace every time but do not grow memory; pad or bucket shapes to stay
    within the limit.

  Several processes:
    After `tfspmd.distributed.initialize()` in every process, every process
    calls the same pmaps in the same order, each with a mapped size equal to
    its number of devices used (the first ones of each process). Each passes
    its own part and gets back its own part (a `ShardedArray` of its local
    blocks), while `axis_size`, `axis_index` and the collectives span the
    devices of all processes: the mapped axis is the processes' parts one
    after another. A nested pmap's axes lie within each process. With
    `devices=`, give every process the same list; each maps over the ones it
    owns.

  Debug mode:
    With `debug=True` (or inside `tfspmd.debug_mode()`), nothing is traced:
    each device's program runs eagerly in its own Python thread, and the
    threads meet at every collective, which computes what the compiled
    program computes. `fun` sees eager tensors: `print` them, branch on
    them, or stop one device (`if axis_index(...) == k: breakpoint()`) and
    step through its program in pdb while the others wait at their next
    collective. pmaps called inside run in debug mode too; a vmap inside
    still vectorizes, with collectives over its own axis only. The results
    are eager `tf.Tensor`s (not `ShardedArray`s: nothing is placed on
    devices) with the structure, shapes and dtypes of the compiled results.
    An exception on a device is raised to the caller with a note naming the
    device, and a program whose devices wait at different collectives
    raises instead of hanging. A `GradientTape` inside `fun` or around the
    call works as in the compiled path. `steps=` is not supported in debug
    mode yet.

    >>> def f(x):
    ...   if tfspmd.lax.axis_index('i') == 1:
    ...     print('device 1 has', x.numpy())
    ...   return tfspmd.lax.psum(x, 'i')
    >>> print(tfspmd.pmap(f, 'i', debug=True)(tf.range(4)))
    device 1 has 1
    tf.Tensor([6 6 6 6], shape=(4,), dtype=int32)
  """
  if fun is None:
    return functools.partial(
        pmap, axis_name=axis_name, in_axes=in_axes, out_axes=out_axes,
        static_broadcasted_argnums=static_broadcasted_argnums,
        devices=devices, backend=backend, axis_size=axis_size,
        donate_argnums=donate_argnums, steps=steps, debug=debug)
  return PmappedFunction(fun, axis_name, in_axes, out_axes,
                         static_broadcasted_argnums, devices, backend,
                         axis_size, donate_argnums, steps, debug)
