"""shard_map with several processes: each process passes its part.

A shard_map's mesh may hold the devices of every process. Each process then
passes, and gets back, its part of every global array: along a dimension
its spec splits over mesh axes, the blocks of the mesh positions its
devices hold, in order; along any other dimension, the whole extent. The
devices of one process must form a block of the mesh (every combination of
the positions they hold along each axis), as they do in a mesh made over
`tfspmd.devices()` in process order, so that its part is an array.

The host part of every input is placed here, as the global DTensor the
pmaps of the mesh's axes take, each device getting its block; DTensor
inputs (earlier results) are global already.
"""

import functools
import math

from tfspmd._src.runtime import placement as placement_lib


@functools.lru_cache(maxsize=64)
def local_extents(mesh):
  """For each axis name of `mesh`, how many positions this process holds.

  Raises:
    ValueError: If this process holds no device of `mesh`, or its devices
      are not a block of the mesh.
  """
  block = placement_lib.process_block(mesh.devices)
  me, held = block.process, list(block.held)
  if not held:
    raise ValueError(
        f"shard_map: the mesh {mesh} holds no device of process {me}; with "
        f"several processes every process calls shard_map with the same "
        f"mesh, made over the devices of all of them "
        f"(tfspmd.make_mesh(shape, names) uses tfspmd.devices()), and holding "
        f"some of each process's devices.")
  if not block.is_block:
    raise ValueError(
        f"shard_map: the devices of process {me} are not a block of the mesh "
        f"{mesh}: they lie at positions {held}. With several processes each "
        f"process's devices must hold every combination of their positions "
        f"along the axes, so that its part of an array is an array; make the "
        f"mesh over tfspmd.devices() in process order "
        f"(tfspmd.make_mesh(shape, names)).")
  return dict(zip(mesh.axis_names, block.extents))


def check_spec(spec, mesh, path, argument):
  """Raises if `spec` splits a dimension over axes a part cannot follow.

  A dimension split over several axes is split over their product, the
  first major: where a later axis crosses processes, a process's blocks
  along the dimension do not lie next to each other in the global array,
  so they would not make its part. Only the first may cross processes.
  """
  extents = local_extents(mesh)
  for dimension in range(len(spec)):
    names = spec.axes_of(dimension)
    crossing = [name for name in names[1:] if extents[name] < mesh.shape[name]]
    if crossing:
      raise ValueError(
          f"shard_map: {argument} spec {spec} for {path} splits dimension "
          f"{dimension} over {names}, and the later axis {crossing[0]!r} "
          f"crosses processes; with several processes only the first axis "
          f"splitting a dimension may. Name {crossing[0]!r} first there, or "
          f"split another dimension over it.")


def place_part(value, spec, mesh, path):
  """The global DTensor of this process's part `value`, expanded.

  Args:
    value: This process's part, a NumPy array.
    spec: Its `PartitionSpec`.
    mesh: The shard_map's `Mesh`.
    path: The argument's pytree path, for errors.

  Returns:
    A DTensor on the mesh's DTensor mesh with each mesh axis of `spec` an
    axis of its own, just before its block, split over its mesh dimension:
    shard_map's expanded form of the global array.
  """
  check_spec(spec, mesh, path, "in")
  extents = local_extents(mesh)
  dim_of = dict(zip(mesh.axis_names, mesh.dim_names))
  shape, split = [], []
  for dimension, size in enumerate(value.shape):
    names = spec.axes_of(dimension)
    count = math.prod(extents[name] for name in names)
    if size % count:
      held = " x ".join(f"{extents[name]} along {name!r}" for name in names)
      raise ValueError(
          f"shard_map: this process's part of {path} has size {size} along "
          f"dimension {dimension}, which the in spec {spec} splits into the "
          f"blocks of this process's mesh positions ({held}): {size} is not "
          f"divisible by {count}. With several processes each passes its "
          f"part of the global array (docs/multiprocess.md).")
    shape += [extents[name] for name in names] + [size // count]
    split += [dim_of[name] for name in names] + [None]
  placement = placement_lib.Placement(mesh.mesh_key, tuple(split))
  return placement_lib.pack_host_array(value.reshape(shape), placement)
