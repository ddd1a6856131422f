"""A pmap called while an enclosing pmap traces: one more mesh dimension.

The nested pmap vectorizes its function over its axis in place, inside the
enclosing program, and registers the axis as a dimension of the program's
mesh (pmaps at the same depth share one). It records which input axes and
result axes its mesh dimension splits, so that the top-level pmap lays its
inputs and outputs out over every dimension.
"""

from tfspmd._src import arguments
from tfspmd._src import axis_env
from tfspmd._src import devices as devices_lib
from tfspmd._src import mesh as mesh_lib
from tfspmd._src import vectorize


def check_nested(options):
  """Raises if a pmap with `options` cannot run inside the enclosing ones."""
  if options.steps is not None:
    raise ValueError(
        "pmap: steps= is for the outermost pmap, which runs the loop; "
        "give it there (a nested pmap runs once per step of it).")
  if options.devices is not None:
    raise ValueError(
        "pmap: nested pmaps with devices= are not supported (as in JAX); "
        "give devices= to neither, and the nested mesh uses the first "
        "devices of the outer pmap's platform.")
  axis_env.check_not_bound(options.axis_name, "pmap")


def call(pmapped, args, kwargs):
  """The per-device results of the nested `PmappedFunction` on `args`."""
  options = pmapped.options
  state = axis_env.trace_state()
  check_nested(options)
  bound = options.args.bind(args, kwargs)
  paths = bound.paths
  values = [arguments.traced_tensor(leaf, path)
            for leaf, path in zip(bound.leaves, paths)]
  shapes = [tuple(v.shape) for v in values]
  axes, size = options.args.axes_and_size(bound.in_axes, shapes, paths)
  depth = sum(1 for frame in axis_env.frames() if frame.mesh_dim is not None)
  mesh_dim = _register_nested_axis(state, options.axis_name, size, depth,
                                   options.mesh_dim)

  for value, axis in zip(values, axes):
    origin = state.origin_of(value)
    if axis is not None and origin is not None:
      splits = state.input_splits.setdefault(origin.leaf, {})
      splits.setdefault(origin.axes[axis], mesh_dim)

  result = vectorize.map_over_axis(
      options.fun, frame_template=(options.axis_name, size, mesh_dim),
      inputs=values, in_axes=axes, rebuild_args=bound.rebuilder(),
      out_axes=options.out_axes, on_slice=state.slice_tracker(values, axes),
      varying_output_error=options.varying_output_error)
  for value, axis, per_device in zip(result.values, result.out_axes,
                                     result.per_device):
    if axis is not None:
      state.record_output_splits(
          value, state.result_splits(per_device, axis, mesh_dim))
  return result.treedef.unflatten(result.values)


def _register_nested_axis(state, axis_name, size, depth, mesh_dim):
  """Adds the mesh dimension of a nested pmap at `depth`, or reuses it.

  A shard_map names the dimension of each of its axes (`mesh_dim`); other
  pmaps take `axis_<depth>`, or another name if a shard_map's axis has it.
  """
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
          f"at least {inner} devices, map the inner axis with tfspmd.vmap "
          f"(its collectives stay on the device), or use tfspmd.shard_map "
          f"over a tfspmd.make_mesh of tfspmd.devices(), whose axes may "
          f"cross processes.")
    raise ValueError(message)
  taken = {dim for _, _, dim in state.mesh_axes}
  dim = mesh_dim or mesh_lib.mesh_dim_name(depth)
  while dim in taken:
    dim = "_" + dim
  state.mesh_axes.append((axis_name, size, dim))
  return dim
