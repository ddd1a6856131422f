"""DTensor meshes: one mesh dimension per mapped axis, built once and cached."""

import functools
import re
from typing import NamedTuple

import numpy as np
from tensorflow.experimental import dtensor

from tfspmd._src.runtime import devices as devices_lib


def mesh_dim_name(depth):
  """The DTensor mesh dimension for the pmap axis at nesting `depth`.

  Named by depth, not by the user's axis name, so pmaps with other axis
  names over the same devices share one mesh: their results go into each
  other with no copy, also inside a user's tf.function, where DTensor needs
  every input of an op on the same mesh. A shard_map's axes are named as
  its `Mesh` names them instead (`Mesh.dim_names`), so that DTensor code
  lays data out on `Mesh.dtensor_mesh` with the user's names.
  """
  return f"axis_{depth}"


# DTensor passes layouts as text: these words have a meaning there, and
# other characters break its parser ("," and "|" crash the process, " " and
# "=" fail; TF 2.21).
_RESERVED_DIM_NAMES = frozenset(("unsharded", "any", "match"))
_DIM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def dim_name_problem(name):
  """Why `name` cannot name a DTensor mesh dimension, or None if it can."""
  if not isinstance(name, str):
    return f"it is a {type(name).__name__}, not a str"
  if name in _RESERVED_DIM_NAMES:
    return ("DTensor reserves it in layouts (with 'unsharded', 'any' and "
            "'match')")
  if not _DIM_NAME.fullmatch(name):
    return ("DTensor takes only letters, digits, '_', '-' and '.' (not "
            "first) in a mesh dimension name")
  return None


class MeshAxis(NamedTuple):
  """One pmap level's axis on its program's mesh.

  Attributes:
    name: The axis name the mapped function uses.
    size: The axis size.
    dim: The mesh dimension it lies on.
  """
  name: object
  size: int
  dim: str


class MeshKey(NamedTuple):
  """What identifies a mesh: the arguments of `mesh_for_axes`.

  Attributes:
    dim_names: The mesh dimension names, outermost first.
    sizes: Their sizes.
    devices: One `Device` per mesh position, in row-major order.
  """
  dim_names: tuple
  sizes: tuple
  devices: tuple


@functools.lru_cache(maxsize=256)
def mesh_for_axes(dim_names, sizes, devices):
  """The DTensor mesh with dimensions `dim_names` of `sizes` over `devices`.

  Args:
    dim_names: Tuple of mesh dimension names, outermost first.
    sizes: Tuple of their sizes.
    devices: Tuple of `Device`, one per mesh position in row-major order.

  Returns:
    A `dtensor.Mesh`; the same object for the same arguments.
  """
  count = int(np.prod(sizes))
  if len(devices) != count:
    raise ValueError(
        f"a mesh of shape {dict(zip(dim_names, sizes))} needs {count} devices, "
        f"got {len(devices)}.")
  me = devices_lib.process_index()
  local_positions = [p for p, d in enumerate(devices) if d.process_index == me]
  names = [d.name for d in devices]
  global_devices = names if devices_lib.process_count() > 1 else None
  return dtensor.Mesh(
      list(dim_names),
      global_device_ids=np.arange(count).reshape(sizes),
      local_device_ids=local_positions,
      local_devices=[names[p] for p in local_positions],
      global_devices=global_devices)


def layout_on(key, spec):
  """The DTensor layout splitting each tensor axis over `spec`'s mesh dim.

  An axis split over a mesh dimension of size 1 is whole on every device,
  and is laid out so: DTensor tells the two layouts apart although they
  hold the same values, and refuses some ops (a Transpose) between them,
  which the gradient of a program on a mesh with size-1 axes (`dp` of an
  LLM's `('dp', 'fsdp', 'tp', 'sp')` mesh) would otherwise meet.

  Args:
    key: The `MeshKey` of the mesh (or a tuple of its three fields).
    spec: One entry per tensor axis: a mesh dimension name, or None (or
      `dtensor.UNSHARDED`) where every device holds the whole axis.

  Returns:
    A `dtensor.Layout` on `mesh_for_axes(*key)`.
  """
  dim_names, sizes, _ = key
  size_of = dict(zip(dim_names, sizes))
  return dtensor.Layout(
      [dtensor.UNSHARDED if dim is None or size_of.get(dim) == 1 else dim
       for dim in spec], mesh_for_axes(*key))


def mesh_key(mesh_axes, devices):
  """The mesh of `mesh_axes` (`MeshAxis`es, outermost first) on `devices`.

  The mesh is over the first devices of each process, process by process:
  the outermost axis spans the processes; a nested pmap's axes lie within
  each process, as in JAX.
  """
  dims = tuple(axis.dim for axis in mesh_axes)
  sizes = tuple(axis.size for axis in mesh_axes)
  count = int(np.prod(sizes))
  if len(devices) == count:
    return MeshKey(dims, sizes, tuple(devices))
  per_process = count // devices_lib.process_count()
  chosen = []
  for process in range(devices_lib.process_count()):
    own = [d for d in devices if d.process_index == process]
    chosen += own[:per_process]
  return MeshKey(dims, sizes, tuple(chosen))
