"""A pmap called while an enclosing pmap traces: one more mesh dimension.

The nested pmap vectorizes its function over its axis in place, inside the
enclosing program, and registers the axis as a dimension of the program's
mesh (pmaps at the same depth share one). It records which input axes and
result axes its mesh dimension splits, so that the top-level pmap lays its
inputs and outputs out over every dimension.

With several processes the nested pmaps' axes form a grid over the devices
in process order, outer axis slowest, as in one process, and each process
passes the block of every input its own devices hold. A nested axis lies
within each process unless its pmap's `axis_size` gives a global size larger
than the process's inputs hold: the axis then crosses processes. The
program is traced over the global arrays; a nested pmap that finds its
inputs still this process's part along its axis (`TraceState.parts`) ends
the trace with `CrossingAxis`, and the top-level pmap traces again with
those inputs' global shapes (`top_size` gives the outermost axis's).
"""

import math

import numpy as np

from tfspmd._src.arguments import arguments
from tfspmd._src.programs import vectorize
from tfspmd._src.runtime import axis_env
from tfspmd._src.runtime import devices as devices_lib
from tfspmd._src.runtime import mesh as mesh_lib
from tfspmd._src.runtime import placement as placement_lib


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
  depth = sum(1 for frame in axis_env.frames() if frame.mesh_dim is not None)
  if depth in state.crossing:
    _check_all_parts_are_inputs(state, options, values, shapes, bound.in_axes,
                                depth)
  axes, size = options.args.axes_and_size(bound.in_axes, shapes, paths,
                                          part=state.parts)
  if state.parts:
    _check_whole(state, options, values, axes, size, depth)
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


class CrossingAxis(Exception):
  """A nested pmap's inputs are this process's part of an axis crossing processes.

  The top-level pmap traces its program again with the global shapes.

  Attributes:
    depth: The nested axis's depth.
    local: How many of its positions the inputs hold.
    size: Its global size.
    splits: `(leaf, axis)` of each input leaf axis the nested pmap maps.
    axis_name: The nested pmap's axis name, for messages.
  """

  def __init__(self, depth, local, size, splits, axis_name):
    super().__init__(f"the nested axis at depth {depth} crosses processes")
    self.depth, self.local, self.size, self.splits = depth, local, size, splits
    self.axis_name = axis_name


def _check_whole(state, options, values, axes, size, depth):
  """Raises `CrossingAxis` if the inputs hold a part of the axis at `depth`.

  The global size is the pmap's `axis_size`, or that found for the depth
  (another pmap's there).
  """
  crossing = state.crossing.get(depth)
  known = options.args.axis_size or (
      None if crossing is None else crossing.size)
  if known is None or known == size or known % size:
    return
  splits = []
  for value, axis in zip(values, axes):
    origin = state.origin_of(value)
    if axis is not None and origin is not None:
      splits.append((origin.leaf, origin.axes[axis]))
  if not splits:
    raise _not_an_input(options.axis_name, known, size)
  raise CrossingAxis(depth, size, known, tuple(splits), options.axis_name)


def _check_all_parts_are_inputs(state, options, values, shapes, in_axes,
                                depth):
  """Raises if a value mapped over a crossing axis is a part but no input.

  In a trace over the global shapes, an input of the outermost pmap that
  the axis at `depth` splits has its global size; a value of the size of
  this process's part along it (a constant's, say) has no global array to
  be a part of.
  """
  local, known = state.crossing[depth]
  for value, shape, axis in zip(values, shapes, in_axes):
    if (axis is not None and shape and shape[axis % len(shape)] == local and
        state.origin_of(value) is None):
      raise _not_an_input(options.axis_name, known, local)


def _not_an_input(axis_name, known, size):
  return ValueError(
      f"pmap: the nested pmap over axis {axis_name!r} has global size "
      f"{known}, which crosses processes, but a mapped argument has size "
      f"{size} and is not an input of the outermost pmap; with several "
      f"processes only the outermost pmap's inputs can be each process's "
      f"part of an axis crossing processes: map the inputs of the "
      f"outermost pmap (docs/multiprocess.md).")


def top_size(size, crossing, names):
  """The outermost axis's global size, of `size` in each process.

  Every process's devices hold as many grid positions, so the grid holds
  the process count times theirs; the nested axes in `crossing` (depth ->
  `axis_env.Crossing`, `names` their axis names) take their global sizes
  of it.
  """
  count = devices_lib.process_count() * size
  for axis in crossing.values():
    count *= axis.local
  inner = math.prod(axis.size for axis in crossing.values())
  if count % inner:
    processes = devices_lib.process_count()
    axes = ", ".join(f"{names[depth]!r} ({axis.size})"
                     for depth, axis in crossing.items())
    raise ValueError(
        f"pmap: the nested axes crossing processes, {axes}, have global "
        f"sizes whose product {inner} does not divide the {count} grid "
        f"positions the processes' inputs hold ({processes} processes "
        f"passing {count // processes} each); the outermost axis takes the "
        f"positions left, so give those nested pmaps axis_size= values "
        f"whose product divides {count}, each a multiple of the positions "
        f"a process passes along its axis (docs/multiprocess.md).")
  return count // inner


def _register_nested_axis(state, axis_name, size, depth, mesh_dim):
  """Adds the mesh dimension of a nested pmap at `depth`, or reuses it.

  A shard_map names the dimension of each of its axes (`mesh_dim`); other
  pmaps take `axis_<depth>`, or another name if a shard_map's axis has it.
  """
  if depth < len(state.mesh_axes):
    known = state.mesh_axes[depth]
    if known.size != size:
      raise ValueError(
          f"nested pmaps at the same depth must have the same size to share "
          f"a mesh dimension: axis {axis_name!r} has size {size}, another "
          f"pmap at that depth has size {known.size}.")
    return known.dim
  total = size
  for outer in state.mesh_axes:
    total *= outer.size
  if total > state.max_devices:
    shape = " x ".join(str(a.size) for a in state.mesh_axes) + f" x {size}"
    message = (f"compiling computation that requires {total} replicas "
               f"({shape} nested pmaps), but only {state.max_devices} devices "
               f"are available (num_replicas={total}).")
    if state.parts and not state.given_devices:
      held = total // devices_lib.process_count()
      message += (
          f" With several processes each process passes, for each mapped "
          f"input, the block of the global array its own devices hold: this "
          f"process's inputs hold {held} positions of the nested pmaps' "
          f"grid, but it has {devices_lib.local_device_count()} devices. "
          f"Pass the positions of its devices only, and give a nested pmap "
          f"whose axis crosses processes its global size as axis_size= "
          f"(docs/multiprocess.md); or use tfspmd.shard_map over a "
          f"tfspmd.make_mesh of tfspmd.devices().")
    raise ValueError(message)
  taken = {axis.dim for axis in state.mesh_axes}
  dim = mesh_dim or mesh_lib.mesh_dim_name(depth)
  while dim in taken:
    dim = "_" + dim
  state.mesh_axes.append(mesh_lib.MeshAxis(axis_name, size, dim))
  return dim


def check_parts(state, top_local):
  """Raises unless this process's devices hold the part its inputs hold.

  The axes of a trace whose nested axes cross processes
  (`state.crossing`) form a grid over the devices in process order, outer
  axis slowest, as in one process; each process passes the blocks of its
  devices' positions.

  Args:
    state: The trace's `TraceState`, every nested axis registered.
    top_local: The outermost axis's size in this process's inputs.
  """
  names = [axis.name for axis in state.mesh_axes]
  sizes = [axis.size for axis in state.mesh_axes]
  local = [top_local] + [
      state.crossing[depth].local if depth in state.crossing else size
      for depth, size in enumerate(sizes) if depth]
  block = placement_lib.process_block(
      np.array(state.mesh_key().devices, dtype=object).reshape(sizes))
  if block.is_block and list(block.extents) == local:
    return
  grid = " x ".join(f"{name!r} ({size})" for name, size in zip(names, sizes))
  if block.is_block:
    problem = (f"they hold {list(block.extents)} positions along the axes, "
               f"but its inputs hold {local}. Pass, for each mapped input, "
               f"arrays of leading shape {tuple(block.extents)}: the "
               f"positions of its devices along each axis, outermost first")
  else:
    problem = (f"they are not a block of it (every combination of their "
               f"positions along the axes), so its part of an array would "
               f"not be an array. Choose sizes for which each process's "
               f"{math.prod(local)} devices are a block: the product of the "
               f"innermost sizes times a divisor of the next one out")
  raise ValueError(
      f"pmap: with several processes the nested pmaps' axes {grid} form a "
      f"grid over tfspmd.devices() in process order (outer axis slowest), "
      f"and process {block.process}'s devices lie at its positions "
      f"{list(block.held)}: {problem} (docs/multiprocess.md).")
